"""`ckptctl`: control jobs launched with `ckptd launch`.

Exit status: 0 success; 1 the operation failed; 2 usage; 3 unknown job,
checkpoint or node; 4 not possible in the job's state (running, no
checkpoint, checkpoint in progress); 5 corrupt image; 6 storage not writable
or full; 7 coordinator or node unreachable; 124 timed out.  `ckptctl wait`
exits with the job's own status.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ckptd import __version__, config, limits
from ckptd.errors import EXIT_FAILED, CkptdError, Code
from ckptd.jobstate import RESTARTABLE, JobState
from ckptd.paths import Home

from . import offline
from .common import (
    human_bytes,
    lazy_module,
    note,
    print_json,
    progress_text,
    run_main,
    say,
    setup_cli_logging,
    table,
    to_dict,
    watch_progress,
    with_progress,
)
from .foreground import attach_after_restart, checkpoint_signals, signal_flags

if TYPE_CHECKING:
    from ckptd.client import Client
    from ckptd.v1 import ckptd_pb2 as pb
    from ckptd.v1 import ckptd_pb2_grpc as pb_grpc
else:  # gRPC and protobuf load on first use: read-only commands with no daemon need neither
    pb = lazy_module("ckptd.v1.ckptd_pb2")


def call(method: Any, request: Any, timeout: float | None, what: str) -> Any:
    from ckptd.rpc import call as rpc_call

    return rpc_call(method, request, timeout, what)


LONG_RPC_S = 6 * 3600.0


def _coordinator(start: bool = True) -> pb_grpc.CoordinatorStub:
    return _client(start).coordinator


def _client(start: bool = True) -> Client:
    from ckptd.client import Client

    return Client(start_daemon=start)


def _offline() -> bool:
    """A read-only command with no daemon to ask: answered from the records
    on disk (cli/offline.py), and no daemon is started for it."""
    return not (os.environ.get("CKPTD_COORDINATOR") or offline.daemon_running(Home.from_env()))


def _status_line(st: pb.JobStatus) -> str:
    state = str(JobState.of(st.state))
    if (
        st.has_exit
        and JobState.of(st.state) in (JobState.EXITED, JobState.FAILED, JobState.KILLED)
        and (st.exit_code or st.exit_signal or not st.ranks)
    ):
        state += f" ({'signal ' + str(st.exit_signal) if st.exit_signal else 'status ' + str(st.exit_code)})"
    return state


def _job_exit(st: pb.JobStatus) -> int:
    if st.exit_signal:
        return 128 + st.exit_signal
    return st.exit_code


def cmd_jobs(args: argparse.Namespace) -> int:
    if _offline():
        return offline.cmd_jobs(args)
    resp = call(_coordinator().ListJobs, pb.ListJobsRequest(show_env=args.show_env), 30, "coordinator")
    if args.json:
        print_json(list(resp.jobs))
        return 0
    if not resp.jobs:
        say("no jobs")
        return 0
    rows = [
        [
            j.name,
            _status_line(j),
            j.node,
            str(len(j.pids)),
            j.last_checkpoint.name or "-",
            " ".join(j.spec.argv)[:50],
        ]
        for j in resp.jobs
    ]
    say(table(rows, ["JOB", "STATE", "NODE", "PROCS", "LAST CHECKPOINT", "COMMAND"]))
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    if not args.watch and _offline():
        return offline.cmd_status(args)
    coord = _coordinator()
    if args.watch:
        # follow the checkpoint or restart in flight to its end, then show the job
        in_flight = [True]

        def describe() -> pb.JobStatus:
            st = _phase(coord, args.job)
            in_flight[0] = bool(st.operation)
            return st

        describe()
        if in_flight[0]:
            watch_progress(describe, lambda: in_flight[0])
    st = call(coord.GetJob, pb.GetJobRequest(job=args.job, show_env=args.show_env), 30, "coordinator")
    if args.json:
        d = to_dict(st)
        d["pids"] = list(st.pids)
        print_json(d)
        return 0
    lines = [
        f"job:        {st.name}",
        f"state:      {_status_line(st)}" + (f"  - {st.message}" if st.message else ""),
        f"node:       {st.node}",
        f"command:    {' '.join(st.spec.argv)}",
        f"log:        {st.log_path}",
        f"restarts:   {st.generation}",
    ]
    if args.show_env:
        lines.append("environment:")
        lines += [f"  {k}={v}" for k, v in sorted(st.spec.env.items())]
    if st.operation:
        lines.append(f"in flight:  {progress_text(st)}")
    if st.last_checkpoint.name:
        c = st.last_checkpoint
        lines.append(f"checkpoint: {c.name} ({human_bytes(c.size_bytes)}, {c.created}); {st.checkpoints} in all")
    else:
        lines.append("checkpoint: none")
    if st.ranks:
        lines.append(f"ranks:      {len(st.ranks)}")
        for r in st.ranks:
            msg = f"  - {r.message}" if r.message and r.state != JobState.RUNNING.pb else ""
            lines.append(f"  rank {r.rank:<3} {r.node:<12} {r.vip:<15} {JobState.of(r.state)}{msg}")
    if st.processes:
        lines.append("processes:")
        for p in st.processes:
            shim = "" if p.under_shim else "  (not under the shim)"
            lines.append(f"  host pid {p.host_pid:<8} pid {p.pid:<6} {p.exe}{shim}")
    say("\n".join(lines))
    return 0


def cmd_list(args: argparse.Namespace) -> int:
    if _offline():
        return offline.cmd_list(args)
    resp = call(_coordinator().ListCheckpoints, pb.ListCheckpointsRequest(job=args.job), 60, "coordinator")
    if args.json:
        print_json(list(resp.checkpoints))
        return 0
    if not resp.checkpoints and not resp.in_progress:
        say(f"job {args.job} has no checkpoints")
        return 0
    rows = [
        [
            str(c.id),
            c.name,
            c.created,
            human_bytes(c.size_bytes),
            human_bytes(c.logical_bytes or c.size_bytes),
            c.parent or "-",
            f"{c.duration_s:.2f} s",
            f"{c.stall_s:.2f} s",
            c.node,
        ]
        for c in resp.checkpoints
    ]
    # a round being written: listed, but no restart can use it before it commits
    rows += [[str(c.id), c.name, "in progress", "-", "-", c.parent or "-", "-", "-", c.node] for c in resp.in_progress]
    headers = ["ID", "NAME", "CREATED", "STORED", "LOGICAL", "PARENT", "DURATION", "PAUSED", "NODE"]
    tiered = [c.tier for c in resp.checkpoints if c.tier]
    if tiered:  # with a shared tier: where each is, and what it takes up there
        for row, c in zip(rows, [*resp.checkpoints, *resp.in_progress], strict=False):
            shared = human_bytes(c.shared_bytes) if c.shared_bytes else "-"
            row += [c.tier or "stage (writing)", shared]
        headers += ["TIER", "SHARED"]
    # STORED: bytes this checkpoint wrote; LOGICAL: what it restores (with
    # the unchanged pages it takes from the checkpoints it builds on)
    say(table(rows, headers))
    return 0


def _phase(coord: pb_grpc.CoordinatorStub, job: str) -> pb.JobStatus:
    return call(coord.GetJob, pb.GetJobRequest(job=job), 5, "coordinator")


def cmd_checkpoint(args: argparse.Namespace) -> int:
    limits.in_range("--timeout", args.timeout, 0.001, limits.MAX_QUIESCE_S, "seconds")
    coord = _coordinator()
    info = with_progress(
        lambda: call(
            coord.Checkpoint,
            pb.CheckpointRequest(
                job=args.job, timeout_s=args.timeout or 0.0, then_stop=args.then_stop, wait_shared=args.wait_shared
            ),
            LONG_RPC_S,
            "coordinator",
        ),
        lambda: _phase(coord, args.job),
        sys.stderr.isatty() and not args.json,
    )
    if args.json:
        print_json(info)
    else:
        say(
            f"{info.name} (id {info.id}) of job {info.job}: {human_bytes(info.size_bytes)} in {info.duration_s:.2f} s, "
            + ("then the job stopped" if args.then_stop else f"job paused {info.stall_s:.2f} s")
        )
    return 0


def cmd_restart(args: argparse.Namespace) -> int:
    limits.in_range("--from", args.from_id, 1, limits.MAX_CHECKPOINT_ID)
    ckpt_signals = checkpoint_signals(args)
    if (args.checkpoint_signal or args.sigterm != "checkpoint") and not args.attach:
        raise CkptdError(Code.INVALID_ARGUMENT, "--checkpoint-signal and --sigterm apply to --attach: add it")
    if args.attach and args.json:
        raise CkptdError(Code.INVALID_ARGUMENT, "--attach passes the job's output through: leave out --json")
    coord = _coordinator()
    req = pb.RestartRequest(
        job=args.job, from_id=args.from_id or 0, placement=args.on or [], force=args.force,
        allow_changed_files=args.allow_changed_files, lazy=args.lazy,
    )  # fmt: skip
    resp = with_progress(
        lambda: call(coord.Restart, req, LONG_RPC_S, "coordinator"),
        lambda: _phase(coord, args.job),
        sys.stderr.isatty() and not args.json,
    )
    if args.attach:
        note(f"ckptctl: job {resp.status.name} restarted from {resp.checkpoint.name}")
        return attach_after_restart(coord, resp, ckpt_signals)
    if args.json:
        d = to_dict(resp)
        d["status"]["pids"] = list(resp.status.pids)
        print_json(d)
    else:
        pids = " ".join(str(p) for p in resp.status.pids)
        where = ", ".join(f"rank {r.rank} on {r.node}" for r in resp.status.ranks) or resp.status.node
        say(
            f"job {resp.status.name} restarted from {resp.checkpoint.name} on {where} "
            f"in {resp.duration_s:.2f} s (pids {pids}); output goes to {resp.status.log_path}"
        )
    return 0


def cmd_prune(args: argparse.Namespace) -> int:
    for flag, value in (("--keep", args.keep), ("--keep-every", args.keep_every)):
        limits.in_range(flag, value, 1, limits.MAX_COUNT)
    req = pb.PruneRequest(job=args.job, keep_last=args.keep or 0, keep_every=args.keep_every or 0)
    resp = call(_coordinator().Prune, req, LONG_RPC_S, "coordinator")
    if args.json:
        print_json(list(resp.checkpoints))
    else:
        say(f"job {args.job} keeps {', '.join(c.name for c in resp.checkpoints) or 'no checkpoint'}")
    return 0


def cmd_kill(args: argparse.Namespace) -> int:
    st = call(_coordinator().KillJob, pb.KillJobRequest(job=args.job), 60, "coordinator")
    if args.json:
        print_json(st)
    else:
        say(f"job {st.name}: {_status_line(st)}")
    return 0


def cmd_wait(args: argparse.Namespace) -> int:
    from ckptd.client import exit_status

    limits.in_range("--timeout", args.timeout, 0.001, limits.MAX_WAIT_S, "seconds")
    told_failed = [-1]

    def changed(st: pb.JobStatus) -> None:
        state = JobState.of(st.state)
        if state in RESTARTABLE and told_failed[0] != st.generation:
            told_failed[0] = st.generation
            note(f"ckptctl: job {st.name} is {state} ({st.message}); waiting for a restart")

    try:
        st = _client().wait(args.job, args.timeout, on_change=changed)
    except CkptdError as e:
        if e.code is not Code.DEADLINE_EXCEEDED:
            raise
        note(f"ckptctl: {e.message}")
        return 124
    if args.json:
        print_json(st)
    return exit_status(st)


def cmd_logs(args: argparse.Namespace) -> int:
    """The log so far (--tail: its last lines); -f: then what the job
    writes until it ends, across restarts, and exit with its status."""
    from ckptd.client import exit_status, read_log, wanted

    if args.tail is not None:
        limits.in_range("--tail", args.tail, 0, limits.MAX_COUNT)
    client = _client()
    st = client.status(args.job)
    path = client.log_target(st, args.rank)[0]
    chunks, end = read_log(path, args.stream, args.tail)
    for c in chunks:
        _emit(c.stream, c.data, "both")
    if not args.follow:
        return 0
    if JobState.of(st.state).live:
        for chunk in client.follow_output(args.job, offset=end, rank=args.rank):
            if chunk.end:
                st = chunk.status
                break
            if wanted(chunk.stream, args.stream):
                _emit(chunk.stream, chunk.data, "both")
    return exit_status(st) if st.has_exit or JobState.of(st.state) is JobState.STOPPED else 1


def cmd_rm(args: argparse.Namespace) -> int:
    removed = _client().remove(args.job, keep_checkpoints=args.keep_checkpoints)
    names = sorted(set(removed))
    say(f"job {args.job} removed" + (f" with its checkpoints {', '.join(names)}" if names else ""))
    return 0


def _emit(stream: int, data: bytes, which: str) -> None:
    if which == "stdout" and stream != 1:
        return
    if which == "stderr" and stream != 2:
        return
    sys.stdout.buffer.write(data)
    sys.stdout.buffer.flush()


def cmd_nodes(args: argparse.Namespace) -> int:
    resp = call(_coordinator().ListNodes, pb.Empty(), 30, "coordinator")
    if args.json:
        print_json(list(resp.nodes))
        return 0
    rows = [
        [
            n.node,
            "alive" if n.alive else f"dead ({n.last_seen_s:.0f} s)",
            f"{n.load1:.2f}",
            f"{human_bytes(n.mem_available)} / {human_bytes(n.mem_total)}",
            n.gpu or "?",
            n.address,
            n.ip or "-",
        ]
        for n in resp.nodes
    ]
    say(table(rows, ["NODE", "HEALTH", "LOAD", "MEM FREE", "GPU", "ADDRESS", "IP"]))
    return 0


def _checkpoint_path(target: str, ckpt_id: int | None) -> Path:
    """inspect's argument: a checkpoint directory, or a job (and a checkpoint
    id: default its latest); NOT_FOUND (exit 3) for a missing one."""
    if ckpt_id is None and ("/" in target or os.path.isdir(target)):
        try:
            os.stat(target)
        except (FileNotFoundError, NotADirectoryError):
            raise CkptdError(Code.NOT_FOUND, f"no checkpoint directory {target}") from None
        except OSError:
            pass  # (unreadable: the manifest's reading says why)
        return Path(target)
    limits.in_range("ID", ckpt_id, 1, limits.MAX_CHECKPOINT_ID)
    if _offline():
        found = [(c["id"], c["path"]) for c in offline.list_checkpoints(offline.job(Home.from_env(), target))]
    else:
        found = [(c.id, c.path) for c in _client().list(target)]
    if not found:
        raise CkptdError(Code.NOT_FOUND, f"job {target} has no checkpoints")
    if ckpt_id is None:
        return Path(found[-1][1])
    path = next((p for i, p in found if i == ckpt_id), None)
    if path is None:
        raise CkptdError(Code.NOT_FOUND, f"job {target} has no checkpoint {ckpt_id}; see `ckptctl list {target}`")
    return Path(path)


def cmd_inspect(args: argparse.Namespace) -> int:
    from ckptd.image import seal
    from ckptd.image.core import CoreImage
    from ckptd.image.manifest import load_manifest, verify_files
    from ckptd.image.transfer import read_upload_record, verify_shared_copy

    path = _checkpoint_path(args.checkpoint, args.id)
    try:  # only the daemons' user can read the manifest key: others see the checksums only
        key: bytes | None = seal.key()
        authenticity = "checked"
    except CkptdError as e:
        key, authenticity = None, f"not checked ({e.message})"
    manifest = load_manifest(path, key, authenticate=key is not None)
    if args.verify and read_upload_record(path):  # a shared-tier copy: memory images may be compressed
        verify_shared_copy(path, manifest)
    elif args.verify:
        verify_files(path, manifest)
    procs: list[dict[str, Any]] = []
    # a multi-node checkpoint: each rank's part is a checkpoint of its own
    parts = [
        (path / r["dir"], load_manifest(path / r["dir"], key, authenticate=key is not None), r)
        for r in manifest.get("ranks", [])
    ]
    # (verified above: the job's manifest lists every rank's files and manifest)
    for sub, m, rank in parts or [(path, manifest, None)]:
        for p in m.get("processes", []):
            summary = CoreImage.load(sub / p["dir"] / "core.img").summary()
            if rank is not None:
                summary["rank"] = rank["rank"]
            procs.append(summary)
    out = {
        "job": manifest["job"],
        "id": manifest["id"],
        "created": manifest["created"],
        "node": manifest.get("node"),
        "timings": manifest.get("timings"),
        "sizes": manifest.get("sizes"),
        "attempts": manifest.get("attempts", 1),
        "verified": bool(args.verify),
        "authenticity": authenticity,
        "processes": procs,
        "written_files": [w["path"] for w in manifest.get("written_files", [])],
    }
    if args.json:
        print_json(out)
        return 0
    say(
        f"{path.name}: job {out['job']}, created {out['created']} on {out['node']}"
        + (", checksums OK" if args.verify else "")
        + (", authentic" if key is not None else f"; authenticity {authenticity}")
    )
    for p in procs:
        say(
            (f"  rank {p['rank']}" if "rank" in p else "")
            + f"  pid {p['pid']} (parent {p['ppid']}) {p['exe']}: {p['threads']} threads, {p['vmas']} mappings, "
            f"{human_bytes(p['pages_bytes'])} of pages"
        )
        for fd in p["fds"]:
            say(f"    fd {fd['fd']:<4} {fd['type']:<12} {fd['target']}")
    for w in out["written_files"]:
        say(f"  rolls back: {w}")
    return 0


def cmd_shutdown(args: argparse.Namespace) -> int:
    try:
        coord = _coordinator(start=False)
        call(coord.Shutdown, pb.Empty(), 10, "coordinator")
    except CkptdError as e:
        if e.code is Code.UNAVAILABLE and not os.environ.get("CKPTD_COORDINATOR"):
            say("no local ckptd daemon is running")
            return 0
        raise
    say("ckptd daemon stopping (running jobs keep running)")
    return 0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="ckptctl",
        description="Checkpoint, restart and inspect jobs started with `ckptd launch`.",
        epilog=__doc__.split("\n\n", 1)[1] if __doc__ else None,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--version", action="version", version=f"ckptctl {__version__}")
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def add(name: str, fn: Any, help_text: str, job: bool = True, json_flag: bool = True) -> argparse.ArgumentParser:
        sp = sub.add_parser(name, help=help_text, description=help_text)
        if job:
            sp.add_argument("job", metavar="JOB", help="job name (or a host pid of one of its processes)")
        if json_flag:
            sp.add_argument("--json", action="store_true", help="machine-readable output")
        sp.set_defaults(func=fn)
        return sp

    jobs_p = add("jobs", cmd_jobs, "list jobs", job=False)
    status_p = add("status", cmd_status, "show a job's state, node, last checkpoint and live processes")
    for sp in (jobs_p, status_p):
        sp.add_argument(
            "--show-env", action="store_true",
            help="include the environment the job was launched with (hidden otherwise: it may hold tokens)",
        )  # fmt: skip
    status_p.add_argument(
        "--watch",
        action="store_true",
        help="first follow the checkpoint or restart in flight with a progress bar until it ends",
    )
    add("list", cmd_list, "list a job's committed checkpoints")
    c = add("checkpoint", cmd_checkpoint, "take a checkpoint now; the job keeps running")
    c.add_argument(
        "--timeout",
        type=float,
        metavar="SECONDS",
        help="how long to wait for the job's threads to park (default 10)",
    )
    c.add_argument(
        "--then-stop",
        action="store_true",
        help="preemption: stop the job once the checkpoint is committed (it stays paused until then)",
    )
    c.add_argument(
        "--wait-shared",
        action="store_true",
        help="with a shared tier (launch --stage-dir): return once the checkpoint is durable there, not only on "
        "the stage (the job resumes at the stage commit either way)",
    )
    r = add("restart", cmd_restart, "restart a job from its latest (or a chosen) checkpoint")
    r.add_argument("--from", dest="from_id", type=int, metavar="ID", help="checkpoint id (see `ckptctl list`)")
    r.add_argument(
        "--on",
        metavar="NODE|RANK=NODE",
        action="append",
        help="where to restart: a node (repeat, or comma-separate, to spread the ranks over several), or "
        "RANK=NODE for one rank; ranks not named stay on their node while it lives (default: the job's nodes)",
    )
    r.add_argument("--force", action="store_true", help="kill the job first if it is still running")
    r.add_argument(
        "--allow-changed-files", action="store_true",
        help="continue even if files the job reads changed since the checkpoint",
    )  # fmt: skip
    r.add_argument(
        "--lazy", action="store_true",
        help="run the job before its memory is back: large mappings are filled on demand and in the background, "
        "and the memory images' checksums are checked meanwhile (a mismatch kills the job and puts its files "
        "back); checkpoints and fork() wait until the fill is done. Single-node jobs",
    )  # fmt: skip
    r.add_argument(
        "--attach", action="store_true",
        help="stay in the foreground as `ckptd launch` does: the job's output from the checkpoint on passes "
        "through, the exit status is the job's, and a checkpoint signal (TERM, --checkpoint-signal) takes a "
        "final checkpoint, stops the job and exits 128+SIG",
    )  # fmt: skip
    signal_flags(r)
    pr = add("prune", cmd_prune, "remove checkpoints beyond a retention policy (the newest is always kept)")
    pr.add_argument("--keep", type=int, metavar="N", help="keep the last N checkpoints")
    pr.add_argument(
        "--keep-every", type=int, metavar="K", help="also keep every checkpoint whose id is a multiple of K"
    )
    add("kill", cmd_kill, "kill a job (all its processes)")
    w = add("wait", cmd_wait, "wait until the job finishes, across restarts; exits with its status")
    w.add_argument("--timeout", type=float, metavar="SECONDS", help="give up after this long (exit 124)")
    lg = add("logs", cmd_logs, "print the job's output", json_flag=False)
    lg.add_argument(
        "-f", "--follow", action="store_true",
        help="keep printing new output, across restarts, until the job ends; then exit with its status",
    )  # fmt: skip
    lg.add_argument("--tail", type=int, metavar="N", help="only the last N lines so far")
    lg.add_argument("--stream", choices=("both", "stdout", "stderr"), default="both", help="which output to print")
    lg.add_argument("--rank", type=int, default=0, help="which rank of a multi-node job (default 0)")
    rm = add("rm", cmd_rm, "forget an ended job: its record and its checkpoints (its log stays)", json_flag=False)
    rm.add_argument("--keep-checkpoints", action="store_true", help="leave its checkpoints on storage")
    add("nodes", cmd_nodes, "list nodes and their health", job=False)
    i = add("inspect", cmd_inspect, "describe a checkpoint: a directory, or a job's (its latest, or ID)", job=False)
    i.add_argument("checkpoint", metavar="DIR|JOB", help="a checkpoint directory (see `ckptctl list JOB`), or a job")
    i.add_argument("id", metavar="ID", type=int, nargs="?", help="with a job: which checkpoint (default the latest)")
    i.add_argument("--verify", action="store_true", help="also verify every checksum")
    add(
        "shutdown",
        cmd_shutdown,
        "stop the local ckptd daemon (jobs keep running)",
        job=False,
        json_flag=False,
    )
    return p


def main(argv: list[str] | None = None) -> int:
    try:
        config.apply(argparse.ArgumentParser(), commands=False)  # its [env]: CKPTD_COORDINATOR, CKPTD_TLS_DIR...
    except CkptdError as e:
        note(f"error: {e.message}")
        return e.exit_code
    args = parser().parse_args(argv)
    setup_cli_logging(args.verbose)
    code = run_main(lambda: args.func(args))
    return code if isinstance(code, int) else EXIT_FAILED


if __name__ == "__main__":
    sys.exit(main())
