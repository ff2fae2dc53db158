"""What the round's ready step takes out of the pause, while the job still
runs (agent/checkpoint.py ready), and what happens when the job changes
between it and the pause.

A process's image directory and files are made there (native/shim/image_dir.c):
creating a file can cost a metadata server's round trip, and none of that
needs a parked process.  The dump takes them only if they are still what
was made: a process gone since leaves nothing in the checkpoint, and a
program that took the descriptors over meanwhile is never written into.
The processes with an NVIDIA device open are listed there too (a readlink
of every descriptor); one opened later is refused at the dump as a passing
state, and the round's next attempt finds it."""

from __future__ import annotations

import json
import os
import re
import signal
import stat
from pathlib import Path

from conftest import PYTHON, WORKLOADS, Ckptd, checkpoint_stopped_at, kill_restart_finish, run_plain, trigger_and_wait

# The ckptd descriptors that name the round's temporary directory are
# replaced by the program's own file, once the trigger exists; every tick
# then checks that the file still holds what the program wrote.
TAKES_OVER = r"""
import os, sys, time
trigger, own, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
fd = os.open(own, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
os.write(fd, b"the program's own bytes\n")
taken = []
for i in range(steps):
    if not taken and os.path.exists(trigger):
        for name in os.listdir("/proc/self/fd"):
            try:
                target = os.readlink(f"/proc/self/fd/{name}")
            except OSError:
                continue
            if "/.ckpt-" in target and ".tmp-" in target:
                os.dup2(fd, int(name))
                taken.append(int(name))
        os.unlink(trigger)
        print("took", len(taken), file=sys.stderr, flush=True)
    intact = all(os.pread(t, 64, 0) == b"the program's own bytes\n" for t in taken)
    print(f"tick {i} {'intact' if intact else 'CHANGED'}", flush=True)
    time.sleep(0.05)
print("done", flush=True)
"""


def tmp_dirs(c: Ckptd, job: str) -> list[Path]:
    return list((c.home / "checkpoints" / job).glob(".ckpt-*.tmp-*"))


def manifest(c: Ckptd, job: str, ckpt_id: int) -> dict:
    info = next(i for i in c.ctl_json("list", job) if i["id"] == ckpt_id)
    return json.loads((Path(info["path"]) / "manifest.json").read_text())


def test_made_before_the_pause_and_a_process_gone_since_leaves_none(ckptd: Ckptd, tmp_path: Path) -> None:
    """Stopped after the ready step: every process's proc-P holds core.img
    and pages.img.part, still empty, and files/.  The child is killed then:
    the round saves the parent and the child's zombie, and its directory is
    not in the checkpoint; the round trip is exact."""
    c = ckptd
    fault = tmp_path / "fault"
    c.env["CKPTD_FAULT"] = f"@{fault}"  # read by the daemon, which the first command starts
    argv = [PYTHON, str(WORKLOADS / "killed_child.py"), "160"]
    plain = run_plain(argv)
    c.launch("early", argv)
    c.wait_log("early", r"^child \d+")
    child = int(re.search(r"^child (\d+)", c.log("early"), re.M).group(1))  # type: ignore[union-attr]
    nspid = re.compile(rf"^NSpid:.*\s{child}$", re.M)
    (host_child,) = [p for p in c.status("early")["pids"] if nspid.search(Path(f"/proc/{p}/status").read_text())]
    with checkpoint_stopped_at(c, fault, "early", "ready") as taken:
        (tmp,) = tmp_dirs(c, "early")
        for pid in (2, child):
            d = tmp / f"proc-{pid}"
            assert (d / "files").is_dir(), sorted(p.name for p in d.iterdir())
            assert (d / "core.img").stat().st_size == 0 and (d / "pages.img.part").stat().st_size == 0
        os.kill(host_child, signal.SIGKILL)
    m = manifest(c, "early", taken.info["id"])
    assert [p["dir"] for p in m["processes"]] == ["proc-2"], m["processes"]
    assert [z["pid"] for z in m["zombies"]] == [child], m.get("zombies")
    ckpt = Path(taken.info["path"])
    assert sorted(p.name for p in ckpt.glob("proc-*")) == ["proc-2"]
    assert not any(f["path"].startswith(f"proc-{child}/") for f in m["files"])
    c.ctl("inspect", str(ckpt), "--verify")
    kill_restart_finish(c, "early", plain)


def test_descriptors_the_program_took_over_are_never_written(ckptd: Ckptd, tmp_path: Path) -> None:
    """Between the ready step and the dump the program puts its own file
    on the descriptors the shim made (dup2): the dump sees they are not
    what it made, makes its files anew, and saves the program's
    descriptors as the program's; its file is never touched."""
    c = ckptd
    fault, trigger, own = tmp_path / "fault", tmp_path / "trigger", tmp_path / "own.txt"
    c.env["CKPTD_FAULT"] = f"@{fault}"
    c.launch("takes", [PYTHON, "-c", TAKES_OVER, str(trigger), str(own), "200"])
    c.wait_log("takes", r"^tick 3 intact$")
    with checkpoint_stopped_at(c, fault, "takes", "ready") as taken:
        trigger_and_wait(trigger, c.log_file("takes"), b"took", "the program never took the descriptors over")
    assert "took 3" in c.log("takes"), c.log("takes")[-500:]
    assert own.read_bytes() == b"the program's own bytes\n"
    ckpt = Path(taken.info["path"])
    assert (ckpt / "proc-2" / "core.img").stat().st_size > 0
    c.ctl("inspect", str(ckpt), "--verify")
    c.kill9("takes")
    c.ctl("restart", "takes", "--from", str(taken.info["id"]))
    assert c.wait("takes") == 0
    out = c.log("takes", "stdout").splitlines()
    assert out[-1] == "done" and len(out) == 201, out[-3:]
    assert all(line.endswith(" intact") for line in out[:-1]), [x for x in out if "CHANGED" in x]
    assert own.read_bytes() == b"the program's own bytes\n"


OPENS_LATE = r"""
import os, sys, time
trigger, device = sys.argv[1], sys.argv[2]
held = None
for i in range(400):
    if held is None and os.path.exists(trigger):
        held = os.open(device, os.O_RDWR)
        print("opened", flush=True)
    print(f"tick {i}", flush=True)
    time.sleep(0.05)
"""


def test_a_gpu_device_opened_after_the_ready_step_is_the_next_attempts(ckptd: Ckptd, tmp_path: Path) -> None:
    """The program opens an NVIDIA device node (a stand-in: /dev/null's
    numbers under a /dev/nvidia name) after the ready step listed the
    processes holding one.  Its dump refuses it as a passing state, not as
    an unsupported character device: the coordinator runs the round again,
    and that round's ready step finds the device and tries to move its
    memory, which needs cuda-python, not installed here.  The job runs on
    and nothing is committed."""
    c = ckptd
    fault, trigger = tmp_path / "fault", tmp_path / "trigger"
    device = Path(f"/dev/nvidia-ckptd-test-{os.getpid()}")
    os.mknod(device, 0o666 | stat.S_IFCHR, os.makedev(1, 3))
    try:
        c.env["CKPTD_FAULT"] = f"@{fault}"
        c.launch("gpu", [PYTHON, "-c", OPENS_LATE, str(trigger), str(device)])
        c.wait_log("gpu", r"^tick 3$")
        with checkpoint_stopped_at(c, fault, "gpu", "ready", succeeds=False) as taken:
            trigger_and_wait(trigger, c.log_file("gpu"), b"opened", "the program never opened the device")
        assert "needs cuda-python" in taken.error and "character device" not in taken.error, taken.error
        # the first attempt's dump found it, and the round went again
        daemon_log = (c.home / "logs" / "daemon.log").read_text()
        assert "trying again" in daemon_log and "memory this round did not move" in daemon_log, daemon_log[-2000:]
        assert c.ctl_json("list", "gpu") == []
        assert c.status("gpu")["state"] == "running"
        n = len(c.log("gpu").splitlines())
        c.wait_log("gpu", rf"^tick {n + 3}$")  # and it goes on
    finally:
        device.unlink()
