"""Autopatch on an unmodified training job, through its entry point (also as torchrun's script).

The job (``jobs/autopatch_job.py``): actor + reference in one process, a train-mode log-prob pass under
no_grad with full recompute, reverse-order backward, optimizer steps. Recorded once; replayed with
perturbed router weights, the training forwards must take exactly the recorded routes. Micro-batching
that differs from the recording, or a record directory that already holds a dump, must fail the job
with a non-zero exit.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
JOB = Path(__file__).resolve().parent / "jobs" / "autopatch_job.py"
TIMEOUT_S = int(os.environ.get("MOEVERIFY_TEST_TIMEOUT_S", "600"))


def run_job(
    mode: str,
    directory: Path,
    out: Path,
    *,
    steps=2,
    microbatches=2,
    perturb=False,
    torchrun=False,
    model="1",
    args=None,
    ranks=1,
    ep=1,
    tp=1,
):
    env = {
        **os.environ,
        "MOEVERIFY_ROUTER_REPLAY": f"{mode}:{directory}",
        "MOEVERIFY_ROUTER_REPLAY_MODEL": model,
        "PERTURB": "1" if perturb else "0",
        "EP": str(ep),
        "TP": str(tp),
    }
    launcher = (
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks), "-m"]
        if torchrun or ranks > 1
        else [sys.executable, "-m"]
    )
    cmd = (
        launcher
        + ["moeverify.patches.autopatch"]
        + (args if args is not None else [str(JOB), str(out), str(steps), str(microbatches)])
    )
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)


@pytest.mark.release  # make test keeps the zoo's record -> bitwise replay -> follows-recording-when-perturbed jobs
def test_autopatch_job_record_then_replay_perturbed_follows_recording(tmp_path):
    dump = tmp_path / "dump"
    rec = run_job("record", dump, tmp_path / "record.json")
    assert rec.returncode == 0, rec.stderr[-3000:]
    again = run_job("record", dump, tmp_path / "again.json")
    assert again.returncode == 2 and "already holds files" in again.stderr, again.stderr[-2000:]
    native = run_job("record", tmp_path / "native", tmp_path / "native.json", perturb=True)
    assert native.returncode == 0, native.stderr[-3000:]
    rep = run_job("replay", dump, tmp_path / "replay.json", perturb=True, torchrun=True)
    assert rep.returncode == 0, rep.stderr[-3000:]
    recorded, replayed, perturbed = (
        json.loads((tmp_path / f"{n}.json").read_text()) for n in ("record", "replay", "native")
    )
    assert replayed["routes"] == recorded["routes"]
    assert perturbed["routes"] != recorded["routes"]  # the perturbation changes native routes: replay did the work


def test_autopatch_job_other_micro_batching_fails(tmp_path):
    dump = tmp_path / "dump"
    assert run_job("record", dump, tmp_path / "r.json", steps=1, microbatches=2).returncode == 0
    rep = run_job("replay", dump, tmp_path / "p.json", steps=1, microbatches=3)
    assert rep.returncode != 0
    # the third micro-batch of a 3-way split holds other sequences than the recording's (2 per step): refused by
    # token identity at that forward, before any route is replayed onto it
    assert "forward 2 (recorded step 0, micro-batch 2): tokens differ in 2 of 2 sequence(s)" in rep.stderr, rep.stderr[
        -2000:
    ]
    fewer = run_job("replay", dump, tmp_path / "q.json", steps=1, microbatches=1)
    assert fewer.returncode == 3 and "recorded step(s) [0] did not run in full" in fewer.stderr, fewer.stderr[-2000:]


def test_autopatch_entry_point_usage_errors(tmp_path):
    no_script = run_job("record", tmp_path / "d", tmp_path / "o.json", args=[])
    assert no_script.returncode == 2 and "usage: python -m moeverify.patches.autopatch SCRIPT" in no_script.stderr
    two_models = run_job("record", tmp_path / "d2", tmp_path / "o.json", model="")
    assert two_models.returncode != 0 and "2 MoE models are built in this process" in two_models.stderr


def test_autopatch_on_two_ranks_records_one_dump_with_the_real_layout_and_replays_it(tmp_path):
    from moeverify import record
    from moeverify.cli import main as moeverify_main

    dump = tmp_path / "dump"
    rec = run_job("record", dump, tmp_path / "record.json", ranks=2, ep=2)
    assert rec.returncode == 0, rec.stderr[-3000:]
    loaded = record.load(dump)  # one dump, not one per rank
    assert (loaded.world_size, loaded.layout.name(2), sorted(loaded.steps)) == (2, "ep2-dp2", [0, 1])
    assert [(c.ep, c.dp) for _, c in sorted(loaded.coords.items())] == [(0, 0), (1, 1)]
    assert loaded.token_order(0) == "sequence"  # each micro-batch's geometry was recorded
    # token identity: every rank's micro-batches carry one fingerprint per input sequence (B = 2)
    assert {(r, m): tuple(loaded.fingerprints(step=0, rank=r, mb=m).shape) for r in (0, 1) for m in range(4)} == {
        (r, m): (2,) for r in (0, 1) for m in range(4)
    }
    merged = loaded.routes(step=0)
    # 2 log-prob and 2 training forwards per step, each dp2 x B2 x S8 tokens
    assert merged.microbatches == 4 and merged.get(merged.layers[0], 0).shape[0] == 2 * 2 * 8
    assert moeverify_main(["dump", "inspect", str(dump)]) == 0
    rep = run_job("replay", dump, tmp_path / "replay.json", ranks=2, ep=2, perturb=True)
    assert rep.returncode == 0, rep.stderr[-3000:]
    for rank in (0, 1):
        recorded, replayed = (json.loads((tmp_path / f"{n}.json.rank{rank}").read_text()) for n in ("record", "replay"))
        assert replayed["routes"] == recorded["routes"], f"rank {rank}"
    other = run_job("replay", dump, tmp_path / "one.json")
    assert other.returncode != 0 and "was recorded on 2 rank(s) with layout ep2-dp2" in other.stderr, other.stderr[
        -2000:
    ]
    # Same world size, another layout: TP2 ranks share data-parallel rank 0's sequences, so rank 1's tokens are not
    # those it recorded; the layout is what differs, and what the refusal must name (not the data).
    tp2 = run_job("replay", dump, tmp_path / "tp2.json", ranks=2, tp=2)
    assert tp2.returncode != 0, tp2.stderr[-3000:]
    assert "recorded on 2 rank(s) with layout ep2-dp2" in tp2.stderr and "tp2" in tp2.stderr, tp2.stderr[-3000:]


PIPELINE_JOB = Path(__file__).resolve().parent / "jobs" / "pipeline_job.py"


@pytest.mark.release  # make test keeps the zoo's interleaved job: PP2 x VPP2 under the same schedule
def test_autopatch_under_megatrons_pipeline_schedule_pp2_records_and_replays(tmp_path):
    from moeverify import record

    dump = tmp_path / "dump"
    args = lambda out: [str(PIPELINE_JOB), str(out), "2", "3"]  # noqa: E731 (2 steps, 3 micro-batches)
    rec = run_job("record", dump, tmp_path / "r.json", ranks=2, model="", args=args(tmp_path / "record.json"))
    assert rec.returncode == 0, rec.stderr[-3000:]
    loaded = record.load(dump)
    assert (loaded.world_size, loaded.layout.name(2), sorted(loaded.steps)) == (2, "pp2", [0, 1])
    assert sorted(c.pp for c in loaded.coords.values()) == [0, 1]
    assert loaded.routes(step=1).microbatches == 6  # 3 log-prob + 3 training forwards, merged over both stages
    rep = run_job(
        "replay", dump, tmp_path / "p.json", ranks=2, model="", perturb=True, args=args(tmp_path / "replay.json")
    )
    assert rep.returncode == 0, rep.stderr[-3000:]
    nat = run_job(
        "record",
        tmp_path / "native",
        tmp_path / "n.json",
        ranks=2,
        model="",
        perturb=True,
        args=args(tmp_path / "native.json"),
    )
    assert nat.returncode == 0, nat.stderr[-3000:]
    for rank in (0, 1):
        recorded, replayed, native = (
            json.loads((tmp_path / f"{n}.json.rank{rank}").read_text()) for n in ("record", "replay", "native")
        )
        assert replayed["routes"] == recorded["routes"], f"rank {rank}: replay did not follow the recording"
        assert native["routes"] != recorded["routes"], f"rank {rank}: the perturbation changed nothing"
        assert len(recorded["routes"]) == 2 and recorded["routes"][0], f"rank {rank}: no training routes seen"
