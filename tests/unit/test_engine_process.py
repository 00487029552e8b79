"""``moeverify.engines.vllm_process`` without an engine: how a missing, failing, silent or hanging engine process is
told (the real engine's runs are tests/engines)."""

from __future__ import annotations

import os
import stat
import sys
import time

import pytest

from moeverify.engines import vllm_process
from moeverify.errors import EnvironmentProblem, UsageError

JOB = {"model": "/nonexistent", "steps": [{"op": "reset_prefix_cache"}]}


def _script(tmp_path, body: str):
    path = tmp_path / "fake-python"
    path.write_text("#!/bin/sh\n" + body + "\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def test_no_engine_python_named(monkeypatch, tmp_path):
    monkeypatch.delenv(vllm_process.PYTHON_ENV, raising=False)
    with pytest.raises(UsageError, match="MOEVERIFY_VLLM_PYTHON=PATH .* `make engine-setup`"):
        vllm_process.run(JOB, workdir=tmp_path / "w")
    with pytest.raises(UsageError, match="not an executable file"):
        vllm_process.run(JOB, workdir=tmp_path / "w", python=tmp_path / "missing")


def test_workdir_must_be_empty(tmp_path):
    (tmp_path / "w").mkdir()
    (tmp_path / "w" / "old").write_text("x")
    with pytest.raises(UsageError, match="not empty"):
        vllm_process.run(JOB, workdir=tmp_path / "w", python=sys.executable)


@pytest.mark.timing
def test_python_without_vllm_fails_at_start_up_naming_the_import(tmp_path):
    with pytest.raises(EnvironmentProblem, match=r"vLLM failed at start-up \(exit 1\): .*(vllm|triton)"):
        vllm_process.run(JOB, workdir=tmp_path / "w", python=sys.executable, timeout=120)


def test_engine_exiting_without_a_result_is_an_error(tmp_path):
    with pytest.raises(vllm_process.EngineError, match=r"exited 0 without writing .*result.json; its log ends:\nhello"):
        vllm_process.run(JOB, workdir=tmp_path / "w", python=_script(tmp_path, "echo hello"))


@pytest.mark.timing
def test_engine_past_its_timeout_is_killed_with_its_group(tmp_path):
    marker = tmp_path / "child.pid"
    script = _script(tmp_path, f"sleep 300 & echo $! > {marker}; wait")
    with pytest.raises(vllm_process.EngineError, match="ran past 2 s and was killed"):
        vllm_process.run(JOB, workdir=tmp_path / "w", python=script, timeout=2)
    pid = int(marker.read_text())
    with pytest.raises(ProcessLookupError):  # the engine's own children went with it
        for _ in range(50):
            os.kill(pid, 0)
            time.sleep(0.1)


@pytest.mark.timing
def test_serving_engine_without_vllm_fails_at_start_up(tmp_path):
    with pytest.raises(EnvironmentProblem, match="vLLM failed at start-up"):
        vllm_process.Engine("/nonexistent", workdir=tmp_path / "w", python=sys.executable, timeout=120)
