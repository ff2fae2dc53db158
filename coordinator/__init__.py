"""The central coordinator (installed as ckptd.coordinator).

server.py   Coordinator state and its gRPC service
jobs.py     the job registry, persisted under $CKPTD_HOME/jobs
nodes.py    agents, heartbeats, liveness
catalog.py  committed checkpoints, read from storage
barrier.py  the checkpoint round: prepare, dump, resume, finalize, commit
restart.py  restarting a job from a checkpoint
policy.py   periodic checkpoints
"""
