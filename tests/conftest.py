"""Test fixtures: a private CKPTD_HOME per test, driven through the real CLIs.

Nothing is mocked: every test talks to real daemons over real Unix sockets,
launches real processes, checkpoints them, kills them with SIGKILL and
restarts them.  The two helpers called most while a job runs, status() and
checkpoint(), go to the coordinator's gRPC API directly, as the CLI does:
the CLI's own start-up (half a second on a loaded 2-core machine) let jobs
run past the progress marks the tests wait for.  Every CLI command is
exercised in test_launch_and_cli and wherever a test checks its output.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

# Test the installed package, never the source tree: agent/ and coordinator/
# only become ckptd.agent and ckptd.coordinator once installed.
_REPO = str(Path(__file__).resolve().parent.parent)
sys.path[:] = [p for p in sys.path if p not in ("", ".", _REPO)]

import psutil  # noqa: E402
import pytest  # noqa: E402

WORKLOADS = Path(__file__).parent / "workloads"
PYTHON = sys.executable
BIN = Path(sys.executable).parent


def _tool(name: str) -> str:
    path = BIN / name
    return str(path) if path.exists() else (shutil.which(name) or name)


CKPTD = _tool("ckptd")
CKPTCTL = _tool("ckptctl")


def flip_byte(path: Path) -> None:
    """Damage a file the way a bad disk would: one byte in its middle."""
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0xFF]))


class Ckptd:
    """One isolated ckptd installation (its own CKPTD_HOME and daemon)."""

    def __init__(self, home: Path, user: tuple[int, int] | None = None) -> None:
        self.home = home
        self.user = user  # (uid, gid) to run everything as, or None
        self.env = dict(os.environ, CKPTD_HOME=str(home), CKPTD_IDLE_EXIT="600")
        for var in ("CKPTD_COORDINATOR", "LD_PRELOAD", "CKPTD_JOB", "CKPTD_SHIM_SOCKET"):
            self.env.pop(var, None)
        self.env["OPENBLAS_NUM_THREADS"] = "2"
        self._logs: dict[str, Path] = {}

    def _as_user(self) -> dict[str, Any]:
        if not self.user:
            return {}
        uid, gid = self.user
        return {"user": uid, "group": gid, "extra_groups": []}

    def run(self, *args: str, check: bool = True, timeout: float = 120, **kw: Any) -> subprocess.CompletedProcess[str]:
        proc = subprocess.run(
            list(args),
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
            **self._as_user(),
            **kw,
        )
        if check and proc.returncode != 0:
            raise AssertionError(f"{args} failed with {proc.returncode}:\n{proc.stdout}\n{proc.stderr}")
        return proc

    def ctl(self, *args: str, check: bool = True, timeout: float = 180) -> subprocess.CompletedProcess[str]:
        return self.run(CKPTCTL, *args, check=check, timeout=timeout)

    def start_daemon(self) -> None:
        """The local daemon, started as any command that needs it starts it
        (read-only ones -- jobs, status, list -- never do)."""
        self.ctl("nodes")

    def ctl_json(self, *args: str) -> Any:
        return json.loads(self.ctl(*args, "--json").stdout)

    def launch(self, job: str, argv: list[str], *extra: str, cwd: str | None = None) -> None:
        self.run(CKPTD, "launch", "--detach", "--job", job, *extra, "--", *argv, cwd=cwd)

    def popen_launch(self, job: str, argv: list[str], *extra: str) -> subprocess.Popen[str]:
        return subprocess.Popen(
            [CKPTD, "launch", "--job", job, *extra, "--", *argv],
            env=self.env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            **self._as_user(),
        )

    def _rpc(self, method: str, request: Any, timeout: float, *cli: str) -> dict[str, Any] | None:
        """The coordinator's answer as `ckptctl ... --json` prints it, or None
        where the CLI must answer (another user's daemon, or none running:
        the CLI starts one).  Errors are AssertionErrors, as the CLI's."""
        if self.user or "CKPTD_COORDINATOR" in self.env:
            return None
        from ckptd.cli.common import to_dict
        from ckptd.daemon import coordinator_address
        from ckptd.errors import CkptdError, Code
        from ckptd.paths import Home
        from ckptd.rpc import call, coordinator_stub

        try:
            stub = coordinator_stub(coordinator_address(Home(self.home), start=False))
            reply = call(getattr(stub, method), request, timeout, "coordinator")
        except CkptdError as e:
            if e.code is Code.UNAVAILABLE:
                return None
            raise AssertionError(f"{' '.join(cli)}: {e.message}") from None
        d = to_dict(reply)
        if hasattr(reply, "pids"):
            d["pids"] = list(reply.pids)
        return d

    def status(self, job: str) -> dict[str, Any]:
        """What `ckptctl status JOB --json` prints."""
        from ckptd.v1 import ckptd_pb2 as pb

        d = self._rpc("GetJob", pb.GetJobRequest(job=job), 30, "status", job)
        return d if d is not None else self.ctl_json("status", job)

    def log(self, job: str, stream: str = "both") -> str:
        return self.ctl("logs", job, "--stream", stream).stdout

    def log_file(self, job: str) -> Path:
        if job not in self._logs:
            self._logs[job] = Path(self.status(job)["log_path"])
        return self._logs[job]

    def wait_log(self, job: str, pattern: str, timeout: float = 60) -> None:
        """Wait until the job's output (read straight from its log file) matches pattern."""
        deadline = time.monotonic() + timeout
        rx = re.compile(pattern, re.M)
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError, AssertionError):  # AssertionError: not launched yet
                if rx.search(self.log_file(job).read_text(errors="replace")):
                    return
            time.sleep(0.05)
        raise AssertionError(f"job {job}: {pattern!r} not in output after {timeout}s:\n{self.log(job)[-2000:]}")

    def checkpoint(self, job: str) -> dict[str, Any]:
        """What `ckptctl checkpoint JOB --json` prints."""
        from ckptd.v1 import ckptd_pb2 as pb

        d = self._rpc("Checkpoint", pb.CheckpointRequest(job=job), 600, "checkpoint", job)
        return d if d is not None else self.ctl_json("checkpoint", job)

    def kill9(self, job: str) -> list[int]:
        """SIGKILL every process of the job, as a node failure would."""
        pids = self.status(job)["pids"]
        assert pids, f"job {job} has no live process"
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self.status(job)["state"] not in ("running", "checkpointing"):
                return pids
            time.sleep(0.1)
        raise AssertionError(f"job {job} still running after SIGKILL")

    def wait(self, job: str, timeout: float = 180) -> int:
        return self.ctl("wait", job, "--timeout", str(timeout), check=False, timeout=timeout + 30).returncode

    def daemon_pids(self) -> list[int]:
        out = []
        for p in psutil.process_iter(["cmdline", "environ"]):
            with contextlib.suppress(psutil.Error):
                cmd = p.info["cmdline"] or []
                env = p.info["environ"] or {}
                if "ckptd.cli.ckptd_main" in " ".join(cmd) and env.get("CKPTD_HOME") == str(self.home):
                    out.append(p.pid)
        return out

    def init_pids(self) -> list[int]:
        """ckptd-init processes of this home (relays and reapers)."""
        out = []
        for p in psutil.process_iter(["cmdline"]):
            with contextlib.suppress(psutil.Error):
                cmd = p.info["cmdline"] or []
                if cmd and cmd[0].endswith("ckptd-init") and any(str(self.home) in a for a in cmd):
                    out.append(p.pid)
                    out.extend(c.pid for c in p.children(recursive=True))
        return out

    def crash_node(self, job: str) -> None:
        """Everything dies at once: job, ckptd-init, daemon (a machine going down)."""
        victims = set(self.status(job)["pids"]) | set(self.init_pids()) | set(self.daemon_pids())
        # stopped first, so none of them sees another die and tidies up
        # after it (ckptd-init removes its socket when its job is gone)
        for sig in (signal.SIGSTOP, signal.SIGKILL):
            for pid in victims:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, sig)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(psutil.pid_exists(p) for p in victims):
            time.sleep(0.05)

    def crash_daemon(self) -> None:
        """The daemon dies (the job does not); a new one is started, as the next command would."""
        for pid in self.daemon_pids():
            os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while self.daemon_pids() and time.monotonic() < deadline:
            time.sleep(0.05)
        self.start_daemon()

    def cleanup(self) -> None:
        with contextlib.suppress(Exception):
            self.run(CKPTCTL, "shutdown", check=False, timeout=20)
        for pid in self.init_pids() + self.daemon_pids():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self._remove_run_dirs()

    def _remove_run_dirs(self) -> None:
        """A home's runtime directory (daemon.lock, sockets) outlives its daemon,
        for the next one of that home (ckptd/paths.py); a test's home is used
        once, so its directory goes with it instead of piling up in /tmp."""
        from ckptd.paths import Home

        deadline = time.monotonic() + 10
        while self.daemon_pids() and time.monotonic() < deadline:
            time.sleep(0.05)
        ours = Home(self.home).run_dir  # ckptd-<uid>-<tag>, for this process's uid
        for uid in {os.getuid(), *(self.user[:1] if self.user else ())}:
            shutil.rmtree(ours.with_name(f"ckptd-{uid}-{ours.name.rsplit('-', 1)[1]}"), ignore_errors=True)


def kill_restart_twice(c: Ckptd, job: str, mark: Callable[[int], str], at: tuple[int, ...]) -> list[dict]:
    """Three checkpoints at progress marks at[0..2]; kill at at[3]; restart
    from the latest; kill again at at[4]; restart from the first."""
    infos = []
    for n in at[:3]:
        c.wait_log(job, mark(n))
        infos.append(c.checkpoint(job))
        assert c.status(job)["state"] == "running"  # the job keeps running
    assert [i["id"] for i in infos] == [1, 2, 3]
    c.wait_log(job, mark(at[3]))
    c.kill9(job)
    assert c.status(job)["state"] == "failed"
    c.ctl("restart", job)
    c.wait_log(job, mark(at[4]))
    c.kill9(job)
    c.ctl("restart", job, "--from", "1")
    return infos


def exact_round_trip(c: Ckptd, job: str, argv: list[str], *, checkpoint_at: int = 3, kill_at: int = 6) -> str:
    """A kernel-state program (tests/workloads/state_check.h) checkpointed at
    step checkpoint_at, SIGKILLed at step kill_at, restarted: it must check
    its state good to the end and print what an uninterrupted run prints.
    Returns its whole output."""
    plain = run_plain(argv)
    c.launch(job, argv)
    c.wait_log(job, rf"^step {checkpoint_at} ok")
    c.checkpoint(job)
    c.wait_log(job, rf"^step {kill_at} ok")
    return kill_restart_finish(c, job, plain)


def kill_restart_finish(c: Ckptd, job: str, plain: Plain) -> str:
    """The second half of exact_round_trip: kill -9, restart from the latest
    checkpoint, and the job ends well, its stdout the plain run's."""
    c.kill9(job)
    c.ctl("restart", job)
    rc = c.wait(job)
    out = c.log(job)
    assert rc == 0 and "BAD " not in out, out[-2000:]
    assert c.log(job, "stdout") == plain.stdout
    return out


@contextlib.contextmanager
def ckptd_at(home: Path, user: tuple[int, int] | None = None) -> Iterator[Ckptd]:
    """A Ckptd whose daemon and jobs are cleaned up afterwards."""
    c = Ckptd(home, user)
    try:
        yield c
    finally:
        c.cleanup()


@pytest.fixture(autouse=True)
def _environment_as_it_was() -> Iterator[None]:
    """Every test leaves this process's environment as it found it: the
    config file's [env] goes into os.environ (ckptd/config.py), and a test
    that reads a config file in-process would otherwise hand the rest of
    the suite its CKPTD_COORDINATOR or CKPTD_MANIFEST_KEY."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


@pytest.fixture
def ckptd(tmp_path: Path) -> Iterator[Ckptd]:
    home = tmp_path / "home"
    home.mkdir()
    with ckptd_at(home) as c:
        yield c


@pytest.fixture
def counter() -> Path:
    return WORKLOADS / "counter.py"


@pytest.fixture
def outdir(tmp_path: Path) -> Path:
    d = tmp_path / "out"
    d.mkdir()
    return d


def compile_workload(tmp_path_factory: pytest.TempPathFactory, name: str) -> str:
    """tests/workloads/<name>.c built into a directory other users may enter."""
    exe = tmp_path_factory.mktemp("bin") / name
    subprocess.run(
        ["gcc", "-O2", "-Wall", "-Wextra", "-Werror", "-pthread", str(WORKLOADS / f"{name}.c"), "-o", str(exe)],
        check=True,
    )
    exe.parent.chmod(0o755)
    return str(exe)


@pytest.fixture(scope="session")
def ctimer(tmp_path_factory: pytest.TempPathFactory) -> str:
    return compile_workload(tmp_path_factory, "ctimer")


class Plain:
    """The reference: the same program run without ckptd.  It starts at once
    and runs alongside the test (most workloads sleep between steps, so the
    two barely compete); `stdout` waits for it."""

    running: list[Plain] = []

    def __init__(self, argv: list[str], env: dict[str, str] | None = None, **kw: Any) -> None:
        e = dict(os.environ, OPENBLAS_NUM_THREADS="2")
        e.update(env or {})
        self.argv = argv
        # files, not pipes: a chatty program must not block until it is read
        self._out = tempfile.TemporaryFile()  # noqa: SIM115
        self._err = tempfile.TemporaryFile()  # noqa: SIM115
        self._proc = subprocess.Popen(argv, env=e, stdout=self._out, stderr=self._err, **kw)
        self._result: subprocess.CompletedProcess[str] | None = None
        Plain.running.append(self)

    def result(self) -> subprocess.CompletedProcess[str]:
        if self._result is None:
            rc = self._proc.wait(timeout=300)
            out, err = (self._read(f) for f in (self._out, self._err))
            Plain.running.remove(self)
            if rc != 0:  # what it printed says why: pytest would show only the exit status
                raise AssertionError(
                    f"the reference run without ckptd ({' '.join(self.argv)}) exited {rc}; "
                    f"its stdout ends {out[-600:]!r}, its stderr {err[-600:]!r}"
                )
            self._result = subprocess.CompletedProcess(self.argv, rc, out, err)
        return self._result

    @property
    def stdout(self) -> str:
        return self.result().stdout

    @staticmethod
    def _read(f: Any) -> str:
        f.seek(0)
        text = f.read().decode()
        f.close()
        return text

    def stop(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            self._proc.kill()
        self._proc.wait()
        self._out.close()
        self._err.close()


run_plain = Plain


@pytest.fixture(autouse=True)
def _no_reference_left_running() -> Iterator[None]:
    """A test that fails before reading its reference leaves no process behind."""
    yield
    while Plain.running:
        Plain.running.pop().stop()


# ---- PyTorch (CPU): installed only for the tests that use it ----

TORCH_VERSION = "2.13.0"  # a CPU wheel that lies on these machines' disks


@pytest.fixture(scope="session")
def torch_path(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A PYTHONPATH entry under which `import torch` works: the environment's
    own torch, or torch==2.13.0 installed into a cache directory."""
    probe = subprocess.run([PYTHON, "-c", "import torch"], capture_output=True)
    if probe.returncode == 0:
        yield ""
        return
    target = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "ckptd-tests" / f"torch-{TORCH_VERSION}"
    if not (target / "torch").is_dir():
        shutil.rmtree(target, ignore_errors=True)
        p = subprocess.run(
            [PYTHON, "-m", "pip", "install", "-q", "--target", str(target), f"torch=={TORCH_VERSION}"],
            capture_output=True,
            text=True,
            timeout=900,
        )
        if p.returncode != 0:
            pytest.skip(f"torch=={TORCH_VERSION} is not installable here: {p.stderr.strip()[-300:]}")
    yield str(target)


class StoppedRound:
    """A checkpoint whose daemon checkpoint_stopped_at stopped: its result once it went on."""

    info: dict[str, Any]
    error: str  # its standard error, when it was to fail


@contextlib.contextmanager
def checkpoint_stopped_at(
    c: Ckptd, fault: Path, job: str, phase: str, *, succeeds: bool = True
) -> Iterator[StoppedRound]:
    """`ckptctl checkpoint JOB --json` started and the daemon stopped (SIGSTOP,
    at its fault point, CKPTD_FAULT=@fault) at the end of PHASE for the
    block; then the daemon goes on (also when the block fails), and the
    command must succeed: its JSON in .info (succeeds=False: it must fail,
    its standard error in .error)."""
    (daemon,) = c.daemon_pids()
    fault.write_text(f"daemon:{phase}:STOP")
    p = subprocess.Popen(
        [CKPTCTL, "checkpoint", job, "--json"], env=c.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    taken = StoppedRound()
    try:
        deadline = time.monotonic() + 30
        while fault.exists() or psutil.Process(daemon).status() != psutil.STATUS_STOPPED:
            assert time.monotonic() < deadline and p.poll() is None, f"the daemon never stopped after the {phase}"
            time.sleep(0.05)
        yield taken
    finally:
        os.kill(daemon, signal.SIGCONT)
    out, err = p.communicate(timeout=120)
    if succeeds:
        assert p.returncode == 0, out + err
        taken.info = json.loads(out)
    else:
        assert p.returncode != 0, out
        taken.error = err


def trigger_and_wait(trigger: Path, log: Path, said: bytes, never: str, timeout: float = 30) -> None:
    """Touch trigger, then wait until the job's log (its file, read
    directly: no command is answered while a daemon is stopped) holds
    said; never: what the failure says."""
    trigger.touch()
    deadline = time.monotonic() + timeout
    while said not in log.read_bytes():
        assert time.monotonic() < deadline, never
        time.sleep(0.05)


REACHABLE = Path(tempfile.gettempdir()) / "ckptd-tests-reachable.json"  # shared by the xdist workers


@contextlib.contextmanager
def reachable_by_others(*paths: Path) -> Iterator[None]:
    """The interpreter may live under a 0700 home (/root/.pyenv), the test's
    files under pytest's 0700 temporary root: let other users traverse those
    directories (not list them) for the duration of the test.  Tests on
    other xdist workers open the same ones (the interpreter's, the base
    temporary directory): a directory gets its mode back only when the last
    process holding it open lets go (REACHABLE, under a lock, names the
    holders; one that died holds nothing)."""
    import fcntl
    import stat

    def update(change: Callable[[dict[str, Any]], None]) -> None:
        with open(f"{REACHABLE}.lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            state: dict[str, Any] = json.loads(REACHABLE.read_text()) if REACHABLE.exists() else {}
            for entry in state.values():
                entry["holders"] = [h for h in entry["holders"] if psutil.pid_exists(h)]
            change(state)
            for d, entry in list(state.items()):
                if not entry["holders"]:
                    with contextlib.suppress(OSError):
                        os.chmod(d, entry["mode"])
                    del state[d]
            REACHABLE.write_text(json.dumps(state))

    dirs = list(dict.fromkeys(str(parent) for path in paths for parent in path.resolve().parents))

    def hold(state: dict[str, Any]) -> None:
        for d in dirs:
            if d in state:
                state[d]["holders"].append(os.getpid())
                continue
            mode = os.stat(d).st_mode
            if not mode & stat.S_IXOTH:
                os.chmod(d, mode | stat.S_IXOTH)
                state[d] = {"mode": stat.S_IMODE(mode), "holders": [os.getpid()]}

    def release(state: dict[str, Any]) -> None:
        for d in dirs:
            if d in state and os.getpid() in state[d]["holders"]:
                state[d]["holders"].remove(os.getpid())

    update(hold)
    try:
        yield
    finally:
        update(release)


# The fault-injection matrix (tests/faultmatrix.py): every cell's test carries its cell in its report,
# and the matrix is printed at the end of every run that checked at least one cell.
import faultmatrix  # noqa: E402


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--fault-matrix", metavar="PATH", help="also write the fault-injection matrix as Markdown")


def pytest_runtest_setup(item: pytest.Item) -> None:
    faultmatrix.properties(item)


def pytest_itemcollected(item: pytest.Item) -> None:
    """Tests that build namespace nodes (tests/cluster.py: fixed netns names, and a teardown that sweeps
    the rank netns it finds) must not run beside each other: they are `serial` (.ci/run runs those alone).
    (pytest-xdist's `--dist loadgroup` would pin them to one worker, but with pytest 9.2 and xdist 3.8 it
    leaves them spread: seen.)"""
    from cluster import Cluster

    module = getattr(item, "module", None)
    if module is not None and any(isinstance(v, type) and issubclass(v, Cluster) for v in vars(module).values()):
        item.add_marker(pytest.mark.serial)


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    keys = ("passed", "failed", "error", "skipped", "xfailed", "xpassed")
    reports = [r for key in keys for r in terminalreporter.stats.get(key, [])]
    table = faultmatrix.render(faultmatrix.collect(reports))
    if not table:
        return
    terminalreporter.write_sep("=", "fault-injection matrix")
    terminalreporter.write_line(table)
    path = config.getoption("--fault-matrix")
    if path:
        Path(path).write_text(table + "\n")
