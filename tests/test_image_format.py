"""The on-disk formats: core.img layout agreement, the manifest's integrity,
the shim protocol's encoding and the log index."""

from __future__ import annotations

import json
import os
import struct
import subprocess
from pathlib import Path

import pytest
from ckptd.agent.output import RECORD, LogFollower
from ckptd.agent.shim_link import Message, format_message

from ckptd.errors import CkptdError, Code
from ckptd.image import core
from ckptd.image.manifest import check_pending, checksum_entries, load_manifest, verify_files, write_manifest
from ckptd.native import native_path


def test_cffi_layout_matches_the_c_compiler() -> None:
    """The Python reader and the C writer share one header; check they agree."""
    out = subprocess.run([str(native_path("layout-dump"))], capture_output=True, text=True, check=True).stdout
    c_layout = json.loads(out)
    ffi = core.ffi()
    for key, value in c_layout.items():
        if "." in key:
            struct_name, field = key.split(".")
            assert ffi.offsetof(f"struct {struct_name}", field) == value, key
        else:
            assert ffi.sizeof(f"struct {key}") == value, key


def test_manifest_roundtrip_and_tamper(tmp_path: Path) -> None:
    (tmp_path / "proc-2").mkdir()
    (tmp_path / "proc-2" / "pages.img").write_bytes(os.urandom(10000))
    files = checksum_entries(tmp_path)
    key = os.urandom(32)  # the daemons' manifest key (ckptd/image/seal.py)
    write_manifest(tmp_path, {"job": "j", "id": 1, "created": "now", "files": files}, key)
    m = load_manifest(tmp_path, key)
    verify_files(tmp_path, m)

    text = (tmp_path / "manifest.json").read_text()
    (tmp_path / "manifest.json").write_text(text.replace('"id": 1', '"id": 2'))
    with pytest.raises(CkptdError) as e:
        load_manifest(tmp_path, key)
    assert e.value.code is Code.DATA_LOSS and "digest" in e.value.message

    (tmp_path / "manifest.json").write_text(text[: len(text) // 2])
    with pytest.raises(CkptdError) as e:
        load_manifest(tmp_path, key)
    assert e.value.code is Code.DATA_LOSS

    (tmp_path / "manifest.json").write_text(text)
    (tmp_path / "proc-2" / "pages.img").unlink()
    with pytest.raises(CkptdError) as e:
        verify_files(tmp_path, load_manifest(tmp_path, key))
    assert "missing" in e.value.message


def test_deferred_memory_images_are_checked_together_and_a_bad_one_is_named(tmp_path: Path) -> None:
    """A restart defers the memory images' checksums and checks them while
    the restorers read them, each image on a thread of its own
    (check_pending): every byte is counted once, and the image that fails
    is the one the error names, not whichever thread finished first."""
    for i in range(4):
        (tmp_path / f"proc-{i + 2}").mkdir()
        (tmp_path / f"proc-{i + 2}" / "pages.img").write_bytes(os.urandom(3 << 20))
    files = checksum_entries(tmp_path)
    key = os.urandom(32)
    write_manifest(tmp_path, {"job": "j", "id": 1, "created": "now", "files": files}, key)
    total = sum(int(f["size"]) for f in files)

    counted: list[int] = []
    pending = verify_files(tmp_path, load_manifest(tmp_path, key), defer=lambda path: path.endswith("pages.img"))
    assert len(pending) == 4
    check_pending(pending, counted.append)
    assert sum(counted) == total

    bad = tmp_path / "proc-4" / "pages.img"
    data = bytearray(bad.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size: only the checksum can tell
    bad.write_bytes(bytes(data))
    pending = verify_files(tmp_path, load_manifest(tmp_path, key), defer=lambda path: path.endswith("pages.img"))
    with pytest.raises(CkptdError) as e:
        check_pending(pending)
    assert e.value.code is Code.DATA_LOSS
    assert "proc-4/pages.img fails its checksum" in e.value.message


def test_core_reader_rejects_garbage(tmp_path: Path) -> None:
    p = tmp_path / "core.img"
    p.write_bytes(b"\0" * 4096)
    with pytest.raises(CkptdError) as e:
        core.CoreImage.load(p)
    assert e.value.code is Code.DATA_LOSS


@pytest.mark.parametrize(
    "value", ["plain", "/a path/with spaces=1", "with\ttab", "new\nline", "del\x7f", "100%", "ünïcode", ""]
)
def test_shim_protocol_encoding(value: str) -> None:
    line = format_message("DUMP", dir=value, n=7)
    assert line.count(b"\n") == 1 and line.endswith(b"\n")
    msg = Message.parse(line)
    assert msg.command == "DUMP" and msg.fields["dir"] == value and msg.int("n") == 7


def test_log_follower_streams_and_cut(tmp_path: Path) -> None:
    log, idx = tmp_path / "output.log", tmp_path / "output.idx"
    chunks = [(1, b"out one\n"), (2, b"err\n"), (1, b"out two\n")]
    off = 0
    with open(log, "wb") as lf, open(idx, "wb") as xf:
        for stream, data in chunks:
            lf.write(data)
            xf.write(RECORD.pack(off, len(data), stream))
            off += len(data)
    got = LogFollower(log, idx).poll()
    assert [(c.stream, c.data) for c in got] == chunks
    # from an offset inside the second chunk
    got = LogFollower(log, idx, offset=9).poll()
    assert got[0].data == b"rr\n" and got[0].stream == 2
    # a restart cut the log back: a follower goes on from the new end
    f = LogFollower(log, idx)
    f.poll()
    os.truncate(log, 8)
    os.truncate(idx, RECORD.size)
    assert f.poll() == []
    with open(log, "ab") as lf, open(idx, "ab") as xf:
        lf.write(b"again\n")
        xf.write(RECORD.pack(8, 6, 1))
    assert [c.data for c in f.poll()] == [b"again\n"]
    assert struct.calcsize("<QII") == RECORD.size == 16
