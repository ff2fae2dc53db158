"""`ckptd`: launch jobs under checkpoint control, and run the daemons.

ckptd launch [--job NAME] [--ckpt-dir DIR] [--interval SECONDS] -- CMD [ARGS...]
ckptd launch --stage-dir FAST --ckpt-dir SHARED [--compress zstd|auto] -- CMD ...
ckptd launch --ranks N [--nodes A,B,...] [--auto-restart] -- CMD {rank} ...
ckptd coordinator [--listen ADDR] [--tls DIR] [--admin NAME ...]
ckptd agent --coordinator ADDR --node NAME [--listen ADDR] [--ip ADDRESS] [--tls DIR] [--admin NAME ...]
ckptd certs ca --dir DIR | certs issue --ca DIR --out DIR (--user|--node|--coordinator) NAME [--host H ...]
ckptd daemon                     (the embedded coordinator + agent; started on demand)
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from ckptd import __version__, config, limits
from ckptd.errors import EXIT_USAGE, CkptdError, Code
from ckptd.jobstate import JobState
from ckptd.paths import Home, default_node

from .common import lazy_function, lazy_module, note, run_main, setup_cli_logging
from .foreground import Foreground, attach_after_restart, checkpoint_signals, exit_status, signal_flags

if TYPE_CHECKING:
    import grpc

    from ckptd import tls
    from ckptd.daemon import Security, coordinator_address, run_agent, run_coordinator, run_local, setup_logging
    from ckptd.image import crypt, seal
    from ckptd.rpc import agent_stub, call, coordinator_stub
    from ckptd.tls import TlsFiles
    from ckptd.v1 import ckptd_pb2 as pb
    from ckptd.v1 import ckptd_pb2_grpc as pb_grpc
else:  # loaded on first use: `ckptd --help` needs none of them (and a daemon, all)
    grpc = lazy_module("grpc")
    tls = lazy_module("ckptd.tls")
    crypt = lazy_module("ckptd.image.crypt")
    seal = lazy_module("ckptd.image.seal")
    pb = lazy_module("ckptd.v1.ckptd_pb2")
    Security, coordinator_address, run_agent, run_coordinator, run_local, setup_logging = (
        lazy_function("ckptd.daemon", f)
        for f in ("Security", "coordinator_address", "run_agent", "run_coordinator", "run_local", "setup_logging")
    )
    agent_stub, call, coordinator_stub = (
        lazy_function("ckptd.rpc", f) for f in ("agent_stub", "call", "coordinator_stub")
    )


def current_umask() -> int:
    mask = os.umask(0o077)
    os.umask(mask)
    return mask


def encryption_of(args: argparse.Namespace) -> tuple[str, str]:
    """launch --encrypt: the key file's absolute path and the key's check
    value ("", "" without --encrypt); a one-line error for a bad key file,
    a CPU without AES-NI, or an option that cannot work on ciphertext."""
    if not (args.encrypt or args.encrypt_key):
        return "", ""
    path = args.encrypt_key or os.environ.get(crypt.KEY_ENV, "")
    if not path:
        raise CkptdError(
            Code.INVALID_ARGUMENT,
            f"--encrypt needs a key: --encrypt-key FILE, or ${crypt.KEY_ENV} naming the file "
            "(32 bytes, raw or hex; make one with: head -c 32 /dev/urandom > FILE; chmod 600 FILE)",
        )
    if args.dedup:
        raise CkptdError(
            Code.INVALID_ARGUMENT, "--dedup compares pages across ranks, which --encrypt hides: use one or the other"
        )
    if args.compress != "off":
        raise CkptdError(
            Code.INVALID_ARGUMENT, "--compress cannot shrink encrypted images: leave it out with --encrypt"
        )
    if not crypt.cpu_supported():
        raise CkptdError(
            Code.FAILED_PRECONDITION, "--encrypt needs a CPU with AES-NI and PCLMULQDQ, which this one lacks"
        )
    key = crypt.read_key_file(path)
    return os.path.abspath(path), crypt.key_check(key)


def cmd_launch(args: argparse.Namespace) -> int:
    argv = list(args.command)
    if argv and argv[0] == "--":
        argv = argv[1:]
    if not argv:
        note("error: no command given; usage: ckptd launch [--job NAME] -- CMD [ARGS...]")
        return EXIT_USAGE
    if args.interval is not None:  # a checkpoint storm (1e-9, nan) or never (inf): refused
        limits.in_range("--interval", args.interval, limits.MIN_INTERVAL_S, limits.MAX_INTERVAL_S, "seconds")
    for flag, value in (("--keep", args.keep), ("--keep-every", args.keep_every), ("--full-every", args.full_every)):
        limits.in_range(flag, value, 1, limits.MAX_COUNT)
    limits.in_range("--ranks", args.ranks, 1, limits.MAX_RANKS)
    limits.in_range("--max-restarts", args.max_restarts, 1, limits.MAX_COUNT)
    if args.job is not None:
        limits.check_job_name(args.job)
    if args.dedup and not (args.ranks or args.nodes):
        note("error: --dedup stores pages once across the ranks of a job: add --ranks N or --nodes A,B")
        return EXIT_USAGE
    if args.stage_dir and not args.ckpt_dir:
        note("error: --stage-dir needs --ckpt-dir SHARED_DIR: the shared tier its checkpoints are uploaded to")
        return EXIT_USAGE
    if args.compress != "off" and not args.stage_dir:
        note("error: --compress applies to the shared tier: add --stage-dir FAST_DIR (checkpoints commit there, "
             "then go up to --ckpt-dir compressed)")  # fmt: skip
        return EXIT_USAGE
    key_file, key_check = encryption_of(args)
    ckpt_signals = checkpoint_signals(args)
    if args.resume and not args.job:
        note(
            "error: --resume needs --job NAME: the job to resume, or to launch under that name if it has no checkpoint"
        )
        return EXIT_USAGE
    if args.resume and args.detach:
        note("error: --resume stays in the foreground; leave out --detach")
        return EXIT_USAGE
    home = Home.from_env()
    address = coordinator_address(home)
    coord = coordinator_stub(address)
    if args.resume:
        resumed = _resume(coord, args.job, argv, ckpt_signals)
        if resumed is not None:
            return resumed
    spec = pb.JobSpec(
        name=args.job or "",
        argv=argv,
        env=dict(os.environ),
        cwd=os.getcwd(),
        ckpt_dir=os.path.abspath(args.stage_dir or args.ckpt_dir or "") if args.stage_dir or args.ckpt_dir else "",
        shared_dir=os.path.abspath(args.ckpt_dir) if args.stage_dir and args.ckpt_dir else "",
        compress="" if args.compress == "off" else args.compress,
        interval_s=args.interval or 0.0,
        uid=os.getuid(),
        nranks=args.ranks or 0,
        nodes=[n for n in (args.nodes or "").split(",") if n],
        auto_restart=args.auto_restart or bool(args.max_restarts),
        max_restarts=args.max_restarts or 0,
        keep_last=args.keep or 0,
        keep_every=args.keep_every or 0,
        full_every=args.full_every or 0,
        dedup=args.dedup,
        encrypt_key_file=key_file,
        encrypt_key_check=key_check,
        umask=current_umask(),
    )
    multi = bool(spec.nranks or spec.nodes)
    node = "" if multi else args.node or (default_node() if os.environ.get("CKPTD_COORDINATOR") else "")
    request = pb.LaunchJobRequest(spec=spec, node=node, as_user=args.as_user or "", replace_ended=args.resume)
    resp = call(coord.LaunchJob, request, 90, "coordinator")
    job = resp.status.name
    note(f"ckptd: job {job}")
    if args.detach:
        sys.stdout.write(job + "\n")
        return 0
    return Foreground(coord, job, ckpt_signals).run(resp.agent_address, resp.agent_job or job, 0, multi)


def _resume(coord: pb_grpc.CoordinatorStub, job: str, argv: list[str], ckpt_signals: frozenset[int]) -> int | None:
    """launch --resume: the job's status if it resumed (from its latest
    committed checkpoint, followed in the foreground), None if it has none
    and must be launched fresh."""
    try:
        st = call(coord.GetJob, pb.GetJobRequest(job=job), 30, "coordinator")
    except CkptdError as e:
        if e.code is Code.NOT_FOUND:
            return None
        raise
    state = JobState.of(st.state)
    if state.live:
        raise CkptdError(
            Code.FAILED_PRECONDITION,
            f"job {job} is {state}: --resume restarts a job that has stopped, not one running "
            f"(another launcher of it? see `ckptctl status {job}`)",
        )
    if state is JobState.EXITED and not st.exit_signal:  # killed by a signal (Slurm's SIGTERM): resumable
        note(f"ckptd: job {job} has finished already ({_exit_text(st)}): nothing to resume; choose another --job name")
        return exit_status(st)
    ckpts = call(coord.ListCheckpoints, pb.ListCheckpointsRequest(job=job), 30, "coordinator").checkpoints
    if not ckpts:
        return None
    if list(st.spec.argv) and list(st.spec.argv) != argv:
        note(f"ckptd: job {job} resumes the command it was launched with: {' '.join(st.spec.argv)}")
    resp = call(coord.Restart, pb.RestartRequest(job=job), 6 * 3600, "coordinator")
    note(f"ckptd: job {job} resumed from {resp.checkpoint.name}")
    return attach_after_restart(coord, resp, ckpt_signals)


def _exit_text(st: pb.JobStatus) -> str:
    return f"signal {st.exit_signal}" if st.exit_signal else f"exit {st.exit_code}"


def _tls(args: argparse.Namespace) -> TlsFiles | None:
    from ckptd.tls import TlsFiles

    d = args.tls or tls.default_dir()
    return TlsFiles.load(d) if d else None


def cmd_coordinator(args: argparse.Namespace) -> int:
    from ckptd import auth

    home = Home.from_env()
    setup_logging(home, "coordinator", args.verbose, _log_format(args))
    security = Security(_tls(args), tuple(args.admin or auth.DEFAULT_ADMINS))
    listen = args.listen or f"unix:{home.coordinator_socket}"
    run_coordinator(home, listen, security=security, metrics=_metrics(args))
    return 0


def cmd_agent(args: argparse.Namespace) -> int:
    from ckptd import auth

    home = Home.from_env()
    node = args.node or default_node()
    setup_logging(home, f"agent-{node}", args.verbose, _log_format(args))
    security = Security(_tls(args), tuple(args.admin or auth.DEFAULT_ADMINS))
    listen = args.listen or f"unix:{home.agent_socket(node)}"
    run_agent(home, node, args.coordinator, listen, ip=args.ip or "", security=security, metrics=_metrics(args))
    return 0


def cmd_certs(args: argparse.Namespace) -> int:
    if args.certs_command == "ca":
        d = tls.make_ca(Path(args.dir))
        note(f"ckptd: CA in {d} (ca.key stays here, 0600; hand out ca.pem)")
        return 0
    role, name = next((r, getattr(args, r)) for r in tls.ROLES if getattr(args, r))
    out = tls.issue(Path(args.ca), Path(args.out), name, role, hosts=args.host or None, days=args.days)
    note(f"ckptd: {role} certificate for {name} in {out} (use it with --tls {out} or CKPTD_TLS_DIR={out})")
    return 0


def cmd_daemon(args: argparse.Namespace) -> int:
    home = Home.from_env()
    setup_logging(home, "daemon", args.verbose, _log_format(args))
    run_local(home, args.idle_exit, metrics=_metrics(args), exit_with=args.exit_with)
    return 0


def _metrics(args: argparse.Namespace) -> str:
    return str(args.metrics or os.environ.get("CKPTD_METRICS", ""))


def _log_format(args: argparse.Namespace) -> str:
    fmt = str(args.log_format or os.environ.get("CKPTD_LOG_FORMAT") or "text")
    if fmt not in limits.LOG_FORMATS:
        raise CkptdError(Code.INVALID_ARGUMENT, f"CKPTD_LOG_FORMAT={fmt}: use one of {', '.join(limits.LOG_FORMATS)}")
    return fmt


def _daemon_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--metrics", metavar="HOST:PORT",
        help="serve Prometheus metrics on http://HOST:PORT/metrics (default: $CKPTD_METRICS, else none)",
    )  # fmt: skip
    p.add_argument(
        "--log-format", choices=limits.LOG_FORMATS,
        help="the daemon log's lines: text, or one JSON object each (default: $CKPTD_LOG_FORMAT, else text)",
    )  # fmt: skip


def _security_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--tls", metavar="DIR",
        help="this daemon's TLS directory (ca.pem, cert.pem, key.pem from `ckptd certs issue`); needed to "
        "listen on or dial a TCP address (default: $CKPTD_TLS_DIR, else $CKPTD_HOME/tls if present)",
    )  # fmt: skip
    p.add_argument(
        "--admin", action="append", metavar="USER",
        help="a user who may act on every job and shut the daemon down (repeatable; default: root)",
    )  # fmt: skip
    p.add_argument(
        "--manifest-key", metavar="FILE",
        help="the key that seals checkpoint manifests, the same file (0600) on every node and the coordinator "
        "(default: $CKPTD_MANIFEST_KEY, else $CKPTD_HOME/manifest.key, made on first use)",
    )  # fmt: skip


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="ckptd",
        description="Transparent checkpoint/restart for long-running jobs.",
        epilog="Control running jobs with ckptctl.  State lives under $CKPTD_HOME "
        "(default ~/.local/state/ckptd); CKPTD_COORDINATOR=HOST:PORT uses a remote coordinator.",
    )
    p.add_argument("--version", action="version", version=f"ckptd {__version__}")
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = p.add_subparsers(dest="command_name", required=True, metavar="COMMAND")

    launch = sub.add_parser(
        "launch",
        help="run a command under checkpoint control",
        description="Run CMD in the foreground with the ckptd shim injected.  Its output passes through and is "
        "kept in the job's log; the exit status is CMD's (128+N if killed by signal N).  On a checkpoint signal "
        "SIG (TERM, and each --checkpoint-signal) the job gets a final checkpoint and stops, and launch exits "
        "128+SIG (143 for TERM, 138 for USR1): requeue the job and run the same `ckptd launch --resume` again.  "
        "If this launcher is killed (kill -9), the daemon takes the final checkpoint and stops the job itself.",
    )
    launch.add_argument("--job", help="job name (default: generated, printed on stderr)")
    launch.add_argument(
        "--ckpt-dir",
        help="where checkpoints go (default $CKPTD_HOME/checkpoints); with --stage-dir, the shared tier",
    )
    launch.add_argument(
        "--stage-dir", metavar="FAST_DIR",
        help="tiering: checkpoints commit on this fast directory first (a local NVMe, say) and are uploaded "
        "to --ckpt-dir in the background; a restart whose stage copy is gone fetches it back",
    )  # fmt: skip
    launch.add_argument(
        "--compress", choices=("off", "zstd", "auto"), default="off",
        help="with --stage-dir: store memory images zstd-compressed on the shared tier (multithreaded); "
        "auto: only those whose samples shrink by a fifth or more, and only where compressing costs less "
        "time than the smaller write saves (measured by a first, plain upload) (default off)",
    )  # fmt: skip
    launch.add_argument("--interval", type=float, metavar="SECONDS", help="take a checkpoint this often")
    launch.add_argument("--keep", type=int, metavar="N", help="retention: keep the last N checkpoints (default: all)")
    launch.add_argument(
        "--keep-every", type=int, metavar="K",
        help="retention: also keep every checkpoint whose id is a multiple of K (milestones)",
    )  # fmt: skip
    launch.add_argument(
        "--full-every", type=int, metavar="N",
        help="incremental checkpoints: write a full one at least every N checkpoints, the others hold only "
        "the pages written since the previous one (default 16; 1: every checkpoint full)",
    )  # fmt: skip
    launch.add_argument(
        "--dedup", action="store_true",
        help="with --ranks or --nodes: pages a rank holds exactly as rank 0 does (data-parallel weights) "
        "are stored once per checkpoint, in rank 0's image",
    )  # fmt: skip
    launch.add_argument(
        "--encrypt", action="store_true",
        help="encrypt memory images, saved files and the logs kept in checkpoints (AES-256-GCM) with the key "
        "in --encrypt-key FILE or the file $CKPTD_ENCRYPT_KEY names (32 bytes, raw or hex, mode 0600)",
    )  # fmt: skip
    launch.add_argument("--encrypt-key", metavar="FILE", help="the key file for --encrypt (implies --encrypt)")
    launch.add_argument("--node", help="run on this node (default: this machine's agent)")
    launch.add_argument(
        "--ranks", type=int, metavar="N",
        help="a multi-node job of N ranks (process trees), each with its own virtual IP; "
        "{rank}, {nranks} and {master_addr} in the command are filled in, and "
        "$CKPTD_RANK, $CKPTD_NRANKS, $CKPTD_MASTER_ADDR, $CKPTD_RANK_ADDRS are set",
    )  # fmt: skip
    launch.add_argument(
        "--nodes", metavar="A,B,...",
        help="spread the ranks over these nodes (default: every live node); implies --ranks = number of nodes",
    )  # fmt: skip
    launch.add_argument(
        "--auto-restart", action="store_true",
        help="when the job dies abnormally (a process SIGKILLed: the OOM killer, kill -9; or its node stops "
        "answering), restart it from its last checkpoint (on live nodes); an exit, whatever its status, or "
        "another signal is the program's own end and is not restarted",
    )  # fmt: skip
    launch.add_argument(
        "--max-restarts", type=int, metavar="N",
        help="with --auto-restart (implied): at most N automatic restarts, then the job stays failed",
    )  # fmt: skip
    signal_flags(launch)
    launch.add_argument(
        "--resume", action="store_true",
        help="with --job NAME: restart NAME from its latest committed checkpoint if it has one, else launch it "
        "fresh (also over a NAME that stopped or failed before its first checkpoint); refused while NAME runs. "
        "A requeued batch script needs nothing else",
    )  # fmt: skip
    launch.add_argument("--detach", action="store_true", help="print the job name and return at once")
    launch.add_argument(
        "--as-user", metavar="USER",
        help="an admin launching for a user (a Slurm prolog, an operator): the job is USER's, runs as USER "
        "and only USER (or an admin) may drive it",
    )  # fmt: skip
    launch.add_argument("command", nargs=argparse.REMAINDER, metavar="-- CMD [ARGS...]")
    launch.set_defaults(func=cmd_launch)

    coord = sub.add_parser("coordinator", help="run the central coordinator")
    coord.add_argument(
        "--listen",
        help="address to serve on: HOST:PORT or unix:PATH (default: unix socket in CKPTD_HOME's run dir)",
    )
    _security_flags(coord)
    _daemon_flags(coord)
    coord.set_defaults(func=cmd_coordinator)

    agent = sub.add_parser("agent", help="run this node's agent")
    agent.add_argument("--coordinator", required=True, help="the coordinator's address (HOST:PORT or unix:PATH)")
    agent.add_argument("--node", help="this node's name (default: $CKPTD_NODE or the hostname)")
    agent.add_argument("--listen", help="address to serve on (default: unix socket)")
    agent.add_argument(
        "--ip",
        help="this node's address for traffic between the ranks of multi-node jobs "
        "(their virtual IPs are routed through it)",
    )
    _security_flags(agent)
    _daemon_flags(agent)
    agent.set_defaults(func=cmd_agent)

    certs = sub.add_parser(
        "certs",
        help="make a cluster CA and issue node, coordinator and user certificates (mutual TLS)",
        description="Every TCP listener of ckptd demands a client certificate from the cluster's CA. "
        "`certs ca` makes the CA; `certs issue` makes a TLS directory (ca.pem, cert.pem, key.pem) for one "
        "identity: a user (jobs run as that user), a node's agent, or the coordinator.",
    )
    csub = certs.add_subparsers(dest="certs_command", required=True, metavar="WHAT")
    ca = csub.add_parser("ca", help="make a new CA (ca.pem, ca.key) in DIR")
    ca.add_argument("--dir", required=True, help="where the CA goes (created 0700)")
    iss = csub.add_parser("issue", help="issue one identity's certificate into a new TLS directory")
    iss.add_argument("--ca", required=True, metavar="DIR", help="the CA's directory (from `certs ca`)")
    iss.add_argument("--out", required=True, metavar="DIR", help="the TLS directory to create")
    who = iss.add_mutually_exclusive_group(required=True)
    who.add_argument("--user", metavar="NAME", help="a user: its jobs run as this user name on every node")
    who.add_argument("--node", metavar="NAME", help="a node's agent (the name it registers as)")
    who.add_argument("--coordinator", metavar="NAME", help="the coordinator")
    iss.add_argument(
        "--host", action="append", metavar="HOST",
        help="a host name or IP clients dial this node or coordinator by (repeatable; "
        "default: NAME, localhost, 127.0.0.1)",
    )  # fmt: skip
    iss.add_argument("--days", type=int, default=825, help="validity (default 825)")
    certs.set_defaults(func=cmd_certs)

    daemon = sub.add_parser("daemon", help="coordinator and local agent in one process (started on demand)")
    daemon.add_argument(
        "--idle-exit", type=float, default=limits.DEFAULT_IDLE_EXIT_S, metavar="SECONDS",
        help="exit after this long without running jobs (0: never)",
    )  # fmt: skip
    daemon.add_argument(
        "--exit-with", type=int, default=0, metavar="PID",
        help="also exit as soon as PID has exited and no job runs (inside a Slurm allocation, the command "
        "that started the daemon: it must not outlive the allocation's work)",
    )  # fmt: skip
    _daemon_flags(daemon)
    daemon.set_defaults(func=cmd_daemon)
    return p


def main(argv: list[str] | None = None) -> int:
    p = parser()
    try:
        config.apply(p)  # flag > environment > config file > default (ckptd/config.py)
    except CkptdError as e:
        note(f"error: {e.message}")
        return e.exit_code
    args = p.parse_args(argv)
    setup_cli_logging(args.verbose)
    if getattr(args, "manifest_key", None):  # read by the daemon at its start (ckptd/image/seal.py)
        os.environ[seal.KEY_ENV] = os.path.abspath(args.manifest_key)
    return run_main(lambda: args.func(args))


if __name__ == "__main__":
    sys.exit(main())
