"""Input hardening (issue 15): numbers that would start a checkpoint storm or
overflow the protocol, and job names that are not plain names, are refused
with a one-line usage error (exit 2) before anything is created, by the CLIs
and again by the servers, which a client can call directly."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import CKPTD, PYTHON, Ckptd
from test_bad_input import one_line_error

from ckptd.daemon import coordinator_address
from ckptd.errors import CkptdError, Code
from ckptd.paths import Home, default_node
from ckptd.rpc import agent_stub, call, coordinator_stub
from ckptd.v1 import ckptd_pb2 as pb
from ckptd.v1 import ckptd_pb2_grpc as pb_grpc

USAGE = 2


def assert_nothing_made(c: Ckptd, *dirs: Path) -> None:
    """The CLI stopped before reaching for a daemon: none runs, no state exists."""
    assert c.daemon_pids() == []
    assert list(c.home.iterdir()) == []
    for d in dirs:
        assert not d.exists(), d


@pytest.mark.parametrize(
    ("flags", "words"),
    [
        (["--interval", "nan"], ["--interval", "at least 1", "not nan"]),
        (["--interval", "inf"], ["--interval", "not inf"]),
        (["--interval", "1e-9"], ["--interval", "not 1e-09"]),
        (["--interval", "0.5"], ["--interval", "not 0.5"]),
        (["--interval", "-5"], ["--interval"]),
        (["--keep", "-1"], ["--keep", "at most 1000000"]),
        (["--keep", "99999999999"], ["--keep", "not 99999999999"]),
        (["--keep-every", "4294967296"], ["--keep-every"]),
        (["--full-every", "0"], ["--full-every"]),
        (["--full-every", "-7"], ["--full-every"]),
        (["--ranks", "100000"], ["--ranks", "at most 250"]),
        (["--ranks", "-1"], ["--ranks"]),
        (["--job", "bad\n"], ["invalid job name", "'bad\\n'"]),
        (["--job", "../escape"], ["invalid job name"]),
        (["--job", "a/b"], ["invalid job name"]),
        (["--job", ".."], ["invalid job name"]),
    ],
)
def test_launch_refuses(ckptd: Ckptd, tmp_path: Path, flags: list[str], words: list[str]) -> None:
    ck = tmp_path / "ck"
    p = ckptd.run(CKPTD, "launch", "--detach", "--ckpt-dir", str(ck), *flags, "--", "true", check=False)
    assert p.returncode == USAGE, p.stderr
    one_line_error(p, *words)
    assert_nothing_made(ckptd, ck)


@pytest.mark.parametrize(
    "args",
    [
        ["restart", "j", "--from", "-1"],
        ["restart", "j", "--from", "0"],
        ["restart", "j", "--from", "99999999999"],
        ["checkpoint", "j", "--timeout", "nan"],
        ["checkpoint", "j", "--timeout", "-1"],
        ["checkpoint", "j", "--timeout", "1e12"],
        ["wait", "j", "--timeout", "nan"],
        ["wait", "j", "--timeout", "-5"],
        ["wait", "j", "--timeout", "inf"],
        ["prune", "j", "--keep", "-1"],
        ["prune", "j", "--keep", "1099511627776"],
        ["prune", "j", "--keep-every", "0"],
    ],
    ids=" ".join,
)
def test_ckptctl_refuses(ckptd: Ckptd, args: list[str]) -> None:
    p = ckptd.ctl(*args, check=False)
    assert p.returncode == USAGE, p.stderr
    one_line_error(p, args[2], "must be at least")
    assert_nothing_made(ckptd)


def _coordinator(c: Ckptd) -> pb_grpc.CoordinatorStub:
    c.start_daemon()
    return coordinator_stub(coordinator_address(Home(c.home), start=False))


@pytest.mark.parametrize(
    ("spec", "words"),
    [
        pytest.param({"name": "trail\n"}, ["invalid job name"], id="name-newline"),
        pytest.param({"name": "../up"}, ["invalid job name"], id="name-dotdot"),
        pytest.param({"interval_s": float("nan")}, ["--interval", "nan"], id="interval-nan"),
        pytest.param({"interval_s": float("inf")}, ["--interval", "inf"], id="interval-inf"),
        pytest.param({"interval_s": 1e-9}, ["--interval"], id="interval-1e-9"),
        pytest.param({"keep_last": 2**32 - 1}, ["--keep"], id="keep-huge"),
        pytest.param({"full_every": 5_000_000}, ["--full-every"], id="full-every-huge"),
        pytest.param({"env": {"A=B": "1"}}, ["environment variable"], id="env-name"),
    ],
)
def test_launch_rpc_refuses(ckptd: Ckptd, tmp_path: Path, spec: dict[str, object], words: list[str]) -> None:
    """LaunchJob called directly (no CLI in the way): the coordinator checks the spec itself."""
    ck = tmp_path / "ck"
    stub = _coordinator(ckptd)
    fields = {"name": "direct", "argv": [PYTHON, "-c", "pass"], "ckpt_dir": str(ck), **spec}
    with pytest.raises(CkptdError) as e:
        call(stub.LaunchJob, pb.LaunchJobRequest(spec=pb.JobSpec(**fields)), 30, "coordinator")
    assert e.value.code is Code.INVALID_ARGUMENT, e.value.message
    assert "\n" not in e.value.message
    for w in words:
        assert w in e.value.message
    assert ckptd.ctl_json("jobs") == []
    assert not ck.exists()  # refused before the job's directory was made


@pytest.mark.parametrize(
    ("name", "rank_job"),
    [("../evil", ""), ("a/b", ""), ("..", ""), ("x\n", ""), ("../evil@0", "../evil"), ("ok@0", "../evil")],
)
def test_agent_start_job_refuses_paths(ckptd: Ckptd, tmp_path: Path, name: str, rank_job: str) -> None:
    """Agent.StartJob, called over the agent's own Unix socket: the agent
    itself refuses a name that is not a plain name, whoever sends it."""
    ckptd.start_daemon()  # coordinator + this node's agent
    ck = tmp_path / "deep" / "ck"
    ck.mkdir(parents=True)
    home = Home(ckptd.home)
    node = default_node()
    agent = agent_stub(f"unix:{home.agent_socket(node)}")
    spec = pb.JobSpec(name=name, argv=["true"], ckpt_dir=str(ck))
    if rank_job:
        spec.rank.job, spec.rank.rank = rank_job, 0
    with pytest.raises(CkptdError) as e:
        call(agent.StartJob, pb.StartJobRequest(spec=spec), 30, "agent")
    assert e.value.code is Code.INVALID_ARGUMENT, e.value.message
    assert "invalid job name" in e.value.message and "\n" not in e.value.message
    assert list(ck.iterdir()) == []
    assert sorted(p.name for p in (tmp_path / "deep").iterdir()) == ["ck"]  # nothing made beside it
    agent_jobs = home.agent_dir(node) / "jobs"
    assert not agent_jobs.exists() or list(agent_jobs.iterdir()) == []
    assert ckptd.ctl_json("jobs") == []
