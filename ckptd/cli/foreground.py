"""The foreground launcher: `ckptd launch` and `ckptctl restart --attach`.

The job's output passes through, the exit status is the job's, signals are
forwarded to it, except the checkpoint signals (--checkpoint-signal, TERM
unless --sigterm forward): those take a final checkpoint and stop the job,
and the launcher exits 128+SIG, which a batch script reads as "requeue me"
(examples/slurm/).  Its output stream is a guard (FollowOutputRequest.guard):
if the launcher dies without ending the job (kill -9), the agent sees the
stream drop and the coordinator takes the final checkpoint itself.
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING

from ckptd.client import exit_status
from ckptd.errors import CkptdError, Code
from ckptd.jobstate import JobState

from .common import lazy_function, lazy_module, note

if TYPE_CHECKING:
    import grpc

    from ckptd.rpc import agent_stub, call
    from ckptd.v1 import ckptd_pb2 as pb
    from ckptd.v1 import ckptd_pb2_grpc as pb_grpc
else:  # loaded on first use: `ckptd --help` builds its flags from here
    grpc = lazy_module("grpc")
    pb = lazy_module("ckptd.v1.ckptd_pb2")
    agent_stub, call = (lazy_function("ckptd.rpc", f) for f in ("agent_stub", "call"))

FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)
FINAL_CHECKPOINT_TRIES = 5


def signal_flags(p: argparse.ArgumentParser) -> None:
    """--checkpoint-signal and --sigterm, for launch and restart --attach."""
    p.add_argument(
        "--checkpoint-signal", action="append", metavar="SIG", default=[],
        help="on SIG (a name, USR1 or SIGUSR1, or a number; repeatable): take a final checkpoint, stop the job "
        "and exit 128+SIG, the status a batch script requeues on (TERM is one unless --sigterm forward)",
    )  # fmt: skip
    p.add_argument(
        "--sigterm", choices=("checkpoint", "forward"), default="checkpoint",
        help="on SIGTERM: take a final checkpoint and stop the job (default), or pass SIGTERM to it",
    )  # fmt: skip


def signal_number(text: str) -> int:
    name = text.upper()
    try:
        sig = (
            signal.Signals(int(name))
            if name.isdigit()
            else signal.Signals[name if name.startswith("SIG") else f"SIG{name}"]
        )
    except (KeyError, ValueError):
        raise CkptdError(Code.INVALID_ARGUMENT, f"--checkpoint-signal {text}: not a signal name or number") from None
    if sig in (
        signal.SIGKILL,
        signal.SIGSTOP,
        signal.SIGCHLD,
        signal.SIGSEGV,
        signal.SIGBUS,
        signal.SIGFPE,
        signal.SIGILL,
    ):
        raise CkptdError(
            Code.INVALID_ARGUMENT, f"--checkpoint-signal {text}: {sig.name} cannot be caught to checkpoint"
        )
    return int(sig)


def checkpoint_signals(args: argparse.Namespace) -> frozenset[int]:
    sigs = {signal_number(s) for s in args.checkpoint_signal}
    if args.sigterm == "forward" and signal.SIGTERM in sigs:
        raise CkptdError(Code.INVALID_ARGUMENT, "--sigterm forward and --checkpoint-signal TERM contradict: pick one")
    if args.sigterm == "checkpoint":
        sigs.add(signal.SIGTERM)
    return frozenset(sigs)


def checkpoint_log_size(info: pb.CheckpointInfo) -> int | None:
    """How much of the job's log a checkpoint holds (the log is cut back to
    it on restart): where a resumed launcher's output starts, the earlier
    output having passed through the launcher that was preempted.  None if
    unknown (an encrypted or remote log)."""
    with contextlib.suppress(OSError):
        return (Path(info.path) / "output.log").stat().st_size
    return None


class Foreground:
    def __init__(self, coord: pb_grpc.CoordinatorStub, job: str, ckpt_signals: frozenset[int]) -> None:
        self.coord = coord
        self.job = job
        self.ckpt_signals = ckpt_signals
        self.stopped_by = 0  # the checkpoint signal whose final checkpoint stopped the job
        self.preempting: list[threading.Thread] = []
        # the status the job's output ended with: a final checkpoint some other
        # process took (the daemon's, under Slurm) shows here when the
        # coordinator that took it has already exited
        self.ended: pb.JobStatus | None = None
        self.end = threading.Event()

    def run(self, agent_address: str, followed: str, offset: int, multi: bool) -> int:
        for sig in set(FORWARDED) | self.ckpt_signals:
            signal.signal(sig, self._on_signal)
        agent = agent_stub(agent_address)
        out, err = sys.stdout.buffer, sys.stderr.buffer
        # guard: if this process dies (kill -9), the job is stopped after a final checkpoint
        # hold_sigterm: the job's own processes' SIGTERM (scancel signals them too) waits for the final checkpoint
        hold = signal.SIGTERM in self.ckpt_signals
        req = pb.FollowOutputRequest(job=followed, offset=offset, follow=True, guard=True, hold_sigterm=hold)
        try:
            for chunk in agent.FollowOutput(req):
                if chunk.end:
                    self.ended = chunk.status
                    self.end.set()
                    for t in self.preempting:  # the job stopped for it: let it say so
                        t.join(timeout=6 * 3600)
                    st = chunk.status
                    if multi:  # rank 0's output ended: the job ends with its last rank
                        st = _wait_ranks(self.coord, self.job, st)
                    if st.state == JobState.STOPPED.pb and self.stopped_by:
                        return 128 + self.stopped_by
                    return exit_status(st)
                stream = err if chunk.stream == 2 else out
                stream.write(chunk.data)
                stream.flush()
        except grpc.RpcError as e:
            raise CkptdError.from_rpc(e, "the agent") from None
        return 1

    def _on_signal(self, signum: int, _frame: object) -> None:
        if signum in self.ckpt_signals:
            if self.preempting:
                return  # one final checkpoint (Slurm may follow its warning signal with SIGTERM)
            t = threading.Thread(target=self._preempt, args=(signum,), daemon=True)
            self.preempting.append(t)
            t.start()
            return
        threading.Thread(target=self._forward, args=(signum,), daemon=True).start()

    def _forward(self, signum: int) -> None:
        try:
            call(self.coord.SignalJob, pb.SignalRequest(job=self.job, signal=signum), 10, "coordinator")
        except CkptdError as e:
            note(f"ckptd: could not forward signal {signum}: {e.message}")

    def _preempt(self, signum: int) -> None:
        """A final checkpoint, then the job stops; `ckptd launch --resume`
        (or `ckptctl restart`) resumes it later."""
        name = signal.Signals(signum).name
        note(f"ckptd: {name}: taking a final checkpoint of job {self.job}, then stopping it")
        err = ""
        for attempt in range(FINAL_CHECKPOINT_TRIES):
            try:
                req = pb.CheckpointRequest(job=self.job, then_stop=True)
                info = call(self.coord.Checkpoint, req, 6 * 3600, "coordinator")
                self.stopped_by = signum
                note(f"ckptd: job {self.job} stopped after {info.name}; `ckptd launch --resume --job {self.job}` "
                     f"resumes it; exit {128 + signum} (requeue)")  # fmt: skip
                return
            except CkptdError as e:
                err = e.message
            # another final checkpoint (the daemon's, under Slurm) may have stopped it; that daemon
            # exits once it has, so the end of the job's output may be the only one left to say so
            st = self.ended
            with contextlib.suppress(CkptdError):
                st = call(self.coord.GetJob, pb.GetJobRequest(job=self.job), 10, "coordinator")
            if st is not None and st.state == JobState.STOPPED.pb:
                self.stopped_by = signum
                # the coordinator's status names the checkpoint; the agent's says it in its message
                why = f"stopped after {st.last_checkpoint.name}" if st.last_checkpoint.name else st.message
                note(f"ckptd: job {self.job} {why.split(';')[0] or 'stopped'}; exit {128 + signum} (requeue)")
                return
            if st is not None and not JobState.of(st.state).live:
                return
            if attempt + 1 < FINAL_CHECKPOINT_TRIES:
                self.end.wait(1.0)
        note(f"ckptd: final checkpoint failed ({err}); passing {name} to the job")
        with contextlib.suppress(CkptdError):
            call(self.coord.SignalJob, pb.SignalRequest(job=self.job, signal=signum), 10, "coordinator")


def _wait_ranks(coord: pb_grpc.CoordinatorStub, job: str, rank0: pb.JobStatus) -> pb.JobStatus:
    if rank0.state != JobState.EXITED.pb:
        return rank0  # killed, failed or stopped: this launch is over
    seen = pb.JobStatus()
    while True:
        req = pb.WaitJobRequest(job=job, timeout_s=60, known_state=seen.state, known_generation=seen.generation)
        st = seen = call(coord.WaitJob, req, 90, "coordinator")
        if not JobState.of(st.state).live:
            return st


def attach_after_restart(coord: pb_grpc.CoordinatorStub, resp: pb.RestartResponse, ckpt_signals: frozenset[int]) -> int:
    """Follow a job just restarted from resp.checkpoint, in the foreground."""
    st = resp.status
    multi = len(st.ranks) > 0
    node = st.ranks[0].node if multi else st.node
    followed = f"{st.name}@0" if multi else st.name
    nodes = call(coord.ListNodes, pb.Empty(), 10, "coordinator")
    address = next((n.address for n in nodes.nodes if n.node == node), "")
    if not address:
        raise CkptdError(Code.UNAVAILABLE, f"node {node} is not reachable to follow job {st.name}'s output")
    offset = checkpoint_log_size(resp.checkpoint)
    if offset is None or multi:
        offset = 0
        note(
            f"ckptd: job {st.name}'s output is shown from its start (the checkpoint's share of it is not readable here)"
        )
    return Foreground(coord, st.name, ckpt_signals).run(address, followed, offset, multi)
