"""Node health for `ckptctl nodes`: CPU load, memory, and GPUs through NVML.

Without NVML (no NVIDIA driver, as on CI) the GPU field says so plainly.
"""

from __future__ import annotations

import contextlib
import os

import psutil

from ckptd.v1 import ckptd_pb2 as pb


def _gpus() -> tuple[str, list[pb.GpuHealth]]:
    try:
        import pynvml
    except ImportError:
        return "none (nvidia-ml-py not installed)", []
    try:
        pynvml.nvmlInit()
    except Exception as e:
        return f"none (NVML not available: {e})", []
    try:
        out = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            mem = pynvml.nvmlDeviceGetMemoryInfo(h)
            name = pynvml.nvmlDeviceGetName(h)
            out.append(
                pb.GpuHealth(
                    index=i,
                    name=name.decode() if isinstance(name, bytes) else str(name),
                    uuid=str(pynvml.nvmlDeviceGetUUID(h)),
                    temperature_c=pynvml.nvmlDeviceGetTemperature(h, pynvml.NVML_TEMPERATURE_GPU),
                    memory_used=mem.used,
                    memory_total=mem.total,
                )
            )
        return (f"{len(out)} GPU(s)" if out else "none (no NVIDIA GPU found)"), out
    finally:
        with contextlib.suppress(Exception):
            pynvml.nvmlShutdown()


def node_health(node: str) -> pb.NodeHealth:
    vm = psutil.virtual_memory()
    summary, gpus = _gpus()
    return pb.NodeHealth(
        node=node,
        alive=True,
        load1=os.getloadavg()[0],
        mem_total=vm.total,
        mem_available=vm.available,
        gpu=summary,
        gpus=gpus,
    )
