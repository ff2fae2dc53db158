"""`ckptd.Client`: drive ckptd from Python (a scheduler, a notebook).

The same gRPC calls `ckptctl` makes, as methods::

    from ckptd import Client

    c = Client()                                  # the local daemon (started on demand)
    c.launch(["python3", "train.py"], job="run1", interval=600)
    c.checkpoint("run1")
    c.restart("run1")                             # after a crash: from the latest checkpoint
    status = c.wait("run1")                       # blocks until the job ends, across restarts
    print(exit_status(status), c.logs_text("run1"))

Methods return the protobuf messages of ckptd/v1 (`JobStatus`,
`CheckpointInfo`, ...); `JobState.of(status.state)` reads a state.  A failure
raises `CkptdError`, whose `.code` (a `Code`) is what ckptctl turns into its
exit status.  One Client may be used from several threads.
"""

from __future__ import annotations

import builtins
import os
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

from ckptd.errors import CkptdError, Code
from ckptd.jobstate import JobState

if TYPE_CHECKING:
    from ckptd.v1 import ckptd_pb2 as pb
    from ckptd.v1 import ckptd_pb2_grpc as pb_grpc

LONG_RPC_S = 6 * 3600.0
STDOUT, STDERR = 1, 2


class LogChunk(NamedTuple):
    """A piece of a job's output: stream 1 (stdout) or 2 (stderr), and its bytes."""

    stream: int
    data: bytes


def exit_status(status: pb.JobStatus) -> int:
    """The shell's view of an ended job: its exit code, 128+N for signal N,
    143 for a job stopped after a final checkpoint (a preemption)."""
    import signal

    if status.state == JobState.STOPPED.pb:
        return 128 + signal.SIGTERM
    if not status.has_exit:  # failed or lost without an exit of its own
        return 1
    if status.exit_signal:
        return 128 + status.exit_signal
    return status.exit_code


class Client:
    """A connection to a ckptd coordinator.

    address: "unix:/path" or "HOST:PORT" (mutual TLS, with $CKPTD_TLS_DIR);
    default $CKPTD_COORDINATOR, else the local daemon of $CKPTD_HOME, which
    is started on first use unless start_daemon is False (then a call raises
    CkptdError with Code.UNAVAILABLE when none is running)."""

    def __init__(self, address: str | None = None, *, start_daemon: bool = True) -> None:
        self._address = address
        self._start = start_daemon
        self._stub: pb_grpc.CoordinatorStub | None = None

    @property
    def coordinator(self) -> pb_grpc.CoordinatorStub:
        """The coordinator's gRPC stub (connected, and the daemon started, on first use)."""
        if self._stub is None:
            from ckptd.daemon import coordinator_address
            from ckptd.paths import Home
            from ckptd.rpc import coordinator_stub

            self._stub = coordinator_stub(self._address or coordinator_address(Home.from_env(), start=self._start))
        return self._stub

    def _call(self, method: str, request: object, timeout: float | None) -> object:
        from ckptd.rpc import call

        return call(getattr(self.coordinator, method), request, timeout, "coordinator")

    # ---- jobs ----

    def launch(
        self,
        argv: Sequence[str],
        *,
        job: str | None = None,
        ckpt_dir: str | os.PathLike[str] | None = None,
        interval: float | None = None,
        env: dict[str, str] | None = None,
        cwd: str | os.PathLike[str] | None = None,
        auto_restart: bool = False,
        max_restarts: int = 0,
        keep: int | None = None,
        node: str | None = None,
    ) -> pb.JobStatus:
        """Start argv under checkpoint control, detached (its output goes to
        its log: `logs`), as `ckptd launch --detach` does.  env defaults to
        this process's environment, cwd to its directory; interval: seconds
        between periodic checkpoints; auto_restart: come back from the latest
        checkpoint when the job is SIGKILLed or its node is lost, at most
        max_restarts times (0: no limit).  Returns the job's status (its name
        is `.name`, generated when job is None)."""
        from ckptd import limits
        from ckptd.v1 import ckptd_pb2 as pb

        if not argv:
            raise CkptdError(Code.INVALID_ARGUMENT, "no command to run")
        if job is not None:
            limits.check_job_name(job)
        mask = os.umask(0o077)
        os.umask(mask)
        spec = pb.JobSpec(
            name=job or "",
            argv=list(argv),
            env=dict(os.environ if env is None else env),
            cwd=os.path.abspath(cwd or os.getcwd()),
            ckpt_dir=os.path.abspath(ckpt_dir) if ckpt_dir else "",
            interval_s=interval or 0.0,
            uid=os.getuid(),
            auto_restart=auto_restart or bool(max_restarts),
            max_restarts=max_restarts,
            keep_last=keep or 0,
            umask=mask,
        )
        resp = self._call("LaunchJob", pb.LaunchJobRequest(spec=spec, node=node or ""), 90)
        return resp.status  # type: ignore[attr-defined, no-any-return]

    def status(self, job: str) -> pb.JobStatus:
        """The job's state, node, processes and latest checkpoint."""
        from ckptd.v1 import ckptd_pb2 as pb

        return self._call("GetJob", pb.GetJobRequest(job=job), 30)  # type: ignore[return-value]

    def jobs(self) -> list[pb.JobStatus]:
        """Every job of the caller's, oldest first."""
        from ckptd.v1 import ckptd_pb2 as pb

        return list(self._call("ListJobs", pb.ListJobsRequest(), 30).jobs)  # type: ignore[attr-defined]

    def list(self, job: str) -> list[pb.CheckpointInfo]:
        """The job's committed checkpoints, oldest first."""
        from ckptd.v1 import ckptd_pb2 as pb

        resp = self._call("ListCheckpoints", pb.ListCheckpointsRequest(job=job), 60)
        return list(resp.checkpoints)  # type: ignore[attr-defined]

    def checkpoint(self, job: str, *, timeout: float | None = None, then_stop: bool = False) -> pb.CheckpointInfo:
        """Take a checkpoint now (the job keeps running unless then_stop);
        timeout: seconds the job's threads have to park (default 10)."""
        from ckptd.v1 import ckptd_pb2 as pb

        req = pb.CheckpointRequest(job=job, timeout_s=timeout or 0.0, then_stop=then_stop)
        return self._call("Checkpoint", req, LONG_RPC_S)  # type: ignore[return-value]

    def restart(self, job: str, *, from_id: int | None = None, force: bool = False) -> pb.RestartResponse:
        """Restart the job from its latest checkpoint (or checkpoint from_id);
        force: kill it first if it still runs."""
        from ckptd.v1 import ckptd_pb2 as pb

        req = pb.RestartRequest(job=job, from_id=from_id or 0, force=force)
        return self._call("Restart", req, LONG_RPC_S)  # type: ignore[return-value]

    def kill(self, job: str) -> pb.JobStatus:
        """Kill every process of the job (it can be restarted later)."""
        from ckptd.v1 import ckptd_pb2 as pb

        return self._call("KillJob", pb.KillJobRequest(job=job), 60)  # type: ignore[return-value]

    def remove(self, job: str, *, keep_checkpoints: bool = False) -> builtins.list[str]:
        """Forget an ended job: its record and, unless keep_checkpoints, its
        checkpoints (returns their names).  A running job is refused."""
        from ckptd.v1 import ckptd_pb2 as pb

        req = pb.RemoveJobRequest(job=job, keep_checkpoints=keep_checkpoints)
        return list(self._call("RemoveJob", req, LONG_RPC_S).removed)  # type: ignore[attr-defined]

    def wait(
        self,
        job: str,
        timeout: float | None = None,
        *,
        on_change: Callable[[pb.JobStatus], None] | None = None,
    ) -> pb.JobStatus:
        """Block until the job has ended for good (exited, killed or stopped),
        across restarts: a SIGKILLed job may still be restarted, so it is
        waited for.  Returns its last status (`exit_status()` gives the
        shell's number); raises CkptdError(Code.DEADLINE_EXCEEDED) after
        timeout seconds.  on_change sees every other state it passes through."""
        from ckptd.v1 import ckptd_pb2 as pb

        deadline = time.monotonic() + timeout if timeout else None
        seen = pb.JobStatus()
        while True:
            left = 60.0 if deadline is None else max(0.0, deadline - time.monotonic())
            req = pb.WaitJobRequest(
                job=job, timeout_s=min(left, 60.0), known_state=seen.state, known_generation=seen.generation
            )
            st: pb.JobStatus = self._call("WaitJob", req, min(left, 60.0) + 30)  # type: ignore[assignment]
            if JobState.of(st.state).ended:
                return st
            if on_change is not None and (st.state, st.generation) != (seen.state, seen.generation):
                on_change(st)
            seen = st
            if deadline is not None and time.monotonic() >= deadline:
                raise CkptdError(Code.DEADLINE_EXCEEDED, f"job {job} still {JobState.of(st.state)} after {timeout} s")

    # ---- output ----

    def log_path(self, job: str, rank: int = 0) -> Path:
        """The job's log file (output.log; a multi-node job's: rank's)."""
        return self.log_target(self.status(job), rank)[0]

    def log_target(self, st: pb.JobStatus, rank: int) -> tuple[Path, str, str]:
        """(log file, node, name the agent knows it by) of the job or one rank."""
        if not st.ranks:
            return Path(st.log_path), st.node, st.name
        r = next((r for r in st.ranks if r.rank == rank), None)
        if r is None:
            raise CkptdError(Code.NOT_FOUND, f"job {st.name} has ranks 0 to {len(st.ranks) - 1}, not {rank}")
        return Path(st.log_path).parent.parent / f"rank-{rank}" / "output.log", r.node, f"{st.name}@{rank}"

    def follow_output(self, job: str, *, offset: int = 0, rank: int = 0) -> Iterator[pb.OutputChunk]:
        """The job's output from byte offset of its log, as the agent streams
        it, across restarts, until the job ends: the last chunk has end set
        and the job's status."""
        from ckptd.rpc import agent_stub
        from ckptd.v1 import ckptd_pb2 as pb

        st = self.status(job)
        _, node, name = self.log_target(st, rank)
        nodes = self._call("ListNodes", pb.Empty(), 10)
        address = next((n.address for n in nodes.nodes if n.node == node), "")  # type: ignore[attr-defined]
        if not address:
            raise CkptdError(Code.UNAVAILABLE, f"node {node} is not reachable to follow the log")
        import grpc

        req = pb.FollowOutputRequest(job=name, offset=offset, follow=True, across_restarts=True)
        try:
            yield from agent_stub(address).FollowOutput(req)
        except grpc.RpcError as e:
            raise CkptdError.from_rpc(e, "the agent") from None

    def logs(
        self, job: str, *, follow: bool = False, tail: int | None = None, stream: str = "both", rank: int = 0
    ) -> Iterator[LogChunk]:
        """The job's output so far (tail: only its last lines), and with
        follow, what it writes next until it ends (across restarts).
        stream: "both", "stdout" or "stderr"."""
        st = self.status(job)
        path = self.log_target(st, rank)[0]
        chunks, end = read_log(path, stream, tail)
        yield from chunks
        if follow and JobState.of(st.state).live:
            for c in self.follow_output(job, offset=end, rank=rank):
                if c.end:
                    return
                if wanted(c.stream, stream):
                    yield LogChunk(c.stream, c.data)

    def logs_text(self, job: str, stream: str = "both", rank: int = 0) -> str:
        """The job's output so far as one string."""
        return b"".join(c.data for c in self.logs(job, stream=stream, rank=rank)).decode(errors="replace")


def wanted(chunk_stream: int, stream: str) -> bool:
    return stream == "both" or (stream == "stdout") == (chunk_stream == STDOUT)


def read_log(path: Path, stream: str = "both", tail: int | None = None) -> tuple[list[LogChunk], int]:
    """A job's log file as chunks of the chosen stream (tail: its last
    lines only), and the offset where it ended (to follow from)."""
    from ckptd.agent.output import LogFollower

    if not path.exists():
        raise CkptdError(Code.NOT_FOUND, f"no log at {path}")
    follower = LogFollower(path, path.with_suffix(".idx"))
    chunks = [LogChunk(c.stream, c.data) for c in follower.poll() if wanted(c.stream, stream)]
    if tail is not None:
        chunks = _last_lines(chunks, tail)
    return chunks, follower.offset


def _last_lines(chunks: list[LogChunk], n: int) -> list[LogChunk]:
    """The chunks that hold the last n lines (a line unfinished at the end counts as one)."""
    if n <= 0:
        return []
    buf = b"".join(c.data for c in chunks)
    body = buf[:-1] if buf.endswith(b"\n") else buf  # the final newline ends the last line
    pos = len(body)
    for _ in range(n):
        pos = body.rfind(b"\n", 0, pos)
        if pos < 0:
            return chunks
    start, out, at = pos + 1, [], 0
    for c in chunks:
        if at + len(c.data) > start:
            out.append(LogChunk(c.stream, c.data[max(0, start - at) :]))
        at += len(c.data)
    return out
