"""examples/slurm/one_node.sbatch under a real Slurm: slurmctld and slurmd on
this machine (Debian's slurm-wlm and munge, installed here when missing),
configured in a temporary directory.  The batch job is preempted the way
`--signal=B:USR1@N` does it before a time limit, requeues itself with
`scontrol requeue`, and its second run resumes from the final checkpoint:
every tick is counted once, and the job's output file reads as a plain
run's.  Then the same when Slurm requeues it from outside (`scontrol
requeue`: SIGTERM to every process of the job, the program's included).
multi_node.sbatch needs several machines: only its syntax is checked here."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import debian
import pytest
from conftest import BIN, PYTHON, WORKLOADS, ckptd_at, run_plain

pytestmark = pytest.mark.serial  # it installs packages and runs the machine's munged, slurmctld and slurmd

EXAMPLES = Path(__file__).parent.parent / "examples" / "slurm"
DAEMONS = ("munged", "slurmctld", "slurmd")


def _install() -> None:
    """slurm-wlm and munge, installed when missing; a failure fails the test
    (it must not skip on a machine without Slurm)."""
    debian.install(
        ["slurm-wlm", "munge"], lambda: all(shutil.which(d) or Path(f"/usr/sbin/{d}").exists() for d in DAEMONS)
    )


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


class Slurm:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.conf = root / "etc" / "slurm.conf"
        self.env = dict(os.environ, SLURM_CONF=str(self.conf))

    def run(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        p = subprocess.run(list(args), env=self.env, capture_output=True, text=True, timeout=60)
        if check and p.returncode != 0:
            raise AssertionError(f"{' '.join(args)}: {p.returncode}\n{p.stdout}{p.stderr}\n{self.logs()}")
        return p

    def logs(self) -> str:
        out = []
        for f in sorted((self.root / "log").glob("*.log")):
            out.append(f"--- {f.name}\n" + "\n".join(f.read_text(errors="replace").splitlines()[-15:]))
        return "\n".join(out)

    def start(self) -> None:
        r = self.root
        for d in ("etc", "state", "spool", "log", "run", "munge"):
            (r / d).mkdir(mode=0o700)
        key = r / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o600)
        sock = r / "munge" / "munge.sock"
        self.run(
            "/usr/sbin/munged", "--force", f"--key-file={key}", f"--socket={sock}",
            f"--pid-file={r / 'run' / 'munged.pid'}", f"--log-file={r / 'log' / 'munged.log'}",
            f"--seed-file={r / 'munge' / 'seed'}",
        )  # fmt: skip
        host = socket.gethostname().split(".")[0]
        ctld, slurmd = _free_ports(2)
        self.conf.write_text(
            f"""ClusterName=ckptdtest
SlurmctldHost={host}
SlurmUser=root
SlurmdUser=root
SlurmctldPort={ctld}
SlurmdPort={slurmd}
AuthType=auth/munge
# a requeued job may start again once its old credential has expired (default 120 s)
AuthInfo=socket={sock},cred_expire=10
CredType=cred/munge
StateSaveLocation={r / "state"}
SlurmdSpoolDir={r / "spool"}
SlurmctldPidFile={r / "run" / "slurmctld.pid"}
SlurmdPidFile={r / "run" / "slurmd.pid"}
SlurmctldLogFile={r / "log" / "slurmctld.log"}
SlurmdLogFile={r / "log" / "slurmd.log"}
# no cgroup hierarchy Slurm may own in a container: processes are tracked by ancestry
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
MpiDefault=none
KillWait=30
MinJobAge=600
NodeName={host} CPUs={os.cpu_count() or 1} RealMemory=1000 State=UNKNOWN
PartitionName=ckptd Nodes={host} Default=YES MaxTime=INFINITE State=UP
"""
        )
        self.run("/usr/sbin/slurmctld", "-f", str(self.conf))
        self.run("/usr/sbin/slurmd", "-f", str(self.conf))
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            p = self.run("sinfo", "-h", "-o", "%T", check=False)
            if p.returncode == 0 and p.stdout.strip() == "idle":
                return
            time.sleep(0.5)
        raise AssertionError(f"slurmd did not come up idle:\n{self.logs()}")

    def stop(self) -> None:
        with contextlib.suppress(Exception):
            self.run("scancel", "--full", "--user=root", check=False)
        for name in ("slurmd", "slurmctld", "munged"):
            pidfile = self.root / "run" / f"{name}.pid"
            with contextlib.suppress(OSError, ValueError):
                pid = int(pidfile.read_text().split()[0])
                os.kill(pid, signal.SIGTERM)
                deadline = time.monotonic() + 15
                while time.monotonic() < deadline and Path(f"/proc/{pid}").exists():
                    time.sleep(0.1)
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)

    def job(self, job_id: str) -> dict[str, str]:
        out = self.run("scontrol", "show", "job", job_id, "--oneliner").stdout
        return dict(f.split("=", 1) for f in out.split() if "=" in f)


@pytest.fixture(scope="module")
def slurm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Slurm]:
    _install()
    s = Slurm(tmp_path_factory.mktemp("slurm"))
    try:
        s.start()
        yield s
    finally:
        s.stop()


def wait_for(what: str, cond: object, timeout: float, slurm: Slurm) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():  # type: ignore[operator]
            return
        time.sleep(0.2)
    raise AssertionError(f"{what} after {timeout}s\n{slurm.logs()}")


def submit(slurm: Slurm, tmp_path: Path, ticks: int) -> tuple[str, Path, Path, Path]:
    """one_node.sbatch running counter.py: (job id, its output, its error file, CKPTD_HOME)."""
    counter = WORKLOADS / "counter.py"
    home = tmp_path / "home"
    home.mkdir()
    out, err = tmp_path / "train.out", tmp_path / "train.err"
    env = dict(slurm.env, CKPTD_HOME=str(home), PATH=f"{BIN}:{os.environ['PATH']}", CKPTD_IDLE_EXIT="60")
    env["TRAIN"] = f"{PYTHON} {counter} {ticks}"
    for var in ("CKPTD_COORDINATOR", "LD_PRELOAD", "CKPTD_JOB", "CKPTD_SHIM_SOCKET"):
        env.pop(var, None)
    job_id = subprocess.run(
        ["sbatch", "--parsable", "--job-name=train", f"--chdir={tmp_path}", f"--output={out}", f"--error={err}",
         str(EXAMPLES / "one_node.sbatch")],
        env=env, capture_output=True, text=True, timeout=60, check=True,
    ).stdout.strip().split(";")[0]  # fmt: skip
    return job_id, out, err, home


def test_one_node_job_requeued_resumes_from_its_final_checkpoint(slurm: Slurm, tmp_path: Path) -> None:
    plain = run_plain([PYTHON, str(WORKLOADS / "counter.py"), "240"])
    job_id, out, err, home = submit(slurm, tmp_path, 240)
    # the embedded daemon a run starts is no longer below slurmstepd once its launcher exits (proctrack/
    # linuxproc): it exits by itself then (--exit-with), or is killed here if it did not
    with ckptd_at(home):
        try:
            wait_for("no tick 60 in the output", lambda: out.exists() and "tick 60\n" in out.read_text(), 120, slurm)
            # what --signal=B:USR1@120 does two minutes before the time limit
            slurm.run("scancel", "--batch", "--signal=USR1", job_id)
            wait_for("the job did not requeue itself", lambda: slurm.job(job_id).get("Restarts") == "1", 120, slurm)
            # the requeued job waits for its old credential to expire (cred_expire), then runs again
            wait_for("the job did not finish", lambda: slurm.job(job_id)["JobState"] == "COMPLETED", 180, slurm)
        finally:
            slurm.run("scancel", job_id, check=False)
    notes = err.read_text()
    assert "stopped after ckpt-000001" in notes and "exit 138 (requeue)" in notes, notes
    assert "resumed from ckpt-000001" in notes, notes
    assert out.read_text() == plain.stdout  # every tick once, in one file across both runs
    assert slurm.job(job_id)["ExitCode"] == "0:0"


@pytest.mark.slow
def test_one_node_job_requeued_from_outside_resumes_from_its_final_checkpoint(slurm: Slurm, tmp_path: Path) -> None:
    """`scontrol requeue JOBID` from outside, mid-run: Slurm sends SIGTERM to
    every process of the job (the batch shell, the launcher, its daemon and
    the program, whose SIGTERM is at its default), SIGKILL after KillWait.
    The program's SIGTERM is held for the final checkpoint (native/shim/
    sigterm.c); the next run resumes from it, every tick counted once."""
    plain = run_plain([PYTHON, str(WORKLOADS / "counter.py"), "240"])
    job_id, out, err, home = submit(slurm, tmp_path, 240)
    with ckptd_at(home) as c:
        try:
            wait_for("no tick 60 in the output", lambda: out.exists() and "tick 60\n" in out.read_text(), 120, slurm)
            slurm.run("scontrol", "requeue", job_id)
            wait_for("the job was not requeued", lambda: slurm.job(job_id).get("Restarts") == "1", 120, slurm)
            wait_for("the job did not finish", lambda: slurm.job(job_id)["JobState"] == "COMPLETED", 180, slurm)
            # the daemon its launcher started goes with it (proctrack/linuxproc would not end it;
            # CKPTD_IDLE_EXIT is 60 s here)
            wait_for("the embedded daemon outlived the job", lambda: not c.daemon_pids(), 20, slurm)
        finally:
            slurm.run("scancel", job_id, check=False)
    notes = err.read_text()
    # the launcher's own final checkpoint, or the daemon's (both got the SIGTERM; the daemon's may come first)
    assert "SIGTERM: taking a final checkpoint" in notes, notes
    assert re.search(r"stopped after (its final checkpoint )?ckpt-000001", notes), notes
    assert "resumed from ckpt-000001" in notes, notes
    assert out.read_text() == plain.stdout  # every tick once, in one file across both runs
    assert slurm.job(job_id)["ExitCode"] == "0:0"


def test_multi_node_script_is_valid_bash() -> None:
    for script in sorted(EXAMPLES.glob("*.sbatch")):
        p = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
        assert p.returncode == 0, f"{script}: {p.stderr}"
        assert "#SBATCH --requeue" in script.read_text()
