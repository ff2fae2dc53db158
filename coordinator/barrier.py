"""The checkpoint round (barrier protocol v1), driven by the coordinator.

    0 reserve   next id; create <job dir>/.ckpt-N.tmp-XXXX (fails early on
                read-only or missing storage, before the job is touched)
    1 prepare   every rank quiesces (Agent.Prepare); any failure -> abort
    2 dump      every rank writes its images into the temporary directory,
                and the job's output log position is recorded (Agent.Dump)
    3 resume    the job runs again (Agent.Resume); the stall ends here
    4 finalize  checksums, identities, fsync (Agent.Finalize)
    5 commit    manifest.json written and fsynced, then the directory is
                renamed to ckpt-N: atomic, and only now visible

Abort at any step: Agent.Abort (release parked threads), remove the
temporary directory.  The last committed checkpoint is never touched.
Version 1 has one rank per job; the phases are kept apart so that several
ranks only need the loops in prepare/dump/resume widened (see ARCHITECTURE.md).
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import Callable
from typing import Any

from ckptd.errors import CkptdError, Code
from ckptd.image.manifest import write_manifest
from ckptd.rpc import call
from ckptd.v1 import ckptd_pb2 as pb

from .catalog import Catalog, info_from_manifest
from .jobs import JobRecord, now_rfc3339
from .nodes import NodeRegistry

log = logging.getLogger(__name__)

PROTOCOL_VERSION = 1
DEFAULT_QUIESCE_TIMEOUT_S = 10.0
LONG_RPC_S = 6 * 3600.0


class CheckpointRound:
    def __init__(
        self,
        record: JobRecord,
        nodes: NodeRegistry,
        catalog: Catalog,
        timeout_s: float,
        set_operation: Callable[[str], None],
    ) -> None:
        self.record = record
        self.nodes = nodes
        self.catalog = catalog
        self.timeout_s = timeout_s or DEFAULT_QUIESCE_TIMEOUT_S
        self.set_operation = set_operation

    def run(self) -> pb.CheckpointInfo:
        record = self.record
        if not record.op_lock.acquire(blocking=False):
            raise CkptdError(
                Code.ABORTED,
                f"a checkpoint or restart of job {record.name} is already in progress; retry when it is done",
            )
        try:
            return self._run()
        finally:
            self.set_operation("")
            record.op_lock.release()

    def _run(self) -> pb.CheckpointInfo:
        record, job = self.record, self.record.name
        node = self.nodes.get(record.node)
        if not node.alive:
            raise CkptdError(Code.UNAVAILABLE, f"node {node.name} of job {job} is not answering; cannot checkpoint")
        agent = node.stub
        assert agent is not None
        status = call(agent.GetJob, pb.AgentJobRequest(job=job), 10, f"agent on {node.name}")
        if status.state != "running":
            raise CkptdError(
                Code.FAILED_PRECONDITION, f"job {job} is {status.state}, not running; nothing to checkpoint"
            )

        t0 = time.monotonic()
        job_dir = record.job_dir
        ckpt_id = self.catalog.next_id(job_dir)
        tmp = self.catalog.create_tmp(job_dir, ckpt_id)
        timings: dict[str, float] = {}
        parked = False
        where = f"agent on {node.name}"

        def phase(key: str, text: str, method: Any, request: Any, timeout: float) -> Any:
            self.set_operation(f"checkpoint {ckpt_id}: {text}")
            t = time.monotonic()
            reply = call(method, request, timeout, where)
            timings[key] = time.monotonic() - t
            return reply

        try:
            t_pause = time.monotonic()
            prep = phase(
                "quiesce_s",
                "quiescing",
                agent.Prepare,
                pb.PrepareRequest(job=job, checkpoint_id=ckpt_id, timeout_s=self.timeout_s, dir=str(tmp)),
                self.timeout_s + 30,
            )
            parked = True
            dump = phase(
                "dump_s",
                "writing",
                agent.Dump,
                pb.DumpRequest(job=job, checkpoint_id=ckpt_id, dir=str(tmp)),
                LONG_RPC_S,
            )
            call(agent.Resume, pb.ResumeRequest(job=job, checkpoint_id=ckpt_id), 60, where)
            parked = False
            timings["stall_s"] = time.monotonic() - t_pause  # as seen from outside: an upper bound
            fin = phase(
                "finalize_s",
                "checksums and fsync",
                agent.Finalize,
                pb.FinalizeRequest(job=job, checkpoint_id=ckpt_id, dir=str(tmp)),
                LONG_RPC_S,
            )
            part: dict[str, Any] = json.loads(fin.manifest_part_json)

            self.set_operation(f"checkpoint {ckpt_id}: committing")
            timings["total_s"] = time.monotonic() - t0
            manifest = {
                "job": job,
                "id": ckpt_id,
                "created": now_rfc3339(),
                "node": node.name,
                "protocol": PROTOCOL_VERSION,
                "spec": {
                    "argv": list(record.spec.argv),
                    "cwd": record.spec.cwd,
                    "env": dict(record.spec.env),
                },
                "threads": prep.threads,
                "output": {"log_bytes": dump.log_bytes, "index_bytes": dump.index_bytes},
                "timings": {k: round(v, 6) for k, v in timings.items()},
                "sizes": {
                    "pages_bytes": sum(p.pages_bytes for p in dump.processes),
                    "core_bytes": sum(p.core_bytes for p in dump.processes),
                    "files_bytes": sum(p.files_bytes for p in dump.processes),
                },
                **part,
            }
            write_manifest(tmp, manifest)
            final = self.catalog.commit(tmp, job_dir, ckpt_id)
        except BaseException:
            if parked:
                with contextlib.suppress(CkptdError):
                    call(
                        agent.Abort,
                        pb.ResumeRequest(job=job, checkpoint_id=ckpt_id),
                        60,
                        f"agent on {node.name}",
                    )
            self.catalog.discard(tmp)
            raise
        record.last_checkpoint_at = time.monotonic()
        info = info_from_manifest(job, final)
        log.info(
            "job %s: committed %s (%d bytes, stall %.3f s, total %.3f s)",
            job, final.name, info.size_bytes, timings["stall_s"], timings["total_s"],
        )  # fmt: skip
        return info
