"""GPU device memory, through the CUDA driver's checkpoint API.

A process of the job that has an NVIDIA device open (a /dev/nvidia*
descriptor) is a CUDA process.  Around a checkpoint:
  1. before any process is parked, the agent locks each CUDA process (its
     CUDA calls block from then on) and has the driver move its device
     memory into its own host memory (cuCheckpointProcessCheckpoint, which
     also closes its /dev/nvidia* descriptors);
  2. the shims dump the job as usual: the device memory is ordinary memory now;
  3. once the job runs again, the driver puts the device memory back
     (cuCheckpointProcessRestore) and unlocks the process.  The driver's
     threads must run for that, which is why it happens after RESUME: the
     process's own CUDA calls wait for the unlock.
After a restart, step 3 happens once the processes are rebuilt and released.

Status: written against the driver API as documented (cuda.bindings.driver,
driver 550+), and run on no GPU yet: CI has none, and this task was not
lent the GPU machine.  tests/test_gpu.py holds the round trip that must
pass there; it skips without a GPU.
"""

from __future__ import annotations

import contextlib
import logging
import os
from typing import Any

from ckptd.errors import CkptdError, Code

log = logging.getLogger(__name__)

LOCK_TIMEOUT_MS = 30_000


def cuda_pids(pids: list[int]) -> list[int]:
    """The processes among pids that have an NVIDIA device open."""
    out = []
    for pid in pids:
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    if os.readlink(f"/proc/{pid}/fd/{fd}").startswith("/dev/nvidia"):
                        out.append(pid)
                        break
    return out


def _driver() -> Any:
    try:
        from cuda.bindings import driver
    except ImportError:
        raise CkptdError(
            Code.FAILED_PRECONDITION,
            "the job uses an NVIDIA GPU, and saving its device memory needs cuda-python on the agent's node "
            "(pip install cuda-python)",
        ) from None
    missing = [f for f in ("cuCheckpointProcessLock", "cuCheckpointProcessCheckpoint") if not hasattr(driver, f)]
    if missing:
        raise CkptdError(
            Code.FAILED_PRECONDITION,
            "the installed cuda-python has no CUDA checkpoint API (cuda-bindings 12.8 or later is needed)",
        )
    return driver


def _call(driver: Any, name: str, *args: Any) -> Any:
    result = getattr(driver, name)(*args)
    err = result[0]
    if err != driver.CUresult.CUDA_SUCCESS:
        text = ""
        with contextlib.suppress(Exception):
            text = driver.cuGetErrorString(err)[1].decode()
        raise CkptdError(Code.FAILED_PRECONDITION, f"{name}: {text or err}")
    return result[1] if len(result) > 1 else None


class DeviceMemory:
    """The CUDA processes of one checkpoint (host pids), and where each stands."""

    def __init__(self, pids: list[int]) -> None:
        self.pids = pids
        self.locked: list[int] = []
        self.checkpointed: list[int] = []

    def move_to_host(self, timeout_ms: int = LOCK_TIMEOUT_MS) -> None:
        """Lock every CUDA process, then move its device memory into its host
        memory.  On failure, what was done is undone and the job runs on."""
        driver = _driver()
        try:
            for pid in self.pids:
                args = driver.CUcheckpointLockArgs()
                args.timeoutMs = timeout_ms
                _call(driver, "cuCheckpointProcessLock", pid, args)
                self.locked.append(pid)
            for pid in self.pids:
                _call(driver, "cuCheckpointProcessCheckpoint", pid, None)
                self.checkpointed.append(pid)
        except CkptdError as e:
            self.back_to_device()
            raise CkptdError(e.code, f"cannot save the job's GPU memory: {e.message}") from None

    def back_to_device(self) -> None:
        """Put the device memory back and unlock (the job runs again)."""
        if not self.locked:
            return
        driver = _driver()
        errors = []
        for pid in list(self.checkpointed):
            try:
                _call(driver, "cuCheckpointProcessRestore", pid, None)
                self.checkpointed.remove(pid)
            except CkptdError as e:
                errors.append(f"pid {pid}: {e.message}")
        for pid in list(self.locked):
            if pid in self.checkpointed:
                continue  # still off the device: unlocking it would let it fail its next CUDA call
            try:
                _call(driver, "cuCheckpointProcessUnlock", pid, None)
                self.locked.remove(pid)
            except CkptdError as e:
                errors.append(f"pid {pid}: {e.message}")
        if errors:
            raise CkptdError(Code.INTERNAL, "cannot give the job its GPU memory back: " + "; ".join(errors))


def restore_after_rebuild(pids: list[int]) -> None:
    """A restored CUDA process comes back locked with its device memory in
    host memory, as it was dumped: put it on the device, then unlock it."""
    if not pids:
        return
    state = DeviceMemory(pids)
    state.locked = list(pids)
    state.checkpointed = list(pids)
    state.back_to_device()
