"""Read-only answers with no daemon running: `ckptctl jobs`, `status` and
`list` never start one (a look must not leave a daemon behind), and need no
gRPC.  They read what the coordinator itself would read at its start: the
job records in $CKPTD_HOME/jobs/ (coordinator/jobs.py) and the committed
checkpoint directories on storage (coordinator/catalog.py).  A job without
a recorded end reads as "lost", as the coordinator would show it."""

from __future__ import annotations

import argparse
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

from .common import note, print_json, say, table

_CHECKPOINT = re.compile(r"^ckpt-(\d{6,})$")


def daemon_running(home: Home) -> bool:
    """Whether something listens on the local coordinator's socket (a plain
    connect: no gRPC, and nothing is created, not even the runtime directory).
    A runtime directory or socket someone else made is refused as the real
    client refuses it, never connected to (ARCHITECTURE.md, Local state)."""
    if not home.check_run_dir(create=False) or not home.our_socket(home.coordinator_socket):
        return False
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


# ---- the commands (ckptctl.py calls them when no daemon runs) ----


def _note() -> None:
    note("ckptctl: no ckptd daemon is running; this is what its records on disk say")


def cmd_jobs(args: argparse.Namespace) -> int:
    found = jobs(Home.from_env())
    if args.json:
        print_json(found)
    elif not found:
        say("no jobs")
    else:
        rows = [
            [j["name"], j["state"], j["node"], "0", j["last_checkpoint"].get("name", "-"),
             " ".join(j["spec"].get("argv", []))[:50]]
            for j in found
        ]  # fmt: skip
        say(table(rows, ["JOB", "STATE", "NODE", "PROCS", "LAST CHECKPOINT", "COMMAND"]))
        _note()
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    j = job(Home.from_env(), args.job)
    if args.json:
        print_json(j)
        return 0
    state = j["state"]
    if j["has_exit"] and (j["exit_code"] or j["exit_signal"]):
        state += f" ({'signal ' + str(j['exit_signal']) if j['exit_signal'] else 'status ' + str(j['exit_code'])})"
    last = j["last_checkpoint"]
    say(
        "\n".join(
            [
                f"job:        {j['name']}",
                f"state:      {state}" + (f"  - {j['message']}" if j["message"] else ""),
                f"node:       {j['node']}",
                f"command:    {' '.join(j['spec'].get('argv', []))}",
                f"checkpoint: {last['name']} ({last['created']}); {j['checkpoints']} in all" if last
                else "checkpoint: none",
            ]
        )
    )  # fmt: skip
    _note()
    return 0


def cmd_list(args: argparse.Namespace) -> int:
    found = list_checkpoints(job(Home.from_env(), args.job))
    if args.json:
        print_json(found)
    elif not found:
        say(f"job {args.job} has no checkpoints")
    else:
        rows = [[str(c["id"]), c["name"], c["created"], c["path"]] for c in found]
        say(table(rows, ["ID", "NAME", "CREATED", "PATH"]))
    return 0
