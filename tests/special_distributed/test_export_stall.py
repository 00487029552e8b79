"""A rank that stalls in its subject makes lockstep fail on rank 0, naming the rank, within the lockstep
timeout: no hang, and no row is compared. (TP2, not PP2: under PP the sharded subject's own setup, the
bridge's name gathering over the PP group, already waits for the stalled rank; the runtime's group timeout
bounds that wait instead.)"""

from __future__ import annotations

import time
from pathlib import Path

from test_export_matrix import run_driver

SUBJECT = f"{Path(__file__).with_name('stall_subject.py')}:stalls"


def test_export_stalled_rank_fails_lockstep_without_hanging(tmp_path):
    t0 = time.time()
    records = run_driver(
        tmp_path, nproc=2, scenarios=["qwen2:tp2"], subjects=(SUBJECT,), extra=["--lockstep-timeout", "5"], timeout=600
    )
    (record,) = records
    lockstep = record["subchecks"]["lockstep"]
    assert not record["passed"] and not lockstep["passed"]
    assert "lockstep collective failed" in lockstep["failures"][0]
    assert "Ranks 1 failed to pass monitoredBarrier" in lockstep["failures"][0]
    assert [k for k, v in record["subchecks"].items() if v["passed"]] == []
    assert time.time() - t0 < 400
