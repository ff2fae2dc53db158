"""examples/kubernetes/: every manifest validates against Kubernetes 1.30's schemas (strict: no unknown
field), offline, and says what the issue asks of it."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml  # kubernetes-validate's own dependency

from ckptd import config

K8S = Path(__file__).resolve().parent.parent / "examples" / "kubernetes"
VERSION = "1.30.0"  # appArmorProfile (the agent's) is a field from 1.30 on
MANIFESTS = sorted(K8S.glob("*.yaml"))


def documents(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def kind(name: str) -> dict[str, Any]:
    found = [d for p in MANIFESTS for d in documents(p) if d["kind"] == name]
    assert len(found) == 1, f"{len(found)} {name}s"
    return found[0]


def test_there_are_manifests() -> None:
    names = {p.name for p in MANIFESTS}
    assert {"coordinator.yaml", "agent.yaml", "training-job.yaml", "secrets.yaml"} <= names, names


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_manifest_validates(path: Path) -> None:
    docs = documents(path)
    assert docs
    for doc in docs:
        try:
            kubernetes_validate.validate(doc, VERSION, strict=True)
        except kubernetes_validate.ValidationError as e:
            where = ".".join(str(x) for x in e.path)
            pytest.fail(f"{path.name}: {doc['kind']}/{doc['metadata']['name']}: {where}: {e.message}")


def test_validation_needs_no_network() -> None:
    """The schemas ship with the package: the same check in a network namespace without any network."""
    unshare = shutil.which("unshare")
    if unshare is None or subprocess.run([unshare, "-n", "true"], capture_output=True).returncode != 0:
        pytest.skip("cannot make a network namespace here (unshare -n)")
    cli = Path(sys.executable).parent / "kubernetes-validate"
    p = subprocess.run(
        [unshare, "-n", str(cli), "-k", VERSION, "--strict", "--quiet", *map(str, MANIFESTS)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert p.returncode == 0, p.stdout + p.stderr


def test_the_config_map_is_a_valid_config_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from ckptd.cli.ckptd_main import parser

    path = tmp_path / "config.toml"
    path.write_text(kind("ConfigMap")["data"]["config.toml"])
    for var in config.ENV_KEYS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("CKPTD_CONFIG", str(path))
    p = parser()
    config.apply(p)
    args = p.parse_args(["agent"])  # --coordinator is required, and comes from the file
    assert args.coordinator == "ckptd-coordinator.ckptd.svc:7070"


def test_training_job_resumes_and_checkpoints_before_it_is_killed() -> None:
    job = kind("Job")["spec"]
    pod = job["template"]["spec"]
    (c,) = pod["containers"]
    argv = c["command"] + c.get("args", [])
    assert argv[:2] == ["ckptd", "launch"] and "--resume" in argv
    name = argv[argv.index("--job") + 1]
    assert c["lifecycle"]["preStop"]["exec"]["command"] == ["ckptctl", "checkpoint", name, "--then-stop"]
    assert pod["terminationGracePeriodSeconds"] >= 300
    assert any(r["action"] == "Ignore" for r in job["podFailurePolicy"]["rules"])  # preemption is no failure


def test_agent_has_named_capabilities_only() -> None:
    pod = kind("DaemonSet")["spec"]["template"]["spec"]
    (agent,) = pod["containers"]
    sc = agent["securityContext"]
    assert not sc.get("privileged") and not pod.get("hostPID")
    assert sc["capabilities"]["drop"] == ["ALL"]
    assert {"SYS_ADMIN", "CHECKPOINT_RESTORE", "SYS_PTRACE"} <= set(sc["capabilities"]["add"])
    lines = [x.strip() for x in (K8S / "agent.yaml").read_text().splitlines()]
    caps = {f"- {c}" for c in sc["capabilities"]["add"]}
    for i, line in enumerate(lines):  # each one explained by the comment above it (or above its group)
        if line in caps:
            j = i - 1
            while lines[j] in caps:
                j -= 1
            assert lines[j].startswith("#"), f"capability {line[2:]} has no comment saying why"
