"""Bounds on the numbers a client may ask for, checked by the CLIs (a usage
error, exit 2) and again by the servers (coordinator/jobs.py check_spec), for
a client can call the RPCs directly.  What they prevent: a checkpoint storm
(an interval of 1e-9 s or NaN), and values that overflow the protocol's
32-bit fields into a traceback."""

from __future__ import annotations

import math
import re

from ckptd.errors import CkptdError, Code

# a job's name becomes a directory under its checkpoint directory: no '/',
# no '..' (it starts with a letter or digit), no newline (fullmatch)
JOB_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")

MIN_INTERVAL_S = 1.0  # periodic checkpoints at most once a second
MAX_INTERVAL_S = 366 * 86400.0
MAX_COUNT = 1_000_000  # --keep, --keep-every, --full-every
MAX_CHECKPOINT_ID = 2**32 - 1  # --from (a uint32 on the wire)
MAX_RANKS = 250  # --ranks (a job's ranks share a /24 of virtual IPs: coordinator/ranks.py)
MAX_QUIESCE_S = 86400.0  # checkpoint --timeout
MAX_WAIT_S = 366 * 86400.0  # wait --timeout
DEFAULT_IDLE_EXIT_S = 1800.0  # the local daemon exits after this long without a live job (daemon --idle-exit)


def valid_job_name(name: str) -> bool:
    return JOB_NAME_RE.fullmatch(name) is not None


def check_job_name(name: str) -> None:
    if not valid_job_name(name):
        raise CkptdError(
            Code.INVALID_ARGUMENT,
            f"invalid job name {name!r}: use 1-64 letters, digits, '.', '_' or '-', starting with a letter or digit",
        )


def in_range(flag: str, value: float | None, low: float, high: float, unit: str = "") -> None:
    """value (None: not given) is a finite number from low to high, or a usage error."""
    if value is None:
        return
    if not math.isfinite(value) or not low <= value <= high:
        unit = f" {unit}" if unit else ""
        raise CkptdError(
            Code.INVALID_ARGUMENT,
            f"{flag} must be at least {_num(low)} and at most {_num(high)}{unit}, not {_num(value)}",
        )


def _num(x: float) -> str:
    if math.isfinite(x) and float(x).is_integer() and abs(x) < 1e18:
        return str(int(x))
    return f"{x:g}"


def check_interval(flag: str, interval_s: float | None) -> None:
    """A checkpoint interval: 0 or not given (none), else MIN_INTERVAL_S or more."""
    if interval_s is None or interval_s == 0:
        return
    in_range(flag, interval_s, MIN_INTERVAL_S, MAX_INTERVAL_S, "seconds")


LOG_FORMATS = ("text", "json")  # --log-format, CKPTD_LOG_FORMAT
