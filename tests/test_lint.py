"""The code stays ruff-clean and type-checks (skipped where the tools are missing)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.skipif(shutil.which("ruff") is None, reason="ruff not installed")
def test_ruff() -> None:
    p = subprocess.run(["ruff", "check", str(REPO)], capture_output=True, text=True)
    assert p.returncode == 0, p.stdout


@pytest.mark.skipif(shutil.which("mypy") is None, reason="mypy not installed")
def test_mypy_installed_package(tmp_path: Path) -> None:
    p = subprocess.run(
        ["mypy", "--ignore-missing-imports", "--no-incremental", "-p", "ckptd"],
        capture_output=True,
        text=True,
        cwd=tmp_path,  # the installed package, not the source tree
    )
    assert p.returncode == 0, p.stdout
