"""The config file: flag > environment > config file > default, and one-line errors for bad keys and values."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from conftest import CKPTCTL, CKPTD

from ckptd import config
from ckptd.cli.ckptd_main import parser

CONFIG = """
[env]
CKPTD_COORDINATOR = "unix:/from/config.sock"

[daemon]
metrics = "127.0.0.1:1001"
log-format = "json"
idle-exit = 5

[launch]
interval = 60.0
keep = 3
dedup = true

[coordinator]
admin = ["root", "ops"]
"""


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    for var in (*config.ENV_KEYS, "CKPTD_CONFIG"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("CKPTD_HOME", str(tmp_path))
    return tmp_path


def parse(*argv: str) -> object:
    p = parser()
    config.apply(p)
    return p.parse_args(list(argv))


def test_precedence(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    plain = parse("daemon")
    assert (plain.metrics, plain.log_format, plain.idle_exit) == (None, None, 1800.0)  # type: ignore[attr-defined]

    (home / "config.toml").write_text(CONFIG)
    d = parse("daemon")
    assert (d.metrics, d.log_format, d.idle_exit) == ("127.0.0.1:1001", "json", 5.0)  # type: ignore[attr-defined]
    assert os.environ["CKPTD_COORDINATOR"] == "unix:/from/config.sock"
    launch = parse("launch", "--keep", "7", "--", "true")
    assert (launch.interval, launch.keep, launch.dedup, launch.sigterm) == (60.0, 7, True, "checkpoint")  # type: ignore[attr-defined]
    assert parse("coordinator").admin == ["root", "ops"]  # type: ignore[attr-defined]

    # the environment beats the file, for [env] and for a flag's variable
    monkeypatch.setenv("CKPTD_COORDINATOR", "unix:/from/env.sock")
    monkeypatch.setenv("CKPTD_METRICS", "127.0.0.1:2002")
    monkeypatch.setenv("CKPTD_IDLE_EXIT", "9")
    d = parse("daemon")
    assert (d.metrics, d.idle_exit) == ("127.0.0.1:2002", 9.0)  # type: ignore[attr-defined]
    assert os.environ["CKPTD_COORDINATOR"] == "unix:/from/env.sock"
    # and a flag beats both
    d = parse("daemon", "--metrics", "127.0.0.1:3003", "--log-format", "text", "--idle-exit", "0")
    assert (d.metrics, d.log_format, d.idle_exit) == ("127.0.0.1:3003", "text", 0.0)  # type: ignore[attr-defined]


def test_system_file_and_explicit_file(home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    other = tmp_path / "elsewhere.toml"
    other.write_text("[launch]\nkeep = 4\n")
    monkeypatch.setenv("CKPTD_CONFIG", str(other))
    assert parse("launch", "--", "true").keep == 4  # type: ignore[attr-defined]
    monkeypatch.delenv("CKPTD_CONFIG")
    monkeypatch.setattr(config, "SYSTEM_FILE", other)  # /etc/ckptd/config.toml when CKPTD_HOME has none
    assert parse("launch", "--", "true").keep == 4  # type: ignore[attr-defined]
    (home / "config.toml").write_text("[launch]\nkeep = 2\n")  # CKPTD_HOME's first
    assert parse("launch", "--", "true").keep == 2  # type: ignore[attr-defined]


def run(home: Path, *argv: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in (*config.ENV_KEYS, "CKPTD_CONFIG")}
    env["CKPTD_HOME"] = str(home)
    return subprocess.run(list(argv), env=env, capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize(
    ("text", "key", "why"),
    [
        ("[launch]\nintervall = 5\n", "[launch] intervall", "unknown key"),
        ('[launch]\nkeep = "three"\n', "[launch] keep", "wants an integer, not 'three'"),
        ('[daemon]\nlog-format = "xml"\n', "[daemon] log-format", "wants one of text, json, not 'xml'"),
        ('[env]\nCKPTD_HOME = "/x"\n', "[env] CKPTD_HOME", "unknown variable"),
        ("[lanch]\nkeep = 1\n", "[lanch]", "unknown section"),
    ],
)
def test_bad_key_or_value_is_one_line_naming_file_and_key(home: Path, text: str, key: str, why: str) -> None:
    path = home / "config.toml"
    path.write_text(text)
    p = run(home, CKPTD, "launch", "--", "true")
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 2, p.stderr  # a usage error
    assert len(lines) == 1 and lines[0].startswith(f"error: config file {path}: {key}: {why}"), lines
    if key.startswith("[env]"):  # ckptctl reads [env] too
        p = run(home, CKPTCTL, "jobs")
        assert p.returncode == 2 and p.stderr.startswith(f"error: config file {path}: {key}: "), p.stderr


def test_the_cli_reads_the_file(home: Path) -> None:
    (home / "config.toml").write_text("[launch]\ninterval = 1e-9\n")
    p = run(home, CKPTD, "launch", "--", "true")
    assert p.returncode == 2 and "--interval" in p.stderr, p.stderr  # refused before any daemon starts
