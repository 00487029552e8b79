"""RL job zoo: real 2-rank training loops under torchrun, replayed bit for bit.

Two jobs, each run through the session API and, unmodified, under autopatch:

- ``jobs/interleaved_job.py``: Megatron's pipeline schedule (``get_forward_backward_func``) with PP2 x VPP2,
  interleaved 1F1B over 4 micro-batches, full recompute; qwen3_moe (4 MoE layers: one per model chunk, rank 0
  holds layers 0 and 2, rank 1 layers 1 and 3). ``batch_p2p_comm`` stays False (broken under gloo with VPP).
- ``jobs/tp_sp_accum_job.py``: TP2 + sequence parallel, a hand-written gradient-accumulation loop over 3
  micro-batches with full recompute; the backward order changes step by step: per micro-batch (forward then
  backward), all forwards then backward in forward order, in reverse order, one backward of the summed losses.

What must hold, per rank and per parameter, comparing the raw bytes of every gradient (sha256 digests written by
the jobs, ``jobs/common.grad_digest``):

- the replayed training pass's grads are BITWISE equal to those of the same loop routed natively by Megatron
  (unpatched) on the same weights. With unchanged weights the recorded routes are the native ones, so any
  difference would be replay's doing (its probabilities, its recompute matching, its bookkeeping);
- with the router weights perturbed after the recording, the replayed routes (forwards and every full-recompute
  call) are the recorded ones, and native top-k on the replay's own inputs would pick other experts;
- a negative control in the session jobs: replaying the recorded ids shifted by one expert changes every grad,
  so the digest comparison does catch a wrong replay.

The routes a router actually used are observed by forward hooks (``jobs/common.RouteLog``), apart from the
implementation under test. Under autopatch the recording's one merged dump is also read back and checked
against what the routers did, token by token in the dump's global (sequence-major) order.

Cost: every torchrun launch spends ~20 s of a 2-core box importing Megatron(-Bridge) and building the model, so
each job runs three: the session run (a module fixture shared by both tests: its unpatched passes are also the
autopatch test's native reference), the autopatch recording and the autopatch replay.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from moeverify.models import hf_config_dict

ROOT = Path(__file__).resolve().parents[2]
JOBS = Path(__file__).resolve().parent / "jobs"
TIMEOUT_S = int(os.environ.get("MOEVERIFY_TEST_TIMEOUT_S", "600"))
RANKS = 2
NUM_EXPERTS = hf_config_dict("qwen3_moe")["num_experts"]
B, S = 2, 8  # the jobs' micro-batch: B sequences of S tokens

# job -> layout name, layers per rank, sequence split over TP ranks (sp), micro-batches and steps of every run, the
# step from which the autopatch replay's routers are perturbed, the backward order of each step
JOB_SPECS = {
    "interleaved": dict(
        script="interleaved_job.py",
        layout="pp2-vpp2",
        layers={0: [0, 2], 1: [1, 3]},
        sp=False,
        microbatches=4,
        steps=3,
        perturb_from=2,
        orders=None,
    ),
    "tp_sp_accum": dict(
        script="tp_sp_accum_job.py",
        layout="tp2-sp",
        layers={0: [0, 1, 2, 3], 1: [0, 1, 2, 3]},
        sp=True,
        microbatches=3,
        steps=6,
        perturb_from=4,
        orders=("interleaved", "forward", "reverse", "sum"),
    ),
}


def _run(
    spec: dict, mode: str, out: Path, steps: int, *, autopatch: str | None = None, extra_env: dict | None = None
) -> subprocess.CompletedProcess:
    """torchrun (2 ranks) of a job; ``autopatch="record:DIR"`` / ``"replay:DIR"`` runs it as autopatch's script."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("MOEVERIFY_ROUTER_REPLAY", "MOEVERIFY_ROUTER_REPLAY_MODEL", "PERTURB", "PERTURB_FROM")
    }
    env.update(extra_env or {})
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(RANKS)]
    if autopatch is not None:
        env["MOEVERIFY_ROUTER_REPLAY"] = autopatch
        cmd += ["-m", "moeverify.patches.autopatch"]
    cmd += [str(JOBS / spec["script"]), mode, str(out), str(steps), str(spec["microbatches"])]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert proc.returncode == 0, (
        f"{spec['script']} {mode} {autopatch or ''}: exit {proc.returncode}\n{proc.stderr[-4000:]}"
    )
    return proc


def _load(out: Path) -> dict[int, dict]:
    return {rank: json.loads(Path(f"{out}.rank{rank}").read_text()) for rank in range(RANKS)}


@pytest.fixture(scope="module")
def session_run(tmp_path_factory):
    """``session_run(job) -> {rank: result}``: the job through the session API, run once per job and module (the
    first test of a job pays for it). Its unpatched passes are the native reference of both tests."""
    done: dict[str, dict] = {}

    def get(job: str) -> dict[int, dict]:
        if job not in done:
            spec = JOB_SPECS[job]
            out = tmp_path_factory.mktemp(f"session-{job}") / "session.json"
            _run(spec, "session", out, spec["steps"])
            done[job] = _load(out)
        return done[job]

    return get


def assert_same_grads(got: dict, want: dict, what: str) -> None:
    assert got.keys() == want.keys(), f"{what}: other parameters"
    missing = sorted(n for n, d in want.items() if d is None)
    assert not missing, f"{what}: parameters without a grad in the reference: {missing[:5]}"
    differ = sorted(n for n in want if got[n] != want[n])
    assert not differ, f"{what}: {len(differ)} of {len(want)} grads differ bitwise, e.g. {differ[:5]}"


def assert_full_recompute(routes: dict, layers: list[int], microbatches: int, what: str) -> None:
    for kind in ("forward", "recompute", "native"):
        counts = {int(layer): len(mbs) for layer, mbs in routes[kind].items()}
        assert counts == dict.fromkeys(layers, microbatches), f"{what}: {kind} calls per layer {counts}"


def assert_differs_per_layer(got: dict, other: dict, what: str) -> None:
    same = sorted(layer for layer in other if got[layer] == other[layer])
    assert not same, f"{what}: layer(s) {same} route exactly alike"


@pytest.mark.parametrize("job", sorted(JOB_SPECS))
def test_session_api_replay_is_bitwise_native_and_follows_the_recording(job, session_run):
    """Session API (``rr.ReplaySession``: record the log-prob pass, replay it in the training pass,
    ``check_consumed()``), every step, every rank: replayed grads == Megatron-unpatched grads (``rr.revert()``, same
    process, same weights) bit for bit; with perturbed routers replay takes the recorded routes (forward and
    recompute) and native routing does not; replaying wrong routes changes every grad."""
    spec = JOB_SPECS[job]
    mbs = spec["microbatches"]
    for rank, result in session_run(job).items():
        layers = spec["layers"][rank]
        assert result["layers"] == layers, f"rank {rank}: holds layers {result['layers']}"
        assert len(result["steps"]) == spec["steps"]
        for step, passes in enumerate(result["steps"]):
            what = f"rank {rank} step {step}"
            native, replay = passes["native"], passes["replay"]
            if spec["orders"]:
                assert native["order"] == replay["order"] == spec["orders"][step % len(spec["orders"])], what
            assert_full_recompute(native["routes"], layers, mbs, f"{what} native")
            assert native["routes"]["native"] == native["routes"]["forward"], (
                f"{what}: the hook's native top-k does not reproduce Megatron's routing"
            )
            assert passes["recorded"] == native["routes"]["forward"], f"{what}: the recording is not native routing"
            assert_same_grads(replay["grads"], native["grads"], f"{what} replay vs native")
            assert replay["routes"] == native["routes"], f"{what}: replay routed otherwise than native"
            assert replay["losses"] == native["losses"], what
            # perturbed routers: replay follows the recording, native routing would not
            p_native, p_replay = passes["perturbed_native"], passes["perturbed_replay"]
            assert_full_recompute(p_replay["routes"], layers, mbs, f"{what} perturbed replay")
            assert p_replay["routes"]["forward"] == passes["recorded"], f"{what}: perturbed replay left the recording"
            assert p_replay["routes"]["recompute"] == native["routes"]["recompute"], (
                f"{what}: a recompute under perturbed replay left the recording"
            )
            assert_differs_per_layer(
                p_native["routes"]["forward"], passes["recorded"], f"{what}: the perturbation changed no native route"
            )
            assert_differs_per_layer(
                p_replay["routes"]["native"],
                p_replay["routes"]["forward"],
                f"{what}: native top-k at the replay's inputs",
            )
            if step == 0:  # negative control: the comparison sees a wrong replay
                wrong = passes["wrong_replay"]
                shifted = {
                    layer: [[sorted((e + 1) % NUM_EXPERTS for e in row) for row in ids] for ids in mbs_]
                    for layer, mbs_ in passes["recorded"].items()
                }
                assert wrong["routes"]["forward"] == shifted, f"{what}: the wrong routes were not replayed"
                same = sorted(n for n in native["grads"] if wrong["grads"][n] == native["grads"][n])
                assert not same, f"{what}: wrong routes left grads bitwise unchanged: {same[:5]}"
            else:
                assert "wrong_replay" not in passes


def _global_rows(per_rank: dict[int, list], *, sp: bool) -> list:
    """Router-order rows of one (layer, micro-batch) from each rank holding it -> sequence-major global rows.

    A router sees token (s, b) at row ``s * B + b`` of its sequence shard (TP rank t holds positions
    ``[t * S/2, (t+1) * S/2)`` under SP); the dump's global order is ``b * S + s``."""
    rows = [None] * (B * S)
    for rank, ids in per_rank.items():
        offset = rank * (S // RANKS) if sp else 0
        for i, row in enumerate(ids):
            rows[(i % B) * S + offset + i // B] = row
    assert None not in rows, "token rows missing"
    return rows


# make test keeps the interleaved job here and the TP2 + SP accumulation loop under the session API
@pytest.mark.parametrize(
    "job", [pytest.param(j, marks=pytest.mark.release) if j == "tp_sp_accum" else j for j in sorted(JOB_SPECS)]
)
def test_autopatch_unmodified_job_replays_bitwise_then_follows_recording_when_perturbed(job, tmp_path, session_run):
    """Autopatch on the unmodified job (its plain mode, run as torchrun's script
    ``-m moeverify.patches.autopatch JOB``). The native reference is the same loop with Megatron unpatched (the
    session run's native passes: same code, steps, batches and weights). ``record:DIR`` changes nothing (grads and
    routes bitwise native) and writes one merged dump whose rows are what the routers did; ``replay:DIR`` gives
    bitwise-native grads and routes in every step until the job perturbs its routers (``PERTURB_FROM``), and from
    then on the recorded routes in every forward and recompute, where native top-k on the replay's inputs would
    differ."""
    from moeverify import record
    from moeverify.cli import main as moeverify_main

    spec = JOB_SPECS[job]
    steps, perturb_from, mbs = spec["steps"], spec["perturb_from"], spec["microbatches"]
    dump = tmp_path / "dump"
    session = session_run(job)
    native = {
        rank: {"layers": r["layers"], "steps": [passes["native"] for passes in r["steps"]]}
        for rank, r in session.items()
    }
    _run(spec, "plain", tmp_path / "record.json", steps, autopatch=f"record:{dump}")
    _run(
        spec,
        "plain",
        tmp_path / "replay.json",
        steps,
        autopatch=f"replay:{dump}",
        extra_env={"PERTURB_FROM": str(perturb_from)},
    )
    recorded, replayed = (_load(tmp_path / f"{n}.json") for n in ("record", "replay"))

    loaded = record.load(dump)
    assert (loaded.world_size, loaded.layout.name(RANKS), sorted(loaded.steps)) == (
        RANKS,
        spec["layout"],
        list(range(steps)),
    )
    assert moeverify_main(["dump", "inspect", str(dump)]) == 0
    for rank in range(RANKS):
        layers = spec["layers"][rank]
        assert native[rank]["layers"] == layers, f"rank {rank}: holds layers {native[rank]['layers']}"
        for step in range(steps):
            what = f"rank {rank} step {step}"
            nat, rec, rep = (r[rank]["steps"][step] for r in (native, recorded, replayed))
            assert_full_recompute(nat["routes"], layers, mbs, f"{what} native")
            assert_same_grads(rec["grads"], nat["grads"], f"{what} record vs native")
            assert rec["routes"] == nat["routes"], f"{what}: recording changed the routes"
            if step < perturb_from:
                assert_same_grads(rep["grads"], nat["grads"], f"{what} replay vs native")
                assert rep["routes"] == nat["routes"], f"{what}: replay routed otherwise than native"
                assert rep["losses"] == nat["losses"], what
            else:
                assert rep["routes"]["forward"] == rec["routes"]["forward"], (
                    f"{what}: perturbed replay left the recording"
                )
                assert rep["routes"]["recompute"] == rec["routes"]["recompute"], (
                    f"{what}: a recompute under perturbed replay left the recording"
                )
                assert_differs_per_layer(
                    rep["routes"]["native"], rep["routes"]["forward"], f"{what}: native top-k at the replay's inputs"
                )
                assert rep["grads"] != rec["grads"], f"{what}: the perturbation changed no grad"
    # the dump: one merged view per step, log-prob forwards then training forwards, rows as the routers chose
    for step in range(steps):
        merged = loaded.routes(step=step)
        assert merged.microbatches == 2 * mbs, f"step {step}: {merged.microbatches} micro-batches in the dump"
        assert merged.layers == (0, 1, 2, 3)
        for layer in merged.layers:
            for mb in range(mbs):
                held = {
                    rank: recorded[rank]["steps"][step]["routes"]["forward"][str(layer)][mb]
                    for rank in range(RANKS)
                    if layer in spec["layers"][rank]
                }
                want = _global_rows(held, sp=spec["sp"])
                for rows in (merged.get(layer, mbs + mb), merged.get(layer, mb)):  # training, log-prob
                    assert rows.sort(dim=1).values.tolist() == want, f"dump step {step} layer {layer} mb {mb}"
