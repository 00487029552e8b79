"""Export check over layouts, under torchrun: the reference ``sharded`` exporter, the bridge itself and the
``gather`` peer must pass every subcheck, bit for bit, with items checked in each.

Each test runs ONE torchrun over several scenarios (``export_driver.py``) to pay imports once.
Run with ``pytest tests/special_distributed/test_export_matrix.py`` (slow: a few minutes on 2 cores).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

DRIVER = Path(__file__).with_name("export_driver.py")
ROOT = Path(__file__).resolve().parents[2]


def run_driver(tmp_path: Path, *, nproc: int, scenarios: list[str], subjects=(), extra=(), timeout=1500) -> list[dict]:
    out = tmp_path / "records.json"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        str(nproc),
        str(DRIVER),
        "--out",
        str(out),
    ]
    for s in scenarios:
        cmd += ["--scenario", s]
    for s in subjects:
        cmd += ["--subject", s]
    cmd += list(extra)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0 and out.exists(), f"torchrun exited {proc.returncode}:\n{proc.stderr[-4000:]}"
    return json.loads(out.read_text())


def _failures(records):
    return [
        f"{r['scenario']} {r['subject']}: "
        + "; ".join(f"{k}: {v['failures'][:2]}" for k, v in r["subchecks"].items() if not v["passed"])
        + (r["error"] or "")
        for r in records
        if not r["passed"]
    ]


TWO_RANKS = [
    f"{f}:{l}"
    for f in ("qwen2", "qwen2_tied", "qwen3_moe", "deepseek_v3")
    for l in (("tp2-sp", "pp2", "pp2-vpp2") if f in ("qwen3_moe", "deepseek_v3") else ("tp2", "pp2", "pp2-vpp2"))
]
TWO_RANKS += [f"{f}:{l}" for f in ("qwen3_moe", "deepseek_v3") for l in ("ep2", "etp2")]
FOUR_RANKS = [f"{f}:{l}" for f in ("qwen3_moe", "deepseek_v3") for l in ("ep2", "pp2-ep2", "tp2-pp2-sp")]
FOUR_RANKS += ["qwen2:tp2-pp2", "qwen2_tied:tp2-pp2"]


def test_export_matrix_two_ranks_pass(tmp_path):
    # the default subject (sharded) runs on these layouts in the release matrix of make test
    records = run_driver(tmp_path, nproc=2, scenarios=TWO_RANKS, subjects=("bridge", "gather"))
    assert len(records) == 2 * len(TWO_RANKS)
    assert not _failures(records), "\n".join(_failures(records))
    for r in records:
        assert r["subchecks"] and [k for k, v in r["subchecks"].items() if v["checked"] <= 0] == [], r


@pytest.mark.skipif(os.cpu_count() < 2, reason="4 ranks need at least 2 cores")
@pytest.mark.release  # 4 ranks; the release matrix runs the export check on 4 and 8 ranks
def test_export_matrix_four_ranks_pass(tmp_path):
    records = run_driver(tmp_path, nproc=4, scenarios=FOUR_RANKS, subjects=("sharded", "bridge"))
    assert len(records) == 2 * len(FOUR_RANKS)
    assert not _failures(records), "\n".join(_failures(records))
