"""manifest.json: what a committed checkpoint holds, and the proof it is whole.

Schema ckptd.checkpoint/1 (see ARCHITECTURE.md for every field).  The
manifest is the last file written into the temporary checkpoint directory;
the directory is then renamed into place, so a checkpoint directory without a
valid manifest was never committed.  `digest` covers the rest of the
manifest; `files` lists every other file with its size and xxh3-128.

`hmac_sha256` authenticates it: an HMAC-SHA256, keyed with the
installation's manifest key (seal.py), over the manifest's canonical bytes
(every field but itself and `digest`).  xxh3 finds damage; the MAC finds
forgery: a manifest edited by hand, its digests recomputed, fails it, and
is refused as a corrupt one is, before anything is touched.
"""

from __future__ import annotations

import json
import os
import stat
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import xxhash

from ckptd.errors import STORAGE_ERRNOS, CkptdError, Code
from ckptd.image import seal
from ckptd.image.checksum import ALGORITHM, fsync_path, hash_file
from ckptd.nofollow import create_file

SCHEMA = "ckptd.checkpoint/1"
MANIFEST = "manifest.json"


MAC = "hmac_sha256"


# ---- what a manifest holds, built in one place -------------------------
#
# The agent's finalize makes a RankPart (one node's processes and files, sent
# to the coordinator as FinalizeResponse.manifest_part_json); the barrier
# makes the Manifest: a rank's own (header + its part), or a multi-rank
# job's (header + its ranks, every process and file under its rank's
# directory).  to_json() gives the dict write_manifest seals; readers take
# the verified dict (load_manifest), which old manifests also are.


@dataclass
class ProcessRecord:
    """One process of the checkpoint ("processes")."""

    pid: int  # in the job's pid namespace
    ppid: int
    pgid: int
    sid: int
    host_pid: int
    dir: str  # its image directory, relative to the rank's
    exe: str
    cwd: str
    threads: int
    vmas: int
    fds: int
    pages_bytes: int
    ref_bytes: int  # unchanged pages taken from earlier checkpoints
    core_bytes: int
    files_bytes: int
    dump_s: float
    capture: str  # how its pages reached pages.img: pause, writer, staged
    cuda: bool  # its GPU memory is in its image: a restore puts it back on the device
    capture_why: str = ""  # why no writer (agent/capture_budget.py); left out when empty
    rank: int | None = None  # in a multi-rank job's list: the rank it belongs to

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        if not self.capture_why:
            del d["capture_why"]
        if self.rank is None:
            del d["rank"]
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> ProcessRecord:
        return cls(**{f.name: d[f.name] for f in fields(cls) if f.name in d})


@dataclass
class Sizes:
    pages_bytes: int = 0
    ref_bytes: int = 0
    core_bytes: int = 0
    files_bytes: int = 0
    dedup_bytes: int = 0  # pages this rank's images take from rank 0's, no longer stored here

    def add(self, other: Sizes) -> None:
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))


@dataclass
class RankPart:
    """One agent's share of a checkpoint (its finalize's answer)."""

    processes: list[ProcessRecord]
    # the tree around them: zombies, the log's pipe inodes, shared
    # descriptions, and a rank's place among the others (agent/checkpoint.py dump)
    tree: dict[str, Any]
    written_files: list[dict[str, Any]]  # files the job writes: restored from their copies
    read_files: list[dict[str, Any]]  # files it reads, with their identity to check
    mapped_files: list[dict[str, Any]]
    files: list[dict[str, Any]]  # every file of the images: path, size, checksum
    depends_on: list[str]  # earlier checkpoints its images take pages from
    dedup_bytes: int

    _LISTS = ("written_files", "read_files", "mapped_files", "files", "depends_on")

    def to_json(self) -> dict[str, Any]:
        return {
            "processes": [p.to_json() for p in self.processes],
            **self.tree,
            **{k: getattr(self, k) for k in self._LISTS},
            "dedup_bytes": self.dedup_bytes,
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> RankPart:
        known = {"processes", "dedup_bytes", *cls._LISTS}
        return cls(
            processes=[ProcessRecord.from_json(p) for p in d["processes"]],
            tree={k: v for k, v in d.items() if k not in known},
            dedup_bytes=int(d.get("dedup_bytes", 0)),
            **{k: d[k] for k in cls._LISTS},
        )


@dataclass
class RankEntry:
    """A multi-rank job's rank: its node, address and directory."""

    rank: int
    node: str
    vip: str
    dir: str


@dataclass
class Chain:
    """Where an incremental checkpoint's pages come from."""

    parent: str  # the checkpoint it builds on ("" for a full one)
    depends_on: list[str]  # every checkpoint its images take pages from
    depth: int  # incrementals since the last full checkpoint


@dataclass
class Phase:
    """One phase of the round that made the checkpoint ("phases", in order:
    reserve, ready, prepare, drain, dump, resume, finalize, commit).  Back to
    back, they add up to timings.total_s; prepare to resume is the stall
    (ready runs before it, the job still running)."""

    name: str
    rpc_s: float  # at the coordinator: the whole phase, every node's request in it
    local_s: float  # inside the agents: the slowest rank's own time in it (0: no rank takes part)
    # the rest, rpc_s less local_s, is the protocol's own cost; where it goes:
    issue_s: float = 0.0  # putting every request in flight (the coordinator's serial part)
    wire_s: float = 0.0  # the worst round trip less its slowest rank's own time (transport, an agent's queue)
    requests: int = 0  # sent in the phase: one per node (Agent.Steps), not one per rank
    # the time in it in which at least one rank was at its own work (the union
    # of the ranks' steps): where ranks share cores, rpc_s less busy_s is the
    # protocol's own cost (PhaseTiming.busy_s)
    busy_s: float = 0.0


@dataclass
class Manifest:
    """manifest.json before write_manifest adds schema, MAC and digest."""

    job: str
    id: int
    created: str
    node: str  # a multi-rank job's: its nodes, comma-separated
    protocol: int
    timings: dict[str, float]
    sizes: Sizes
    # a rank's own manifest: the job as launched, and its part
    spec: dict[str, Any] | None = None
    threads: int = 0
    output: dict[str, int] | None = None  # the log and its index at the checkpoint
    part: RankPart | None = None
    # a multi-rank job's manifest
    ranks: list[RankEntry] = field(default_factory=list)
    processes: list[ProcessRecord] = field(default_factory=list)
    files: list[dict[str, Any]] = field(default_factory=list)
    chain: Chain | None = None
    # rounds the checkpoint took: the ones before it were aborted on a passing
    # state and run again (coordinator/barrier.py)
    attempts: int = 1
    phases: list[Phase] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "job": self.job,
            "id": self.id,
            "created": self.created,
            "node": self.node,
            "protocol": self.protocol,
            "timings": {k: round(v, 6) for k, v in self.timings.items()},
            "sizes": asdict(self.sizes),
            "attempts": self.attempts,
            "phases": [
                {
                    "name": p.name,
                    "rpc_s": round(p.rpc_s, 6),
                    "local_s": round(p.local_s, 6),
                    "issue_s": round(p.issue_s, 6),
                    "wire_s": round(p.wire_s, 6),
                    "requests": p.requests,
                    "busy_s": round(p.busy_s, 6),
                }
                for p in self.phases
            ],
        }
        if self.part is not None:
            part = self.part.to_json()
            part.pop("depends_on")  # the job's manifest has it, under "chain"
            part.pop("dedup_bytes")  # in sizes
            d.update(spec=self.spec, threads=self.threads, output=self.output, **part)
        else:
            d.update(
                nranks=len(self.ranks),
                ranks=[asdict(r) for r in self.ranks],
                processes=[p.to_json() for p in self.processes],
                files=self.files,
            )
        if self.chain is not None:
            d["chain"] = asdict(self.chain)
        return d


def _canonical(manifest: dict[str, Any], *leave_out: str) -> bytes:
    body = {k: v for k, v in manifest.items() if k not in leave_out}
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


def _digest(manifest: dict[str, Any]) -> str:
    return xxhash.xxh3_128_hexdigest(_canonical(manifest, "digest"))


def write_manifest(directory: Path, manifest: dict[str, Any], key: bytes | None = None) -> bytes:
    """Sealed with key (default: the daemon's, seal.key()); a new file, 0600,
    never through a symlink, durable with its directory entry.  Returns the
    bytes written (a job's manifest lists its ranks' without reading them back)."""
    manifest = {k: v for k, v in manifest.items() if k not in ("digest", MAC)}
    manifest["schema"] = SCHEMA
    manifest[MAC] = seal.mac(key if key is not None else seal.key(), _canonical(manifest))
    manifest["digest"] = _digest(manifest)
    data = (json.dumps(manifest, indent=1, sort_keys=True) + "\n").encode()
    create_file(directory / MANIFEST, data)
    fsync_path(directory)  # its name too, before the commit's rename makes the directory count
    return data


def load_manifest(directory: Path, key: bytes | None = None, *, authenticate: bool = True) -> dict[str, Any]:
    """The manifest, whole (its digest) and authentic (its MAC under key,
    default the daemon's); authenticate=False skips the MAC (`ckptctl
    inspect` run by someone who cannot read the key says so)."""
    path = directory / MANIFEST
    hint = "restart from another checkpoint with --from ID (`ckptctl list JOB`)"
    try:
        manifest = json.loads(path.read_text())
    except FileNotFoundError as e:
        raise CkptdError(
            Code.DATA_LOSS, f"checkpoint {directory.name} has no manifest (never committed?); {hint}"
        ) from e
    except OSError as e:
        if e.errno in STORAGE_ERRNOS:  # the storage failed, not the checkpoint: never passed over as corrupt
            raise
        raise CkptdError(Code.DATA_LOSS, f"checkpoint {directory.name}: manifest unreadable ({e}); {hint}") from e
    except ValueError as e:
        raise CkptdError(
            Code.DATA_LOSS, f"checkpoint {directory.name}: manifest unreadable or truncated ({e}); {hint}"
        ) from e
    if not isinstance(manifest, dict) or manifest.get("schema") != SCHEMA:
        raise CkptdError(Code.DATA_LOSS, f"checkpoint {directory.name}: unknown manifest schema; {hint}")
    if manifest.get("digest") != _digest(manifest):
        raise CkptdError(Code.DATA_LOSS, f"checkpoint {directory.name}: manifest digest mismatch (corrupted); {hint}")
    if authenticate:
        check_mac(directory.name, manifest, key if key is not None else seal.key())
    return manifest


def check_mac(name: str, manifest: dict[str, Any], key: bytes) -> None:
    hint = "restart from another checkpoint with --from ID (`ckptctl list JOB`)"
    if MAC not in manifest:
        raise CkptdError(
            Code.DATA_LOSS,
            f"checkpoint {name} has no authentication code: it was committed by a ckptd that did not seal "
            f"its manifests, or forged; it cannot be trusted, {hint}",
        )
    if not seal.matches(key, _canonical(manifest, "digest", MAC), manifest[MAC]):
        raise CkptdError(
            Code.DATA_LOSS,
            f"checkpoint {name}: manifest fails its authentication (edited, or sealed with another manifest key); "
            f"{hint}",
        )


def list_files(directory: Path) -> list[Path]:
    """Every regular file under directory (a symlink is never a checkpoint's
    file: a restart would read whatever it points at)."""
    out = []
    for dirpath, _dirs, names in os.walk(directory):
        for name in names:
            p = Path(dirpath) / name
            if p.name != MANIFEST and stat.S_ISREG(p.lstat().st_mode):
                out.append(p)
    return sorted(out)


def checksum_entries(
    directory: Path,
    progress: Callable[[int], None] | None = None,
    files: list[Path] | None = None,
    known: dict[Path, str] | None = None,
) -> list[dict[str, Any]]:
    """Size and checksum of every file under directory (or of `files`,
    already listed from it); `known` holds checksums already computed."""
    entries = []
    for p in list_files(directory) if files is None else files:
        digest = (known or {}).get(p)
        entries.append(
            {
                "path": str(p.relative_to(directory)),
                "size": p.stat().st_size,
                ALGORITHM: digest if digest is not None else hash_file(p, progress),
            }
        )
    return entries


@dataclass
class PendingChecksum:
    """A file whose size is proven but whose checksum is still to be
    computed: a restart checks memory images while it rebuilds from them."""

    path: Path
    digest: str
    size: int
    failure: str  # the error if it does not match


def verify_files(
    directory: Path,
    manifest: dict[str, Any],
    progress: Callable[[int], None] | None = None,
    defer: Callable[[str], bool] | None = None,
) -> list[PendingChecksum]:
    """Every listed file present, of its size and checksum; nothing else relied
    on.  Files for which defer(path) holds are checked for size only and
    returned, for check_pending later."""
    name = directory.name
    hint = "restart from an earlier checkpoint with --from ID (`ckptctl list JOB`)"
    pending = []
    for entry in manifest.get("files", []):
        path = directory / entry["path"]
        try:
            st = path.lstat()
        except OSError as e:
            raise CkptdError(
                Code.DATA_LOSS, f"checkpoint {name} is incomplete: {entry['path']} is missing; {hint}"
            ) from e
        if not stat.S_ISREG(st.st_mode):
            raise CkptdError(
                Code.DATA_LOSS, f"checkpoint {name} is corrupt: {entry['path']} is not a regular file; {hint}"
            )
        size = st.st_size
        if size != entry["size"]:
            raise CkptdError(
                Code.DATA_LOSS,
                f"checkpoint {name} is corrupt: {entry['path']} has {size} bytes, expected {entry['size']}; {hint}",
            )
        check = PendingChecksum(
            path, entry[ALGORITHM], size, f"checkpoint {name} is corrupt: {entry['path']} fails its checksum; {hint}"
        )
        if defer is not None and defer(entry["path"]):
            pending.append(check)
        else:
            check_pending([check], progress)
    return pending


# The memory images of a restart are checked while their restorers read
# them (agent/restore.py), each by a thread of its own, at most this many at
# once: every image is then read ahead of the process restored from it, so
# that the restorer's drop of each piece it has copied (native/restorer/mem.c,
# fill_run) frees pages this read has already hashed.
CHECK_THREADS = 8


def check_pending(pending: list[PendingChecksum], progress: Callable[[int], None] | None = None) -> None:
    """Every pending file hashed (in parallel), DATA_LOSS naming the first
    in the list that fails its checksum."""
    if len(pending) > 1:
        lock = threading.Lock()
        counted: Callable[[int], None] | None = None
        if progress is not None:
            report = progress

            def counted(n: int) -> None:
                with lock:
                    report(n)

        def digest(check: PendingChecksum) -> str:
            return hash_file(check.path, counted)

        with ThreadPoolExecutor(min(CHECK_THREADS, len(pending)), thread_name_prefix="checksum") as pool:
            digests = list(pool.map(digest, pending))
    else:
        digests = [hash_file(check.path, progress) for check in pending]
    for check, got in zip(pending, digests, strict=True):
        if got != check.digest:
            raise CkptdError(Code.DATA_LOSS, check.failure)


def total_bytes(manifest: dict[str, Any]) -> int:
    return sum(int(e["size"]) for e in manifest.get("files", []))
