"""The per-node agent (installed as ckptd.agent).

node.py      AgentNode: jobs on this node, registration and heartbeats
server.py    the Agent gRPC service
runtime.py   JobRuntime: one job's incarnations under ckptd-init
shim_link.py the Unix-socket protocol spoken with the shim in every job process
checkpoint.py  prepare / dump / resume / abort / finalize
restore.py   verification, file roll-back and the restore itself
lazy.py      restart --lazy: the pagers that fill a restored job's memory while it runs
output.py    reading the job's log and its stream index
health.py    node health (psutil, NVML)
"""
