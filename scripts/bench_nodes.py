"""Namespace nodes for scripts/bench.py --nodes: a coordinator on a Unix
socket and one agent per node, each node a network namespace on one bridge
(tests/cluster.py, under its own names "ckb-*" so a bench never touches a
test's nodes), every node's checkpoints in one shared directory.  Root."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from cluster import Cluster  # the tests' namespace nodes

from ckptd.paths import Home


class Nodes:
    """with Nodes(base, 4) as nodes: ... nodes.env reaches its coordinator."""

    def __init__(self, base: Path, count: int) -> None:
        self.dir = base / "nodes"
        self.dir.mkdir(parents=True)
        self.names = [f"n{i}" for i in range(count)]
        self.cluster = Cluster(self.dir, self.names, prefix="ckb", sweep_strays=False)
        sock = self.dir / "coord.sock"
        self.address = f"unix:{sock}"
        self.env = dict(os.environ, CKPTD_HOME=str(self.dir / "home"), CKPTD_COORDINATOR=self.address)
        for var in ("LD_PRELOAD", "CKPTD_JOB", "CKPTD_SHIM_SOCKET"):
            self.env.pop(var, None)
        self.coordinator: subprocess.Popen[Any] | None = None

    def __enter__(self) -> Nodes:
        try:
            self.cluster.setup_network()
            with open(self.dir / "coordinator.log", "ab") as out:
                self.coordinator = subprocess.Popen(
                    ["ckptd", "coordinator", "--listen", self.address], env=self.env, stdout=out, stderr=out,
                    start_new_session=True,
                )  # fmt: skip
            for name in self.names:
                argv = [
                    "ckptd", "agent", "--coordinator", self.address, "--node", name,
                    "--ip", self.cluster.node_ip(name), "--listen", f"unix:{self.dir / ('agent-' + name + '.sock')}",
                ]  # fmt: skip
                self.cluster.start_agent(name, argv, self.env)
            self._wait_alive()
        except BaseException:
            self.__exit__()
            raise
        return self

    def _wait_alive(self, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            p = subprocess.run(
                ["ckptctl", "nodes", "--json"], check=False, env=self.env, capture_output=True, text=True
            )
            if p.returncode == 0 and sum(bool(n.get("alive")) for n in json.loads(p.stdout)) == len(self.names):
                return
            time.sleep(0.3)
        raise SystemExit(f"the {len(self.names)} namespace nodes never all answered (logs in {self.dir})")

    def __exit__(self, *exc: object) -> None:
        if self.coordinator is not None:
            self.coordinator.kill()
            self.coordinator.wait()
        self.cluster.teardown()  # its agents, their ranks, the namespaces
        Home(self.dir / "home").remove_run_dir()
