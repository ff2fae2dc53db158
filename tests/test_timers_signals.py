"""POSIX timers and signal queues come back exactly after a restart (issue 19):
the program (tests/workloads/timers_signals.c) checks its own timers and
queues at every step, before the checkpoint and after the restart, and
prints what an uninterrupted run prints."""

from __future__ import annotations

import pytest
from conftest import Ckptd, compile_workload, exact_round_trip
from test_bad_input import assert_refused


@pytest.fixture(scope="module")
def timers_signals(tmp_path_factory: pytest.TempPathFactory) -> str:
    return compile_workload(tmp_path_factory, "timers_signals")


def test_posix_timers_signal(ckptd: Ckptd, timers_signals: str) -> None:
    """DMTCP's timer1 and more: SIGEV_SIGNAL timers on several clocks whose
    handler reads sival_ptr and timer_getoverrun, a one-shot, a SIGEV_NONE
    stopwatch, ids with gaps, and the id of a timer created after the
    restart: expirations (signals + overruns) match the stopwatch.  The
    checkpoint comes at step 33, while the slow timer's timer_getoverrun()
    is set and its signal not pending."""
    exact_round_trip(ckptd, "timers", [timers_signals, "45", "signal"], checkpoint_at=33, kill_at=36)


def test_posix_timers_in_threads(ckptd: Ckptd, timers_signals: str) -> None:
    """SIGEV_THREAD_ID timers in three threads, their signals blocked and
    taken with sigtimedwait (overruns pile up, and one is often pending at
    the checkpoint): counts, values, timer ids and timer_getoverrun."""
    exact_round_trip(ckptd, "ttimers", [timers_signals, "45", "threads"])


def test_sigev_thread_timer(ckptd: Ckptd, timers_signals: str) -> None:
    """A SIGEV_THREAD timer (the shim's helper runs it, not glibc's, which
    blocks every signal): its function keeps running in threads of its own
    with the program's value across a checkpoint and a restart."""
    exact_round_trip(ckptd, "sevthread", [timers_signals, "30", "sigev_thread"])


def test_sigev_thread_timer_with_attributes_refused(ckptd: Ckptd, timers_signals: str) -> None:
    """One made with thread attributes is glibc's: refused at once, naming
    it, instead of a quiesce timeout."""
    ckptd.launch("sevattr", [timers_signals, "600", "sigev_thread_attr"])
    ckptd.wait_log("sevattr", r"^step 2 ok")
    assert_refused(ckptd, "sevattr", "SIGEV_THREAD and thread attributes")


def test_rt_signal_queues_at_depth(ckptd: Ckptd, timers_signals: str) -> None:
    """Every queued instance of an RT signal, process-wide and on three
    threads (a sender keeps 16 queued on each while the checkpoint parks
    them), and a standard signal, come back in order with their payloads."""
    exact_round_trip(ckptd, "rtqueue", [timers_signals, "45", "rtqueue"])
