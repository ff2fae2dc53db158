"""TCP connections half closed, in the states that last as long as the
program keeps them (issue 19): FIN-WAIT-2 at the end that shut its sending
side, CLOSE-WAIT at its peer.  Both ends in the job: made again established
with their bytes in flight, then shut again.  tests/workloads/tcp_closing.c
checks from inside at every step: the states (TCP_INFO), the addresses, the
end of the stream after the unread bytes, EPIPE at the shut end, and that
the end in CLOSE-WAIT can still write to its peer.  A CLOSE-WAIT whose peer
was closed on this host (no process holds that end) gets it again, closed."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
from conftest import PYTHON, Ckptd, compile_workload, exact_round_trip
from test_bad_input import assert_refused

STEPS = "40"  # 4 s: a checkpoint under load must not outlast the program


@pytest.fixture(scope="module")
def tcp_closing(tmp_path_factory: pytest.TempPathFactory) -> str:
    return compile_workload(tmp_path_factory, "tcp_closing")


def test_half_closed_by_the_connecting_end(ckptd: Ckptd, tcp_closing: str) -> None:
    """The client end in FIN-WAIT-2, the accepted end in CLOSE-WAIT."""
    exact_round_trip(ckptd, "fin-client", [tcp_closing, STEPS, "client"])


def test_half_closed_by_the_accepted_end(ckptd: Ckptd, tcp_closing: str) -> None:
    """The accepted end in FIN-WAIT-2, the client end in CLOSE-WAIT."""
    exact_round_trip(ckptd, "fin-server", [tcp_closing, STEPS, "server"])


def test_close_wait_whose_peer_was_closed(ckptd: Ckptd, tcp_closing: str) -> None:
    """Its peer's end was closed: an orphan no process holds, in FIN-WAIT-2
    (/proc/net/tcp), made again and closed again; a write is answered with a
    reset, as before."""
    exact_round_trip(ckptd, "fin-orphan", [tcp_closing, STEPS, "peerclosed"])


HALF_CLOSED_OUT = """
import socket, sys, time
s = socket.create_connection(("127.0.0.1", int(sys.argv[1])))
assert s.recv(1) == b""  # the server outside the job shut its side
for i in range(150):
    print("tick", i, flush=True)
    time.sleep(0.02)
"""


def test_close_wait_whose_peer_is_outside_the_job_is_refused(ckptd: Ckptd, tmp_path: Path) -> None:
    """Its peer shut its sending side and still holds its end, outside the job: it cannot come back."""
    server = socket.create_server(("127.0.0.1", 0))
    script = tmp_path / "half_closed_out.py"
    script.write_text(HALF_CLOSED_OUT)
    ckptd.launch("fin-out", [PYTHON, str(script), str(server.getsockname()[1])])
    conn, _ = server.accept()
    conn.shutdown(socket.SHUT_WR)
    ckptd.wait_log("fin-out", r"^tick 3$")
    assert_refused(ckptd, "fin-out", "CLOSE-WAIT", "half closed by a peer outside the job")
    assert ckptd.wait("fin-out") == 0
    conn.close()
    server.close()
