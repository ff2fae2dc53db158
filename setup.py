"""Build glue: compiles native/ and generates the gRPC code from proto/.

Both land inside the package (ckptd/_native, ckptd/v1) and are ignored by
git: nobody edits generated code by hand.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

try:
    from setuptools.command.bdist_wheel import bdist_wheel
except ImportError:  # setuptools < 70.1
    from wheel.bdist_wheel import bdist_wheel  # type: ignore[no-redef]

ROOT = Path(__file__).resolve().parent


def build_native() -> None:
    out = ROOT / "ckptd" / "_native"
    try:
        subprocess.run(["make", "-C", str(ROOT / "native"), f"OUT={out}", "all"], check=True)
    except FileNotFoundError:
        sys.exit("error: building ckptd needs make and a C compiler: apt-get install make gcc libc6-dev binutils")
    except subprocess.CalledProcessError as e:
        sys.exit(f"error: building ckptd's native parts failed (make exited {e.returncode}; its error is above)")
    # the Python image reader parses the same header with cffi
    header = ROOT / "native" / "include" / "ckptd" / "image_format.h"
    (out / "image_format.h").write_text(header.read_text())


def generate_protos() -> None:
    from grpc_tools import protoc  # build requirement

    proto_root = ROOT / "proto"
    sources = sorted(str(p.relative_to(proto_root)) for p in proto_root.rglob("*.proto"))
    well_known = Path(protoc.__file__).parent / "_proto"
    rc = protoc.main(
        [
            "grpc_tools.protoc",
            f"-I{proto_root}",
            f"-I{well_known}",
            f"--python_out={ROOT}",
            f"--pyi_out={ROOT}",
            f"--grpc_python_out={ROOT}",
            *sources,
        ]
    )
    if rc != 0:
        sys.exit(f"protoc failed with status {rc}")


class PlatformWheel(bdist_wheel):
    """The wheel holds native programs for the machine that built it (no
    Python extension, so any Python 3 will do): py3-none-linux_<arch>."""

    def finalize_options(self) -> None:
        super().finalize_options()
        self.root_is_pure = False

    def get_tag(self) -> tuple[str, str, str]:
        return "py3", "none", super().get_tag()[2]


class BuildWithNative(build_py):
    def run(self) -> None:
        if not os.environ.get("CKPTD_SKIP_NATIVE"):
            build_native()
        generate_protos()
        super().run()


setup(
    cmdclass={"build_py": BuildWithNative, "bdist_wheel": PlatformWheel},
    packages=["ckptd", "ckptd.v1", "ckptd.cli", "ckptd.image", "ckptd.image.plan", "ckptd.agent", "ckptd.coordinator"],
    package_dir={
        "ckptd": "ckptd",
        "ckptd.agent": "agent",
        "ckptd.coordinator": "coordinator",
    },
    package_data={
        "ckptd": [
            "_native/libckptd.so",
            "_native/ckptd-restore",
            "_native/ckptd-init",
            "_native/layout-dump",
            "_native/ckptd-crypt",
            "_native/ckptd-dedup",
            "_native/image_format.h",
            "py.typed",
        ],
    },
    include_package_data=False,
)
