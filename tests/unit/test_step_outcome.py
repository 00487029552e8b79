"""``runtime.outcome.agree`` on two real gloo processes: a step every rank failed is a result, a step one rank
failed is refused on both (naming the rank), and a failed rank whose peer waits in a collective it left ends
after ``MOEVERIFY_AGREE_TIMEOUT_S``, not at the collective timeout."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from waiting import CHILD_S, SLOW_HOST_S

pytestmark = pytest.mark.timing


ROOT = Path(__file__).resolve().parents[2]

# The process group's timeout (600 s, also MOEVERIFY_COLLECTIVE_TIMEOUT_S) is far past the test's bound on the
# agreement's own wait (SLOW_HOST_S), which is far past MOEVERIFY_AGREE_TIMEOUT_S (3 s): each rank times its agree
# itself, so a loaded host's slow start (imports, rendezvous) is not counted.
RANK = r"""
import datetime, json, sys, time
import torch, torch.distributed as dist
from moeverify.errors import RankDisagreement
from moeverify.runtime.outcome import agree
rank, port, case = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                        timeout=datetime.timedelta(seconds=600))
fails = case == "both" or rank == 1
if case == "stuck" and rank == 0:
    dist.barrier()  # waits for a rank that never comes: the test kills this one
t0 = time.monotonic()
try:
    agree(ValueError("no sqrtsoftplus") if fails else None, what="replay [sigmoid] drift")
    print(json.dumps({"rank": rank, "outcome": "agreed", "seconds": time.monotonic() - t0}), flush=True)
except RankDisagreement as e:
    print(json.dumps({"rank": rank, "outcome": "refused", "message": str(e), "seconds": time.monotonic() - t0}),
          flush=True)
"""


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(case: str) -> dict[int, dict]:
    port = _port()
    env = {
        **os.environ,
        "MOEVERIFY_AGREE_TIMEOUT_S": "3",
        "MOEVERIFY_COLLECTIVE_TIMEOUT_S": "600",
        "PYTHONPATH": str(ROOT),
    }
    procs = {
        r: subprocess.Popen(
            [sys.executable, "-c", RANK, str(r), str(port), case],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for r in (0, 1)
    }
    out = {}
    waits = {1: procs[1]} if case == "stuck" else procs
    try:
        for r, p in waits.items():
            try:
                stdout, stderr = p.communicate(timeout=CHILD_S)
            except subprocess.TimeoutExpired:
                pytest.fail(f"rank {r} did not end within {CHILD_S:.0f} s (a hang, not a slow host)")
            lines = [line for line in stdout.splitlines() if line.startswith("{")]
            assert lines, f"rank {r} printed no outcome (exit {p.returncode}):\n{stderr[-2000:]}"
            out[r] = json.loads(lines[-1])
    finally:
        for p in procs.values():
            p.kill()
            p.wait()
    return out


def test_every_rank_raising_is_a_result():
    out = _run("both")
    assert [out[r]["outcome"] for r in (0, 1)] == ["agreed", "agreed"]


def test_one_rank_raising_is_refused_on_every_rank_naming_it():
    out = _run("one")
    for r in (0, 1):
        assert out[r]["outcome"] == "refused"
        assert out[r]["message"].startswith(
            "replay [sigmoid] drift: rank(s) [1] raised (rank 1: ValueError: no "
            "sqrtsoftplus), rank(s) [0] did not: a one-rank error"
        ), out[r]


def test_a_raising_rank_whose_peer_waits_in_a_collective_ends_quickly():
    out = _run("stuck")
    assert out[1]["outcome"] == "refused"
    assert (
        "rank 1 raised ValueError: no sqrtsoftplus; rank(s) [0] did not end this step within 3 s" in out[1]["message"]
    ), out[1]
    seconds = out[1]["seconds"]
    assert seconds < SLOW_HOST_S, f"{seconds:.0f} s: the failed rank waited for its peer past the agreement timeout"


def test_outside_a_process_group_agree_returns():
    from moeverify.runtime.outcome import agree

    agree(ValueError("x"), what="one process")  # nothing to agree with: the caller records the error itself
