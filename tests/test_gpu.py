"""GPU device memory (agent/gpu.py): a PyTorch CUDA job holding 8 GiB on
the device is checkpointed, killed with kill -9 and restarted, and its final
weights are those of the uninterrupted run.  Needs an NVIDIA GPU, PyTorch
with CUDA and cuda-python: skipped with the reason where any is missing
(CI has no GPU).  Without a GPU, what the agent reports is covered by
test_launch_and_cli.py (`ckptctl nodes` says "none (...)"), and every other
test is a job that never touched CUDA."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
from conftest import PYTHON, WORKLOADS, Ckptd, run_plain


def gpu_missing() -> str:
    if not Path("/dev/nvidiactl").exists() or shutil.which("nvidia-smi") is None:
        return "no NVIDIA GPU on this machine"
    probe = subprocess.run([PYTHON, "-c", "import torch; assert torch.cuda.is_available()"], capture_output=True)
    if probe.returncode != 0:
        return "PyTorch with CUDA is not installed"
    probe = subprocess.run([PYTHON, "-c", "from cuda.bindings import driver; driver.cuCheckpointProcessLock"],
                           capture_output=True)  # fmt: skip
    if probe.returncode != 0:
        return "cuda-python with the CUDA checkpoint API is not installed"
    return ""


@pytest.mark.skipif(bool(gpu_missing()), reason=gpu_missing() or "GPU present")
def test_cuda_training_round_trip(ckptd: Ckptd) -> None:
    argv = [PYTHON, str(WORKLOADS / "train_cuda.py"), "200", "8"]
    plain = run_plain(argv)
    ckptd.launch("cuda", argv)
    ckptd.wait_log("cuda", r"^step 40 ", timeout=300)
    info = ckptd.checkpoint("cuda")
    assert info["size_bytes"] > 8 << 30  # the device memory is in the image
    ckptd.wait_log("cuda", r"^step 80 ", timeout=300)
    ckptd.kill9("cuda")
    ckptd.ctl("restart", "cuda")
    assert ckptd.wait("cuda", timeout=600) == 0
    assert ckptd.log("cuda", "stdout") == plain.stdout
