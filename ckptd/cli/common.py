"""What both CLIs share: error reporting, exit codes, JSON and human output."""

from __future__ import annotations

import json
import logging
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from google.protobuf import json_format
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message

from ckptd.errors import EXIT_CODES, EXIT_FAILED, CkptdError, Code

log = logging.getLogger("ckptd.cli")
T = TypeVar("T")


def setup_cli_logging(verbose: bool) -> None:
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.WARNING,
        format="%(name)s: %(levelname)s: %(message)s",
        stream=sys.stderr,
    )


def say(text: str) -> None:
    """Human output on stdout (the result of a command)."""
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


def note(text: str) -> None:
    """Messages about what ckptd is doing, on stderr."""
    sys.stderr.write(text + "\n")
    sys.stderr.flush()


_INT64 = {
    FieldDescriptor.TYPE_INT64,
    FieldDescriptor.TYPE_UINT64,
    FieldDescriptor.TYPE_SINT64,
    FieldDescriptor.TYPE_FIXED64,
    FieldDescriptor.TYPE_SFIXED64,
}


def _ints(msg: Message, d: dict[str, Any]) -> dict[str, Any]:
    """proto3 JSON writes 64-bit integers as strings; scripts want numbers."""
    for f in msg.DESCRIPTOR.fields:
        if f.name not in d:
            continue
        if f.type == FieldDescriptor.TYPE_MESSAGE and not f.message_type.GetOptions().map_entry:
            value = getattr(msg, f.name)
            if f.is_repeated:
                d[f.name] = [_ints(m, x) for m, x in zip(value, d[f.name], strict=False)]
            else:
                d[f.name] = _ints(value, d[f.name])
        elif f.type in _INT64:
            d[f.name] = [int(x) for x in d[f.name]] if isinstance(d[f.name], list) else int(d[f.name])
    return d


def to_dict(msg: Message) -> dict[str, Any]:
    d = json_format.MessageToDict(msg, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)
    return _ints(msg, d)


def print_json(obj: Any) -> None:
    if isinstance(obj, Message):
        obj = to_dict(obj)
    elif isinstance(obj, list):
        obj = [to_dict(o) if isinstance(o, Message) else o for o in obj]
    sys.stdout.write(json.dumps(obj, indent=2, sort_keys=True) + "\n")
    sys.stdout.flush()


def run_main(fn: Callable[[], int]) -> int:
    """Errors become one line on stderr and the documented exit code."""
    try:
        return fn()
    except CkptdError as e:
        note(f"error: {e.message}")
        return e.exit_code
    except KeyboardInterrupt:
        return 130
    except OSError as e:
        where = f": {e.filename}" if e.filename else ""
        note(f"error: {e.strerror or e}{where}")
        return EXIT_CODES[Code.PERMISSION_DENIED] if isinstance(e, PermissionError) else EXIT_FAILED
    except BrokenPipeError:
        return EXIT_FAILED


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def table(rows: list[list[str]], headers: list[str]) -> str:
    widths = [max(len(str(x)) for x in col) for col in zip(headers, *rows, strict=False)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=False)).rstrip()]
    for r in rows:
        lines.append("  ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=False)).rstrip())
    return "\n".join(lines)


def with_progress(
    work: Callable[[], T],
    describe: Callable[[], str],
    enabled: bool,
) -> T:
    """Run work() in a thread; on a terminal, show a spinner with describe()'s
    current phase (polled from the coordinator) and the elapsed time."""
    if not enabled:
        return work()
    from rich.console import Console

    result: list[Any] = []
    error: list[BaseException] = []

    def runner() -> None:
        try:
            result.append(work())
        except BaseException as e:
            error.append(e)

    t = threading.Thread(target=runner, daemon=True)
    t0 = time.monotonic()
    t.start()
    console = Console(stderr=True)
    with console.status("starting...") as status:
        while t.is_alive():
            t.join(0.25)
            try:
                phase = describe()
            except CkptdError:
                phase = ""
            status.update(f"{phase or 'working'}  [{time.monotonic() - t0:.1f} s]")
    if error:
        raise error[0]
    return result[0]
