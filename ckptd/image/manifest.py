"""manifest.json: what a committed checkpoint holds, and the proof it is whole.

Schema ckptd.checkpoint/1 (see ARCHITECTURE.md for every field).  The
manifest is the last file written into the temporary checkpoint directory;
the directory is then renamed into place, so a checkpoint directory without a
valid manifest was never committed.  `digest` covers the rest of the
manifest; `files` lists every other file with its size and xxh3-128.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import xxhash

from ckptd.errors import CkptdError, Code
from ckptd.image.checksum import ALGORITHM, hash_file

SCHEMA = "ckptd.checkpoint/1"
MANIFEST = "manifest.json"


def _digest(manifest: dict[str, Any]) -> str:
    body = {k: v for k, v in manifest.items() if k != "digest"}
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    return xxhash.xxh3_128_hexdigest(canonical)


def write_manifest(directory: Path, manifest: dict[str, Any]) -> None:
    manifest = dict(manifest, schema=SCHEMA)
    manifest["digest"] = _digest(manifest)
    path = directory / MANIFEST
    with open(path, "w") as f:
        json.dump(manifest, f, indent=1, sort_keys=True)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())


def load_manifest(directory: Path) -> dict[str, Any]:
    path = directory / MANIFEST
    try:
        manifest = json.loads(path.read_text())
    except FileNotFoundError as e:
        raise CkptdError(Code.DATA_LOSS, f"checkpoint {directory.name} has no manifest (never committed?)") from e
    except (OSError, ValueError) as e:
        raise CkptdError(Code.DATA_LOSS, f"checkpoint {directory.name}: manifest unreadable or truncated ({e})") from e
    if not isinstance(manifest, dict) or manifest.get("schema") != SCHEMA:
        raise CkptdError(Code.DATA_LOSS, f"checkpoint {directory.name}: unknown manifest schema")
    if manifest.get("digest") != _digest(manifest):
        raise CkptdError(Code.DATA_LOSS, f"checkpoint {directory.name}: manifest digest mismatch (corrupted)")
    return manifest


def list_files(directory: Path) -> list[Path]:
    return sorted(p for p in directory.rglob("*") if p.is_file() and p.name != MANIFEST)


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
            size = path.stat().st_size
        except OSError as e:
            raise CkptdError(
                Code.DATA_LOSS, f"checkpoint {name} is incomplete: {entry['path']} is missing; {hint}"
            ) from e
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


def check_pending(pending: list[PendingChecksum], progress: Callable[[int], None] | None = None) -> None:
    for check in pending:
        if hash_file(check.path, progress) != check.digest:
            raise CkptdError(Code.DATA_LOSS, check.failure)


def total_bytes(manifest: dict[str, Any]) -> int:
    return sum(int(e["size"]) for e in manifest.get("files", []))
