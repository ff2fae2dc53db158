"""Prometheus metrics and JSON logs, read back the way an operator would.

A real Prometheus server (Debian's `prometheus`, installed here when missing)
scrapes the embedded daemon every second; the values are read back through
its HTTP query API.  `ckptd coordinator` and `ckptd agent` with --metrics are
scraped directly.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import debian
import pytest
from conftest import CKPTD, Ckptd, compile_workload

pytestmark = pytest.mark.serial  # it installs the prometheus package


@pytest.fixture(scope="module")
def ctimer_bin(tmp_path_factory: pytest.TempPathFactory) -> str:
    return compile_workload(tmp_path_factory, "ctimer")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def prometheus_binary() -> str:
    """The Debian package's server; installed when missing.  No Prometheus fails the test: it is what it checks."""
    debian.install(["prometheus"], lambda: shutil.which("prometheus") is not None)
    path = shutil.which("prometheus")
    assert path
    return path


@pytest.fixture
def prometheus(tmp_path: Path) -> Iterator[tuple[str, int]]:
    """A private Prometheus server (not the system service): (its URL, the port it scrapes)."""
    binary = prometheus_binary()
    target, port = free_port(), free_port()
    d = tmp_path / "prometheus"
    d.mkdir()
    (d / "prometheus.yml").write_text(
        "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
        # honor_labels: ckptd's own `job` label (the ckptd job) is kept, not renamed exported_job
        "scrape_configs:\n  - job_name: ckptd\n    honor_labels: true\n"
        f"    static_configs:\n      - targets: ['127.0.0.1:{target}']\n"
    )
    log = open(d / "prometheus.log", "w")  # noqa: SIM115
    proc = subprocess.Popen(
        [binary, f"--config.file={d / 'prometheus.yml'}", f"--storage.tsdb.path={d / 'data'}",
         f"--web.listen-address=127.0.0.1:{port}"],
        stdout=log, stderr=subprocess.STDOUT, cwd=d,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            with contextlib.suppress(OSError), urllib.request.urlopen(f"{url}/-/ready", timeout=2) as r:
                if r.status == 200:
                    break
            assert proc.poll() is None, (d / "prometheus.log").read_text()[-2000:]
            assert time.monotonic() < deadline, "Prometheus did not become ready in 60 s"
            time.sleep(0.2)
        yield url, target
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def query(url: str, expr: str) -> list[dict]:
    with urllib.request.urlopen(f"{url}/api/v1/query?" + urllib.parse.urlencode({"query": expr}), timeout=5) as r:
        body = json.load(r)
    assert body["status"] == "success", body
    return list(body["data"]["result"])


def value_of(url: str, expr: str) -> float | None:
    result = query(url, expr)
    return float(result[0]["value"][1]) if result else None


def eventually(url: str, expected: dict[str, float], timeout: float = 30) -> None:
    """Every expression reaches its value within timeout (a scrape a second)."""
    deadline = time.monotonic() + timeout
    while True:
        got = {e: value_of(url, e) for e in expected}
        if got == expected:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"Prometheus reads {got}, expected {expected}")
        time.sleep(0.5)


def test_prometheus_scrapes_checkpoints_and_restarts(
    ckptd: Ckptd, prometheus: tuple[str, int], ctimer_bin: str
) -> None:
    url, target = prometheus
    ckptd.env["CKPTD_METRICS"] = f"127.0.0.1:{target}"  # the embedded daemon's
    ckptd.launch("m", [ctimer_bin, "100000"])
    ckptd.wait_log("m", r"^round 5\b")
    t0 = time.time()
    ckptd.checkpoint("m")
    ckptd.checkpoint("m")
    ckptd.kill9("m")
    refused = ckptd.ctl("checkpoint", "m", check=False)  # a failed job: nothing to checkpoint
    assert refused.returncode != 0
    assert "not running" in refused.stderr, refused.stderr
    ckptd.ctl("restart", "m")
    ok = '{job="m",result="ok"}'
    eventually(
        url,
        {
            f"ckptd_checkpoints_total{ok}": 2.0,
            'ckptd_checkpoints_total{job="m",result="failed_precondition"}': 1.0,
            f"ckptd_restarts_total{ok}": 1.0,
            "ckptd_checkpoint_duration_seconds_count": 2.0,
            "ckptd_checkpoint_pause_seconds_count": 2.0,
            'ckptd_jobs{state="running"}': 1.0,
            'ckptd_jobs{state="failed"}': 0.0,
            "count(ckptd_node_up == 1)": 1.0,
            'ckptd_checkpoint_bytes_total{job="m",kind="deduplicated"}': 0.0,
        },
    )
    stored = value_of(url, 'ckptd_checkpoint_bytes_total{job="m",kind="stored"}')
    written = value_of(url, 'ckptd_checkpoint_bytes_total{job="m",kind="written"}')
    listed = sum(c["size_bytes"] for c in ckptd.ctl_json("list", "m"))
    assert stored == written == listed > 0, (stored, written, listed)
    last = value_of(url, 'ckptd_last_checkpoint_timestamp_seconds{job="m"}')
    assert last is not None and t0 <= last <= time.time() + 1
    pause_sum = value_of(url, "ckptd_checkpoint_pause_seconds_sum")
    duration_sum = value_of(url, "ckptd_checkpoint_duration_seconds_sum")
    assert pause_sum is not None and duration_sum is not None and 0 < pause_sum <= duration_sum


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        return str(r.read().decode())


def test_coordinator_and_agent_serve_metrics(tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.mkdir()
    env = dict(os.environ, CKPTD_HOME=str(home))
    env.pop("CKPTD_COORDINATOR", None)
    sock = tmp_path / "coord.sock"
    cport, aport = free_port(), free_port()
    coord = subprocess.Popen(
        [CKPTD, "coordinator", "--listen", f"unix:{sock}", "--metrics", f"127.0.0.1:{cport}"], env=env
    )
    agent = subprocess.Popen(
        [CKPTD, "agent", "--coordinator", f"unix:{sock}", "--node", "mnode", "--metrics", f"127.0.0.1:{aport}"],
        env=env,
    )
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                if 'ckptd_node_up{node="mnode"} 1.0' in scrape(cport):
                    break
            except OSError:
                pass
            assert coord.poll() is None and agent.poll() is None, "a daemon exited"
            assert time.monotonic() < deadline, "the coordinator never reported node mnode up"
            time.sleep(0.2)
        text = scrape(aport)
        assert 'ckptd_node_up{node="mnode"} 1.0' in text
        assert 'ckptd_jobs{state="running"} 0.0' in text
        assert "# TYPE ckptd_checkpoint_pause_seconds histogram" in scrape(cport)
    finally:
        for p in (agent, coord):
            p.terminate()
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def test_bad_metrics_address_is_refused(tmp_path: Path) -> None:
    # once (2026-11-28, one CI run of the serial tests) this command hung for
    # the whole timeout and was not seen again in a rerun and 15 tries: a
    # hang now fails with the command's Python stacks (faulthandler on SIGABRT)
    env = dict(os.environ, CKPTD_HOME=str(tmp_path), PYTHONFAULTHANDLER="1")
    p = subprocess.Popen(
        [CKPTD, "coordinator", "--listen", f"unix:{tmp_path / 'c.sock'}", "--metrics", "nowhere"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        _, err = p.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        p.send_signal(signal.SIGABRT)
        _, err = p.communicate(timeout=30)
        pytest.fail(f"`ckptd coordinator --metrics nowhere` hung for 60 s; its stacks:\n{err}")
    assert p.returncode != 0
    assert err.strip().splitlines() == ["error: --metrics wants HOST:PORT (e.g. 0.0.0.0:9464), not 'nowhere'"]


def test_json_logs(ckptd: Ckptd, ctimer_bin: str) -> None:
    ckptd.env["CKPTD_LOG_FORMAT"] = "json"
    ckptd.launch("j", [ctimer_bin, "100000"])
    ckptd.wait_log("j", r"^round 3\b")
    ckptd.checkpoint("j")
    ckptd.ctl("kill", "j")
    lines = (ckptd.home / "logs" / "daemon.log").read_text().splitlines()
    entries = [json.loads(line) for line in lines]  # every line is one JSON object
    assert entries
    for e in entries:
        assert {"ts", "level", "logger", "msg"} <= e.keys(), e
    committed = [e for e in entries if "committed ckpt-" in e["msg"]]
    assert committed and committed[0]["job"] == "j" and committed[0]["level"] == "info", committed
