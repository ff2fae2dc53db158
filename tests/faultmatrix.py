"""The fault-injection matrix (issue 20): rows are faults, columns are phases, cells held or failed.

A test that checks one cell carries the marker::

    @faultmatrix.cell("SIGKILL agent", "dump", "no commit; the last good checkpoint restores identical")

or, for a parametrized test, ``pytest.param(..., marks=faultmatrix.cell(...))``.  The cell is
"held" when the test passes, "FAILED" when it fails ("xfail": a known failure, its reason in the
test's xfail marker; several tests of one cell: the worst); conftest prints the whole matrix at the end
of every run (under pytest-xdist too: the cell travels in the report's user_properties).  The
promise is the sentence the test checks; ``--fault-matrix PATH`` also writes the matrix and the
promises as Markdown, the table ARCHITECTURE.md carries.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import pytest

# The columns, in the order a checkpoint, a restart and an upload go through them.
CHECKPOINT_PHASES = ("reserve", "ready", "prepare", "drain", "dump", "flush", "finalize", "commit", "resume")
RESTART_PHASES = ("verify", "rebuild", "release", "lazy fill")
OTHER_PHASES = ("upload", "any")
PHASES = CHECKPOINT_PHASES + RESTART_PHASES + OTHER_PHASES

PROPERTY = "fault_cell"


def cell(fault: str, phase: str, promise: str) -> pytest.MarkDecorator:
    """Mark a test as the check of one cell of the matrix."""
    if phase not in PHASES:
        raise ValueError(f"unknown phase {phase!r}: one of {', '.join(PHASES)}")
    return pytest.mark.fault_cell(fault=fault, phase=phase, promise=promise)


def properties(item: pytest.Item) -> None:
    """Copy an item's cell marker into its user_properties (called by conftest at setup)."""
    for mark in item.iter_markers("fault_cell"):
        item.user_properties.append((PROPERTY, dict(mark.kwargs)))


def collect(reports: Iterable[Any]) -> dict[tuple[str, str], tuple[str, str]]:
    """(fault, phase) -> (result, promise) from test reports; a cell failed if any of its tests failed."""
    cells: dict[tuple[str, str], tuple[str, str]] = {}
    for report in reports:
        for name, value in getattr(report, "user_properties", ()):
            if name != PROPERTY:
                continue
            key = (value["fault"], value["phase"])
            if report.skipped and getattr(report, "wasxfail", None) is not None:
                result = "xfail"  # a known failure, its reason in the test's xfail marker
            elif report.skipped:
                result = "skipped"
            elif report.failed:
                result = "FAILED"
            elif report.when == "call":
                result = "held"
            else:
                continue
            previous = cells.get(key, ("", ""))[0]
            rank = {"FAILED": 3, "xfail": 2, "held": 1, "skipped": 0}  # a cell is as good as its worst test
            if previous and rank[previous] >= rank[result]:
                continue
            cells[key] = (result, value["promise"])
    return cells


def render(cells: dict[tuple[str, str], tuple[str, str]]) -> str:
    """The matrix as a Markdown table, then each row's promises."""
    if not cells:
        return ""
    faults = list(dict.fromkeys(f for f, _ in sorted(cells, key=lambda k: k[0])))
    phases = [p for p in PHASES if any(p == ph for _, ph in cells)]
    lines = ["| fault | " + " | ".join(phases) + " |", "|---" * (len(phases) + 1) + "|"]
    for fault in faults:
        row = [cells.get((fault, p), ("", ""))[0] for p in phases]
        lines.append(f"| {fault} | " + " | ".join(row) + " |")
    held = sum(1 for r, _ in cells.values() if r == "held")
    lines.append("")
    lines.append(f"{held} of {len(cells)} cells held.")
    lines.append("")
    lines.append("Promises checked:")
    for (fault, phase), (_, promise) in sorted(cells.items()):
        lines.append(f"- {fault} / {phase}: {promise}")
    return "\n".join(lines)
