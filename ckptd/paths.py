"""Where ckptd keeps its state: everything hangs off CKPTD_HOME.

    $CKPTD_HOME/
        jobs/<job>.json            the coordinator's job registry (spec, node)
        agents/<node>/jobs/<job>/  an agent's runtime files for a job incarnation
        checkpoints/               the default checkpoint storage
        logs/                      daemon logs
    <ckpt_dir>/<job>/              a job's directory on checkpoint storage
        job.json                   its spec
        output.log, output.idx     its stdout+stderr, and which bytes came from which
        ckpt-000001/ ...           committed checkpoints
        .ckpt-000002.tmp-*/        a checkpoint being written (never visible as committed)

Unix socket paths are limited to 107 bytes, so the sockets live in a short
per-home runtime directory under /tmp (or $XDG_RUNTIME_DIR).
"""

from __future__ import annotations

import hashlib
import os
import socket
from dataclasses import dataclass
from pathlib import Path

CHECKPOINT_PREFIX = "ckpt-"


def default_home() -> Path:
    env = os.environ.get("CKPTD_HOME")
    if env:
        return Path(env).expanduser().resolve()
    state = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(state) / "ckptd"


def default_node() -> str:
    return os.environ.get("CKPTD_NODE") or socket.gethostname().split(".")[0] or "local"


@dataclass(frozen=True)
class Home:
    root: Path

    @classmethod
    def from_env(cls) -> Home:
        return cls(default_home())

    @property
    def run_dir(self) -> Path:
        base = os.environ.get("XDG_RUNTIME_DIR") or "/tmp"
        tag = hashlib.sha256(str(self.root).encode()).hexdigest()[:10]
        return Path(base) / f"ckptd-{os.getuid()}-{tag}"

    @property
    def coordinator_socket(self) -> Path:
        return self.run_dir / "coordinator.sock"

    def agent_socket(self, node: str) -> Path:
        return self.run_dir / f"agent-{node}.sock"

    def shim_socket(self, node: str) -> Path:
        return self.run_dir / f"shim-{node}.sock"

    def init_socket(self, job: str, generation: int) -> Path:
        digest = hashlib.sha256(job.encode()).hexdigest()[:12]
        return self.run_dir / f"init-{digest}-{generation}.sock"

    @property
    def jobs_dir(self) -> Path:
        return self.root / "jobs"

    def agent_dir(self, node: str) -> Path:
        return self.root / "agents" / node

    @property
    def default_ckpt_dir(self) -> Path:
        return self.root / "checkpoints"

    @property
    def logs_dir(self) -> Path:
        return self.root / "logs"

    def ensure(self) -> None:
        for d in (self.root, self.jobs_dir, self.logs_dir, self.default_ckpt_dir):
            d.mkdir(parents=True, exist_ok=True)
        self.run_dir.mkdir(mode=0o700, parents=True, exist_ok=True)


@dataclass(frozen=True)
class JobDir:
    """A job's directory on checkpoint storage."""

    path: Path

    @classmethod
    def of(cls, ckpt_dir: str | Path, job: str) -> JobDir:
        return cls(Path(ckpt_dir) / job)

    @property
    def spec_file(self) -> Path:
        return self.path / "job.json"

    @property
    def log(self) -> Path:
        return self.path / "output.log"

    @property
    def index(self) -> Path:
        return self.path / "output.idx"

    def checkpoint(self, ckpt_id: int) -> Path:
        return self.path / checkpoint_name(ckpt_id)


def checkpoint_name(ckpt_id: int) -> str:
    return f"{CHECKPOINT_PREFIX}{ckpt_id:06d}"


def parse_checkpoint_name(name: str) -> int | None:
    if not name.startswith(CHECKPOINT_PREFIX):
        return None
    digits = name[len(CHECKPOINT_PREFIX) :]
    return int(digits) if digits.isdigit() else None
