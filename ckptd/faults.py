"""Fault points: test-only, deterministic injection of a signal at a phase boundary (issue 20).

The coordinator and the agent call ``point(phase, ...)`` at the end of each
phase of a checkpoint (reserve, ready, prepare, drain, dump, flush,
finalize, commit, resume), of a restart (verify, rebuild, release, lazy fill) and of an
upload to the shared tier (upload).  A round that needs no drain (nothing
unsent) passes its drain points all the same: the agent's at the end of the
prepare, the coordinator's where the phase would have run.  With
``CKPTD_FAULT`` unset, ``point`` returns at once: one test of a module global.

``CKPTD_FAULT=WHO:PHASE:SIGNAL`` (e.g. ``agent:dump:KILL``, ``job:prepare:STOP``)
sends SIGNAL to WHO the first time that phase ends in this process:

- ``coordinator``, ``agent``: this process, when the point is on that side;
- ``daemon``: this process, on either side (coordinator and agent in one);
- ``job``: every process of the job (the agent passes their host pids);
- ``init``: the job's ckptd-init (its relay and reaper; during a restart,
  the one that started the restorers).

``CKPTD_FAULT=@FILE`` reads the spec from FILE at every point instead; the
fault fires once, for whoever unlinks FILE first, so a test can arm one
fault after another against one daemon and one job.  The shim's page writer
(``writer:dump:SIG`` at its start, ``writer:flush:SIG`` before it names
pages.img; native/shim/writeout.c) reads the same variable from the job's
environment.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Iterable

log = logging.getLogger(__name__)

_SPEC = os.environ.get("CKPTD_FAULT", "")
_fired = False


def _spec() -> str:
    if not _SPEC.startswith("@"):
        return "" if _fired else _SPEC
    try:
        with open(_SPEC[1:]) as f:
            return f.read().strip()
    except OSError:
        return ""


def _claim() -> bool:
    """Only one process, once, fires a given fault."""
    global _fired
    if not _SPEC.startswith("@"):
        _fired = True
        return True
    try:
        os.unlink(_SPEC[1:])
        return True
    except OSError:
        return False


Pids = Callable[[], Iterable[int]]


def _none() -> Iterable[int]:
    return ()


def _soon(pids: Pids, wait_s: float = 5.0) -> list[int]:
    """pids, once there are any: a restart's processes appear a moment after
    the restorer is spawned (its "rebuild" point), and a fault that found
    none would not fire at all."""
    deadline = time.monotonic() + wait_s
    while not (found := list(pids())) and time.monotonic() < deadline:
        time.sleep(0.01)
    return found


def point(phase: str, side: str, job: Pids = _none, init: Pids = _none) -> None:
    """The end of `phase` on `side` ("coordinator" or "agent"); `job` and
    `init` name (when called: only when a fault is armed) the host pids a
    fault aimed at the job or at its ckptd-init hits."""
    if not _SPEC:
        return
    spec = _spec()
    if not spec:
        return
    try:
        who, where, name = spec.split(":")
        sig = signal.Signals[name if name.startswith("SIG") else "SIG" + name]
    except (ValueError, KeyError):
        log.error("CKPTD_FAULT=%r: expected WHO:PHASE:SIGNAL", spec)
        return
    if where != phase:
        return
    if who in (side, "daemon"):
        pids = [os.getpid()]
    elif who == "job":
        pids = _soon(job)
    elif who == "init":
        pids = list(init())
    else:
        return
    if not pids or not _claim():
        return
    log.warning("fault point: %s to %s (%s) at the end of %s", sig.name, who, pids, phase)
    if pids == [os.getpid()]:
        # to this very thread: it stops (or dies) on its way out of the call.
        # kill(getpid()) picks a thread of the kernel's choosing, and on a busy
        # machine this one went on meanwhile and sent the reply the fault was
        # to withhold (a restart that "succeeded" with its agent stopped)
        signal.pthread_kill(threading.get_ident(), sig)
        return
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)
