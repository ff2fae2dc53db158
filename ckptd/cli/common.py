"""What both CLIs share: error reporting, exit codes, JSON and human output."""

from __future__ import annotations

import json
import logging
import sys
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from ckptd.errors import EXIT_CODES, EXIT_FAILED, CkptdError, Code
from ckptd.jobstate import JobState

if TYPE_CHECKING:  # protobuf is imported where used: `ckptctl jobs` with no daemon needs none
    from google.protobuf.message import Message

    from ckptd.v1 import ckptd_pb2 as pb

log = logging.getLogger("ckptd.cli")
T = TypeVar("T")


def lazy_module(name: str) -> Any:
    """A module imported on its first attribute access (gRPC's and protobuf's
    generated code: a read-only command with no daemon never needs them)."""
    import importlib
    import types

    class Lazy(types.ModuleType):
        def __getattr__(self, attr: str) -> Any:
            module = importlib.import_module(name)
            self.__dict__.update(module.__dict__)
            return getattr(module, attr)

    return Lazy(name)


def lazy_function(module: str, name: str) -> Any:
    """module.name, imported on the first call."""

    def call(*args: Any, **kw: Any) -> Any:
        import importlib

        return getattr(importlib.import_module(module), name)(*args, **kw)

    return call


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


def _ints(msg: Message, d: dict[str, Any]) -> dict[str, Any]:
    """proto3 JSON writes 64-bit integers as strings, and a job's state as
    its enum name; scripts want numbers, and the word the CLI prints."""
    from google.protobuf.descriptor import FieldDescriptor

    int64 = {
        FieldDescriptor.TYPE_INT64,
        FieldDescriptor.TYPE_UINT64,
        FieldDescriptor.TYPE_SINT64,
        FieldDescriptor.TYPE_FIXED64,
        FieldDescriptor.TYPE_SFIXED64,
    }
    for f in msg.DESCRIPTOR.fields:
        if f.name not in d:
            continue
        if f.type == FieldDescriptor.TYPE_MESSAGE and not f.message_type.GetOptions().map_entry:
            value = getattr(msg, f.name)
            if f.is_repeated:
                d[f.name] = [_ints(m, x) for m, x in zip(value, d[f.name], strict=False)]
            else:
                d[f.name] = _ints(value, d[f.name])
        elif f.enum_type is not None and f.enum_type.full_name == "ckptd.v1.JobState":
            d[f.name] = str(JobState.of(getattr(msg, f.name)))
        elif f.type in int64:
            d[f.name] = [int(x) for x in d[f.name]] if isinstance(d[f.name], list) else int(d[f.name])
    return d


def to_dict(msg: Message) -> dict[str, Any]:
    from google.protobuf import json_format

    d = json_format.MessageToDict(msg, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)
    return _ints(msg, d)


def print_json(obj: Any) -> None:
    # protobuf is loaded only if a message came from the daemon (offline answers are dicts)
    message = getattr(sys.modules.get("google.protobuf.message"), "Message", ())
    if isinstance(obj, message):
        obj = to_dict(obj)
    elif isinstance(obj, list):
        obj = [to_dict(o) if isinstance(o, message) else o for o in obj]
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


def progress_text(st: pb.JobStatus, width: int = 30) -> str:
    """The operation in flight with a text bar: `checkpoint 3: writing
    [#####.....] 1.2 GiB of 4.0 GiB (31%)`."""
    text = st.operation
    if not st.HasField("progress"):
        return text
    p = st.progress
    if p.total:
        filled = min(width, int(width * p.done / p.total))
        bar = "#" * filled + "." * (width - filled)
        return f"{text}  [{bar}] {human_bytes(p.done)} of {human_bytes(p.total)} ({100 * p.done // p.total}%)"
    return f"{text}  {human_bytes(p.done)} so far"


def watch_progress(
    describe: Callable[[], pb.JobStatus],
    running: Callable[[], bool],
    *,
    poll_s: float = 0.25,
) -> None:
    """A progress bar on stderr for the operation describe() reports, until
    running() says it is over: the bytes of the current phase, the phase's
    name, the speed and the elapsed time."""
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TransferSpeedColumn,
    )

    from ckptd.v1 import ckptd_pb2 as pb

    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        DownloadColumn(binary_units=True),
        TransferSpeedColumn(),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task("starting...", total=None)
        phase = ""
        while running():
            try:
                st = describe()
            except CkptdError:
                st = pb.JobStatus()
            p = st.progress if st.HasField("progress") else None
            what = f"{st.operation or 'working'}"
            if p is not None and (p.what != phase):  # a new phase: a new bar
                bar.reset(task)
                phase = p.what
            bar.update(task, description=what, completed=p.done if p else 0, total=(p.total or None) if p else None)
            time.sleep(poll_s)


def with_progress(
    work: Callable[[], T],
    describe: Callable[[], pb.JobStatus],
    enabled: bool,
) -> T:
    """Run work() in a thread; on a terminal, show a progress bar of the
    operation it starts (polled from the coordinator)."""
    if not enabled:
        return work()
    result: list[Any] = []
    error: list[BaseException] = []

    def runner() -> None:
        try:
            result.append(work())
        except BaseException as e:
            error.append(e)

    t = threading.Thread(target=runner, daemon=True)
    t.start()
    watch_progress(describe, t.is_alive)
    t.join()
    if error:
        raise error[0]
    return result[0]
