"""``moeverify run`` end to end on real scenarios of scenarios/smoke.yaml with the roundtrip check."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from moeverify.spec.scenario import load

TIMEOUT_S = 170


def _run(repo_root, tmp_path, name: str) -> tuple[subprocess.CompletedProcess, list[dict]]:
    out = tmp_path / "out.json"
    cmd = [
        sys.executable,
        "-m",
        "moeverify",
        "run",
        "scenarios/smoke.yaml",
        "--filter",
        name,
        "--check",
        "roundtrip",
        "--json",
        str(out),
        "--run-dir",
        str(tmp_path / "run"),
    ]
    proc = subprocess.Popen(cmd, cwd=repo_root, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        output, _ = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.terminate()
        output, _ = proc.communicate(timeout=60)
        pytest.fail(f"moeverify run {name} took more than {TIMEOUT_S} s:\n{output[-4000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, output), json.loads(out.read_text())


@pytest.mark.parametrize(("name", "world_size"), [("qwen3_moe/tp1", 1), ("qwen3_moe/ep2-dp2", 2)])
def test_runner_roundtrip_real_scenario_passes(repo_root, tmp_path, name, world_size):
    assert {s.name: s.world_size for s in load([str(repo_root / "scenarios/smoke.yaml")])}[name] == world_size
    proc, records = _run(repo_root, tmp_path, name)
    assert proc.returncode == 0, proc.stdout[-4000:]
    (record,) = records
    assert (record["scenario"], record["check"], record["passed"]) == (name, "roundtrip", True)
    assert set(record["subchecks"]) == {"bitwise", "key_set"}
    assert record["subchecks"]["bitwise"]["checked"] > 10
    assert len(record["peak_rss_mb"]) == world_size


def test_runner_doctor_reports_stack_and_builds_a_model(repo_root):
    proc = subprocess.run(
        [sys.executable, "-m", "moeverify", "doctor", "--backend", "cpu"],
        cwd=repo_root,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    lines = proc.stdout.splitlines()
    assert lines[1].split() == ["torch", "2.14.1", "supported", ">=2.11,<2.15", "ok"]
    assert lines[2].split() == ["megatron-core", "0.19.2", "supported", ">=0.19,<0.20", "ok"]
    assert "backend          cpu (gloo, device cpu)" in lines
    assert lines[-1].startswith("build qwen3_moe on 1 rank: ok, ") and " parameters (" in lines[-1]
