"""Distributed tests: real torchrun groups of CPU ranks (gloo). Every test here is marked ``distributed``.

``run_moeverify`` runs the real ``python -m moeverify run`` in a subprocess, with the tiny checks of
``test_runner_checks.py`` added to the check registry by a test-side start-up hook (``tiny_checks.py``), and
returns its exit code, output and JSON records.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import tiny_checks

HERE = Path(__file__).resolve().parent
REPO_ROOT = HERE.parents[1]


def pytest_collection_modifyitems(config, items):
    for item in items:
        if Path(str(item.fspath)).resolve().parent == HERE:
            item.add_marker(pytest.mark.distributed)


@dataclasses.dataclass(frozen=True)
class CliRun:
    code: int
    output: str
    records: list[dict]
    junit: Path

    def record(self, scenario: str, check: str) -> dict:
        matches = [r for r in self.records if r["scenario"] == scenario and r["check"] == check]
        assert len(matches) == 1, f"{scenario} {check}: {len(matches)} records in {self.records}"
        return matches[0]


@pytest.fixture
def run_moeverify(tmp_path):
    """``run_moeverify(yaml_text, *flags, timeout_s=170) -> CliRun`` (a slow run fails the test, cleanly).

    With ``background=True`` it returns the running ``Popen``; ``run_moeverify.finish(proc)`` collects it.
    """

    def run(yaml_text: str, *flags: str, timeout_s: float = 170, background: bool = False):
        scenario_file = tmp_path / "scenarios.yaml"
        scenario_file.write_text(textwrap.dedent(yaml_text))
        out_json, out_xml = tmp_path / "out.json", tmp_path / "out.xml"
        env = tiny_checks.env()
        cmd = [
            sys.executable,
            "-m",
            "moeverify",
            "run",
            str(scenario_file),
            "--json",
            str(out_json),
            "--junit",
            str(out_xml),
            "--run-dir",
            str(tmp_path / "run"),
            *flags,
        ]
        proc = subprocess.Popen(
            cmd, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        if background:  # the caller signals it; ``finish(proc)`` collects the run
            return proc
        return finish(proc, timeout_s=timeout_s)

    def finish(proc: subprocess.Popen, *, timeout_s: float = 170) -> CliRun:
        out_json, out_xml = tmp_path / "out.json", tmp_path / "out.xml"
        try:
            output, _ = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.terminate()  # the CLI kills its torchrun group on SIGTERM
            output, _ = proc.communicate(timeout=60)
            pytest.fail(f"moeverify run took more than {timeout_s} s:\n{output[-4000:]}")
        records = json.loads(out_json.read_text()) if out_json.exists() else []
        return CliRun(code=proc.returncode, output=output, records=records, junit=out_xml)

    run.finish = finish
    run.tmp_path = tmp_path
    return run
