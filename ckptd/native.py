"""Where the compiled native parts live (built into the package by setup.py)."""

from __future__ import annotations

from pathlib import Path

from ckptd.errors import CkptdError, Code

NATIVE_DIR = Path(__file__).resolve().parent / "_native"


def native_path(name: str) -> Path:
    path = NATIVE_DIR / name
    if not path.exists():
        raise CkptdError(
            Code.INTERNAL,
            f"ckptd's native part {name} is missing from {NATIVE_DIR}; reinstall with `pip install .`",
        )
    return path


def shim_library() -> Path:
    return native_path("libckptd.so")


def restorer_binary() -> Path:
    return native_path("ckptd-restore")


def init_binary() -> Path:
    return native_path("ckptd-init")


def image_format_header() -> Path:
    return native_path("image_format.h")
