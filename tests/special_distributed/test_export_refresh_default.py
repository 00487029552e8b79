"""The README's "your exporter under test" command (``moeverify run --check export --subject FILE:factory``, no
other option) exports twice for a user's subject: a subject that caches its first export fails ``refresh``, the
same subject without the cache passes it, and the records say refresh ran by default for a user's subject.
(qwen3_moe on one rank, the cheapest scenario of scenarios/smoke.yaml; two runs of one export check each.)"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import tiny_checks

HERE = Path(__file__).resolve().parent
REPO_ROOT = HERE.parents[1]
PLUGIN = HERE / "stale_subject.py"
SCENARIO = "qwen3_moe/tp1"


def _run(tmp_path: Path, factory: str, *extra: str) -> tuple[subprocess.CompletedProcess, dict]:
    out = tmp_path / f"{factory}.json"
    cmd = [
        sys.executable,
        "-m",
        "moeverify",
        "run",
        "--check",
        "export",
        "--subject",
        f"{PLUGIN}:{factory}",
        *extra,
        "--filter",
        SCENARIO,
        "--json",
        str(out),
        "--run-dir",
        str(tmp_path / f"run-{factory}"),
    ]
    try:
        proc = subprocess.run(
            cmd, cwd=REPO_ROOT, env={**tiny_checks.env(), "COLUMNS": "300"}, capture_output=True, text=True, timeout=400
        )
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"moeverify run took more than 400 s:\n{(exc.stdout or '')[-4000:]}")
    (record,) = json.loads(out.read_text())
    return proc, record


def test_documented_command_catches_a_stale_second_export(tmp_path):
    proc, record = _run(tmp_path, "stale")
    assert proc.returncode == 1, proc.stdout[-4000:] + proc.stderr[-4000:]
    failed = {name for name, sub in record["subchecks"].items() if not sub["passed"]}
    assert failed == {"refresh", "refresh_delta"}, record["subchecks"]
    assert "kept the previous export's bits where the weights changed" in " ".join(
        record["subchecks"]["refresh_delta"]["failures"]
    )
    assert "after the weight update" in " ".join(record["subchecks"]["refresh"]["failures"])
    assert record["decisions"]["refresh"]["on"] is True
    assert record["decisions"]["refresh"]["why"].startswith("default for a user's subject")
    assert "refresh" not in record.get("not_run", {})


@pytest.mark.release  # the control of the stale case; make test keeps the catch
def test_documented_command_passes_a_fresh_subject(tmp_path):
    proc, record = _run(tmp_path, "fresh")
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert record["passed"] and record["subchecks"]["refresh"]["checked"] > 0, record
    assert record["decisions"]["refresh"]["on"] is True
    assert record["subchecks"]["refresh_delta"]["checked"] > 0
    receiver = {"receiver", "receiver_reload", "receiver_ranks", "receiver_repeat", "receiver_wake", "receiver_copies"}
    assert set(record["not_run"]) == receiver  # no receiver given
    assert (
        "not run: receiver, receiver_reload, receiver_ranks, receiver_repeat, receiver_wake, receiver_copies"
        in proc.stdout
    )
