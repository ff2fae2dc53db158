"""Encryption at rest (`ckptd launch --encrypt`): the C AES-256-GCM against
the GCM specification's vectors and against Python's `cryptography`; real
jobs checkpointed (full, incremental: written by the forked writer, staged,
during the pause), SIGKILLed and restarted eagerly and lazily to the output
of a plain run, with no plaintext of the job's memory, written file or
output in their checkpoints; a wrong key and a key file others can read
refused with one line, before anything is touched."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from conftest import CKPTD, PYTHON, WORKLOADS, Ckptd, run_plain
from test_incremental import checkpoints_at

from ckptd.image import crypt
from ckptd.native import native_path

MARKER = b"ckptd-plaintext-marker-7f3a"

# The GCM specification (McGrew and Viega), test cases 13-16: AES-256, 96-bit IVs.
K0 = "00" * 32
K1 = "feffe9928665731c6d6a8f9467308308" * 2
P = (
    "d9313225f88406e5a55909c5aff5269a86a7a9531534f7da2e4c303d8a318a72"
    "1c3c0c95956809532fcf0e2449a6b525b16aedf5aa0de657ba637b391aafd255"
)
C = (
    "522dc1f099567d07f47f37a32a84427d643a8cdcbfe5c0c97598a2bd2555d1aa"
    "8cb08e48590dbb3da7b08b1056828838c5f61e6393ba7a0abcc9f662898015ad"
)
A = "feedfacedeadbeeffeedfacedeadbeefabaddad2"
IV = "cafebabefacedbaddecaf888"
VECTORS = [  # key, iv, aad, plaintext, ciphertext, tag
    (K0, "00" * 12, "", "", "", "530f8afbc74536b9a963b4f1c4cb738b"),
    (K0, "00" * 12, "", "00" * 16, "cea7403d4d606b6e074ec5d3baf39d18", "d0d1c8a799996bf0265b98b5d48ab919"),
    (K1, IV, "", P, C, "b094dac5d93471bdec1a502270e3cc6c"),
    (K1, IV, A, P[:120], C[:120], "76fc6ece0f4e1768cddf8853bb2d551b"),
]

pytestmark = pytest.mark.skipif(not crypt.cpu_supported(), reason="needs AES-NI and PCLMULQDQ")


def tool(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(native_path("ckptd-crypt")), *args], capture_output=True, text=True, check=check)


def make_key(path: Path, hexa: bool = False) -> bytes:
    key = os.urandom(32)
    path.write_bytes(key.hex().encode() + b"\n" if hexa else key)
    path.chmod(0o600)
    return key


@pytest.mark.parametrize("vector", VECTORS)
def test_gcm_spec_vectors(vector: tuple[str, str, str, str, str, str]) -> None:
    key, iv, aad, pt, ct, tag = vector
    assert tool("vector", key, iv, aad, pt).stdout.split() == [x for x in (ct, tag) if x]


@pytest.mark.parametrize("size", [0, 1, 4095, 65536, 65537, 3 * 65536 + 1234, 1 << 20])
def test_c_and_python_open_each_others_files(tmp_path: Path, size: int) -> None:
    key = make_key(tmp_path / "key", hexa=size % 2 == 1)
    data = os.urandom(size)
    (tmp_path / "plain").write_bytes(data)
    # C seals, Python opens
    tool("seal", str(tmp_path / "key"), str(tmp_path / "plain"), str(tmp_path / "c"))
    assert (tmp_path / "c").stat().st_size == size  # offsets unchanged: ciphertext has the plaintext's length
    assert crypt.open_file(key, tmp_path / "c") == data
    # Python seals, C opens
    crypt.seal_into(key, data, tmp_path / "py")
    tool("open", str(tmp_path / "key"), str(tmp_path / "py"), str(tmp_path / "back"))
    assert (tmp_path / "back").read_bytes() == data
    if size:  # one flipped bit: both refuse, with one line
        blob = bytearray((tmp_path / "c").read_bytes())
        blob[size // 2] ^= 1
        (tmp_path / "c").write_bytes(bytes(blob))
        with pytest.raises(Exception, match="does not decrypt with this key, or is damaged"):
            crypt.open_file(key, tmp_path / "c")
        r = tool("open", str(tmp_path / "key"), str(tmp_path / "c"), str(tmp_path / "x"), check=False)
        assert r.returncode != 0 and r.stderr.strip().endswith("does not decrypt with this key, or is damaged")


def secret_job(outfile: Path, steps: int = 160, mib: int = 16, delay: str = "0.05") -> list[str]:
    return [PYTHON, str(WORKLOADS / "secret_marker.py"), str(steps), str(mib), str(outfile), delay]


def plaintext_in(directory: Path, needles: list[bytes]) -> list[str]:
    """Files under directory that hold any of needles."""
    found = []
    for p in directory.rglob("*"):
        if p.is_file():
            data = p.read_bytes()
            found += [f"{p}: {n!r}" for n in needles if n in data]
    return found


def pids_and_files(c: Ckptd, job: str, outfile: Path) -> tuple[str, bytes, str]:
    return c.status(job)["state"], outfile.read_bytes(), c.log_file(job).read_text()


def test_encrypted_job_round_trips_and_leaks_nothing(ckptd: Ckptd, tmp_path: Path) -> None:
    c = ckptd
    key = make_key(tmp_path / "key")
    out, ref = tmp_path / "out.txt", tmp_path / "ref.txt"
    plain = run_plain(secret_job(ref))
    ckpts = tmp_path / "ckpts"
    c.launch("enc", secret_job(out), "--encrypt-key", str(tmp_path / "key"), "--ckpt-dir", str(ckpts))
    c.wait_log("enc", r"^step 20 ")
    full = c.checkpoint("enc")
    c.wait_log("enc", r"^step 40 ")
    inc = c.checkpoint("enc")
    assert inc["parent"] == full["name"]  # incremental, on top of an encrypted parent
    job_dir = ckpts / "enc"
    # nothing the job holds in memory, wrote to its file or printed is in its checkpoints
    leaks = plaintext_in(job_dir / full["name"], [MARKER]) + plaintext_in(job_dir / inc["name"], [MARKER])
    assert not leaks, leaks
    # every memory image, saved file and log copy is sealed; Python opens what the C writer sealed
    proc = job_dir / full["name"] / "proc-2"
    pages = crypt.open_file(key, proc / "pages.img")
    assert MARKER * 4 in pages
    assert crypt.open_file(key, job_dir / full["name"] / "output.log").startswith(b"step 0 ")
    assert MARKER in crypt.open_file(key, next((proc / "files").glob("*.data")))
    # nor in the job's memory as the next image saw it (the command line, the socket's buffer, the
    # stack and the round keys, whose first two are the key, are wiped once used)
    later = crypt.open_file(key, job_dir / inc["name"] / "proc-2" / "pages.img")
    assert key not in later and key.hex().encode() not in later
    # the key itself is stored nowhere: not in the job's records, not in its checkpoints
    stored = [p for d in (c.home, job_dir) for p in d.rglob("*") if p.is_file() and not p.is_socket()]
    assert not [p for p in stored if key in p.read_bytes() or key.hex().encode() in p.read_bytes()]

    # a wrong key: one line, exit 4, nothing touched (the job's file, its log, its state)
    c.wait_log("enc", r"^step 60 ")
    c.kill9("enc")
    before = pids_and_files(c, "enc", out)
    make_key(tmp_path / "key")
    r = c.ctl("restart", "enc", check=False)
    assert r.returncode == 4, r
    assert r.stderr.strip().splitlines() == [
        f"error: wrong key for job enc: {tmp_path / 'key'} does not hold the key the job was launched with"
        " (put the job's key back in that file)"
    ]
    assert pids_and_files(c, "enc", out) == before
    # the right key, readable by others: refused the same way
    (tmp_path / "key").write_bytes(key)
    (tmp_path / "key").chmod(0o644)
    r = c.ctl("restart", "enc", check=False)
    assert r.returncode == 6 and "readable by group or others (mode 0644)" in r.stderr, r
    assert len(r.stderr.strip().splitlines()) == 1
    assert pids_and_files(c, "enc", out) == before
    (tmp_path / "key").chmod(0o600)

    # eager, from the incremental one; the first checkpoint after that restart
    # builds on it (ADOPT: tests/test_incremental.py), sealed as well
    c.ctl("restart", "enc")
    c.wait_log("enc", r"^step 80 ")
    after = c.checkpoint("enc")
    assert after["parent"] == inc["name"], after
    assert not plaintext_in(job_dir / after["name"], [MARKER])
    # from it: the output of a run never interrupted, the file the job
    # writes rolled back and finished alike
    c.kill9("enc")
    c.ctl("restart", "enc")
    assert c.wait("enc") == 0
    assert c.log("enc", "stdout") == plain.stdout
    assert out.read_bytes() == ref.read_bytes()
    # lazily, from the full one
    c.ctl("restart", "enc", "--from", str(full["id"]), "--lazy")
    assert c.wait("enc") == 0
    assert c.log("enc", "stdout") == plain.stdout
    assert out.read_bytes() == ref.read_bytes()


@pytest.mark.parametrize("capture", ["staged", "sync"])
def test_staged_and_pause_written_images_are_sealed(ckptd: Ckptd, tmp_path: Path, capture: str) -> None:
    """The two other ways pages.img is written (native/shim/writeout.c): a
    small incremental image staged and written at FLUSH, and every image
    written during the pause (CKPTD_CAPTURE=sync)."""
    c = ckptd
    key = make_key(tmp_path / "key")
    out, ref = tmp_path / "out.txt", tmp_path / "ref.txt"
    job = secret_job(out, 80, 256, "0.1")
    plain = run_plain(secret_job(ref, 80, 256, "0.1"))
    if capture == "sync":
        c.env["CKPTD_CAPTURE"] = "sync"  # the job's environment is the launching CLI's
    c.env[crypt.KEY_ENV] = str(tmp_path / "key")  # --encrypt takes the file this names
    ckpts = tmp_path / "ckpts"
    c.launch("st", job, "--encrypt", "--ckpt-dir", str(ckpts))
    infos = checkpoints_at(c, "st", range(10, 18, 2), rpc=True)
    want = "staged" if capture == "staged" else "pause"
    modes = {}
    for info in infos:
        manifest = json.loads((ckpts / "st" / info["name"] / "manifest.json").read_text())
        modes[info["name"]] = manifest["processes"][0]["capture"]
    assert want in list(modes.values())[1:], modes
    chosen = next(i for i in infos[1:] if modes[i["name"]] == want)
    assert chosen["parent"]  # incremental
    assert not plaintext_in(ckpts / "st" / chosen["name"], [MARKER])
    pages = crypt.open_file(key, ckpts / "st" / chosen["name"] / "proc-2" / "pages.img")
    assert MARKER in pages
    assert key not in pages and key.hex().encode() not in pages  # the cipher ran on a stack of its own
    c.kill9("st")
    c.ctl("restart", "st", "--from", str(chosen["id"]))
    assert c.wait("st") == 0
    assert c.log("st", "stdout") == plain.stdout
    assert out.read_bytes() == ref.read_bytes()


@pytest.mark.parametrize(
    ("extra", "code", "message"),
    [
        ((), 2, "--encrypt needs a key: --encrypt-key FILE, or $CKPTD_ENCRYPT_KEY naming the file"),
        (("--encrypt-key", "{short}"), 2, "must hold 32 bytes, raw or as 64 hex digits"),
        (("--encrypt-key", "{open}"), 6, "is readable by group or others (mode 0644): run chmod 600"),
        (("--encrypt-key", "{key}", "--ranks", "2", "--dedup"), 2, "--dedup compares pages across ranks"),
        (
            (
                "--encrypt-key",
                "{key}",
                "--stage-dir",
                "{tmp}/stage",
                "--ckpt-dir",
                "{tmp}/shared",
                "--compress",
                "zstd",
            ),
            2,
            "--compress cannot shrink encrypted images",
        ),
    ],
)
def test_launch_refuses_what_cannot_be_encrypted(
    ckptd: Ckptd, tmp_path: Path, extra: tuple[str, ...], code: int, message: str
) -> None:
    make_key(tmp_path / "key")
    (tmp_path / "short").write_bytes(b"x" * 31)
    (tmp_path / "short").chmod(0o600)
    make_key(tmp_path / "open")
    (tmp_path / "open").chmod(0o644)
    args = [
        a.format(short=tmp_path / "short", open=tmp_path / "open", key=tmp_path / "key", tmp=tmp_path) for a in extra
    ]
    r = ckptd.run(CKPTD, "launch", "--detach", "--encrypt", *args, "--", "true", check=False)
    assert r.returncode == code, r
    assert len(r.stderr.strip().splitlines()) == 1 and message in r.stderr, r.stderr
    assert not (ckptd.home / "jobs").exists() or not list((ckptd.home / "jobs").iterdir())
