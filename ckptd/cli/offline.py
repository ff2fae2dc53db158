"""Read-only answers with no daemon running: `ckptctl jobs`, `status` and
`list` never start one (a look must not leave a daemon behind), and need no
gRPC.  They read what the coordinator itself would read at its start: the
job records in $CKPTD_HOME/jobs/ (coordinator/jobs.py) and the committed
checkpoint directories on storage (coordinator/catalog.py).  A job without
a recorded end reads as "lost", as the coordinator would show it."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import socket
from pathlib import Path
from typing import Any

from ckptd.errors import CkptdError, Code
from ckptd.paths import Home

_CHECKPOINT = re.compile(r"^ckpt-(\d{6,})$")


def daemon_running(home: Home) -> bool:
    """Whether something listens on the local coordinator's socket (a plain
    connect: no gRPC, and nothing is created, not even the runtime directory)."""
    path = str(home.coordinator_socket)
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.settimeout(1.0)
        s.connect(path)
        return True
    except OSError as e:
        # anything but "nobody there": let the real client say what it is
        return e.errno not in (errno.ENOENT, errno.ECONNREFUSED, errno.ENOTDIR)
    finally:
        s.close()


def _record(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
        spec = data["spec"]
        name = spec["name"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    last = data.get("last") or {}
    ended = last.get("state") in ("exited", "killed", "stopped")
    job: dict[str, Any] = {
        "name": name,
        "state": last["state"] if ended else "lost",
        "node": data.get("node", ""),
        "message": last.get("message", "")
        if ended
        else f"not running under a daemon; `ckptctl restart {name}` resumes it from its last checkpoint",
        "has_exit": ended,
        "exit_code": int(last.get("exit_code", 0)) if ended else 0,
        "exit_signal": int(last.get("exit_signal", 0)) if ended else 0,
        "pids": [],
        "spec": {k: spec.get(k) for k in ("argv", "cwd", "ckpt_dir", "shared_dir", "created") if k in spec},
    }
    checkpoints = list_checkpoints(job)
    job["checkpoints"] = len(checkpoints)
    job["last_checkpoint"] = checkpoints[-1] if checkpoints else {}
    return job


def jobs(home: Home) -> list[dict[str, Any]]:
    out = [r for p in sorted((home.root / "jobs").glob("*.json")) if (r := _record(p)) is not None]
    return sorted(out, key=lambda j: j["spec"].get("created", ""))


def job(home: Home, name: str) -> dict[str, Any]:
    record = _record(home.root / "jobs" / f"{name}.json") if "/" not in name else None
    if record is None:
        raise CkptdError(Code.NOT_FOUND, f"unknown job {name!r}; `ckptctl jobs` lists the jobs")
    return record


def list_checkpoints(job: dict[str, Any]) -> list[dict[str, Any]]:
    """The committed checkpoints of a job on its storage (stage and shared
    tier), oldest first, as their manifests describe them (not verified:
    `ckptctl inspect --verify` does that)."""
    spec = job["spec"]
    found: dict[int, dict[str, Any]] = {}
    for base, tier in ((spec.get("shared_dir"), "shared"), (spec.get("ckpt_dir"), "local")):
        if not base:
            continue
        d = Path(base) / job["name"]
        with contextlib.suppress(OSError):
            for entry in os.scandir(d):
                m = _CHECKPOINT.match(entry.name)
                if m is None or not entry.is_dir(follow_symlinks=False):
                    continue
                info: dict[str, Any] = {"id": int(m.group(1)), "name": entry.name, "path": entry.path, "tier": tier}
                try:
                    manifest = json.loads((Path(entry.path) / "manifest.json").read_text())
                    info["created"] = manifest.get("created", "")
                except (OSError, ValueError):
                    info["created"] = "unreadable"
                found[info["id"]] = info  # the stage's copy, when both tiers hold it
    return [found[k] for k in sorted(found)]
