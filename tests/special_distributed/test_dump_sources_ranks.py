"""Real sources of the same forwards on 2 CPU ranks line up token for token: a moeverify dump (``RouteRecorder``
with each rank's place in the layout) and Megatron-Core's own ``RouterTracer`` (one JSONL per rank, layers
numbered within the pipeline stage), merged by ``dump convert TRACE_DIR --layout``, and the traces as a rollout
engine returns them (per request ``[S - 1, L, K]``, ``dump diff --rollout``), under EP2, TP2 + SP, CP2 and
PP2 (a dense first layer: the second stage's local layer 0 is global layer 2), and PP2 with the first stage
holding the dense layer alone (no router there: an empty trace, a dump rank with no layer). An injected disagreement in
one rank's trace is found at its global layer.

The test launches this file under torchrun; ``main()`` is the per-rank driver.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = int(os.environ.get("MOEVERIFY_TEST_TIMEOUT_S", "900"))
CASES = (
    ("qwen3_moe", "ep2", {"ep": 2}),
    ("qwen3_moe", "tp2-sp", {"tp": 2, "sp": True}),
    ("qwen3_moe", "cp2", {"cp": 2}),
    ("deepseek_v3", "pp2", {"pp": 2}),
    ("deepseek_v3", "pp2-ppfirst1", {"pp": 2, "pp_first": 1}),
)  # stage 0: the dense layer alone
SEQ_LEN, BATCH, MICROBATCHES, NUM_LAYERS = 8, 2, 2, 4


def _run_case(out_dir: Path, family: str, name: str, layout_dict: dict, rt) -> None:
    import torch
    from megatron.core.transformer.moe import router_trace

    from moeverify import models, record, runtime
    from moeverify.oracles.replay import drive as rd
    from moeverify.patches.recorder import RouteRecorder, model_info
    from moeverify.record.writer import RankWriter
    from moeverify.routing import views
    from moeverify.spec.layout import Layout

    layout = Layout(**layout_dict)
    case = out_dir / f"{family}-{name}"
    with runtime.parallel(layout):
        built = models.build(family, layout)
        coords = views.rank_coords(layout, rank=rt.rank, world_size=rt.world_size)
        batches = rd.Batches(
            seq_len=SEQ_LEN,
            batch=BATCH,
            microbatches=MICROBATCHES,
            dp=layout.dp(rt.world_size),
            vocab_size=int(models.hf_config_dict(family)["vocab_size"]),
        )
        items = rd.local_microbatches(batches, layout, dp_rank=coords.dp, cp_rank=coords.cp)
        writer = RankWriter(
            case / "dump", model=model_info(built.config), coords=coords, layout=layout, world_size=rt.world_size
        )
        tracer = router_trace.RouterTracer(str(case / "trace"), max_steps=1, rank=rt.rank, training_mode=True)
        tracer.register_hooks(built.model_chunks)
        with RouteRecorder(built.model_chunks, writer) as rec:
            rec.begin_step(0)
            rd.run_pass(built.model_chunks, items, seq_len=SEQ_LEN, forward_only=True)
            writer.flush()
        tracer.advance_step(0)
        tracer.remove_hooks()
        writer.close()
        torch.distributed.barrier()
        if rt.rank == 0:
            record.finalize(case / "dump", world_size=rt.world_size)
        torch.distributed.barrier()


def main() -> None:
    from moeverify import runtime

    out_dir = Path(sys.argv[1])
    rt = runtime.init("cpu")
    try:
        for family, name, layout in CASES:
            _run_case(out_dir, family, name, layout, rt)
    finally:
        import torch

        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    out = tmp_path_factory.mktemp("sources")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", __file__, str(out)]
    proc = subprocess.run(
        cmd, cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT_S, env={**os.environ, "PYTHONPATH": str(ROOT)}
    )
    assert proc.returncode == 0, f"torchrun exit {proc.returncode}:\n{proc.stderr[-6000:]}"
    return out


def _convert(trace: Path, dst: Path, name: str) -> int:
    from moeverify.cli import main as cli

    dense_stage = ["--moe-layers", "1,2,3"] if "ppfirst" in name else []  # an empty trace is then accepted
    return cli(
        [
            "dump",
            "convert",
            str(trace),
            str(dst),
            "--layout",
            name,
            "--world-size",
            "2",
            "--num-layers",
            str(NUM_LAYERS),
            "--seq-len",
            str(SEQ_LEN),
            "--batch",
            str(BATCH),
            "--microbatches",
            str(MICROBATCHES),
            *dense_stage,
        ]
    )


@pytest.mark.parametrize("family,name", [(f, n) for f, n, _ in CASES])
def test_router_trace_of_every_rank_and_the_dump_agree_token_for_token(sources, family, name):
    from moeverify import record
    from moeverify.cli import main as cli

    case = sources / f"{family}-{name}"
    assert sorted(p.name for p in (case / "trace").glob("router_trace_rank*.jsonl")) == [
        "router_trace_rank0.jsonl",
        "router_trace_rank1.jsonl",
    ]
    if "ppfirst" in name:  # the dense first stage traced nothing and dumped no layer
        assert (case / "trace" / "router_trace_rank0.jsonl").read_text() == ""
        rank0 = record.load(case / "dump").manifest["ranks"]["0"]  # rank 0 is in the dump (KeyError if not)
        assert [f["layers"] for f in rank0["files"] if f.get("layers")] == []  # and holds no layer (may hold no file)
    assert _convert(case / "trace", case / "from_trace", name) == 0
    converted, dump = record.load(case / "from_trace"), record.load(case / "dump")
    assert converted.world_size == 2 and converted.model.moe_layers == dump.model.moe_layers
    out = case / "diff.json"
    assert (
        cli(["dump", "diff", str(case / "dump"), str(case / "from_trace"), "--json", str(out), "--fail-on-diff"]) == 0
    )
    report = json.loads(out.read_text())
    dp = 2 if name == "ep2" else 1
    sequences = MICROBATCHES * dp * BATCH
    assert report["tokens"] == sequences * SEQ_LEN and report["tokens_diverging_any_layer"] == 0.0
    # the traces as a rollout engine returns them: one [S - 1, L, K] array per request, the last row not captured
    import numpy as np

    routes = converted.routes(step=0)
    requests = [
        routes.stacked(mb).numpy()[b * SEQ_LEN : (b + 1) * SEQ_LEN - 1]
        for mb in range(routes.microbatches)
        for b in range(dp * BATCH)
    ]
    np.savez(case / "rollout.npz", **{f"req{r:03d}": a for r, a in enumerate(requests)})
    out = case / "rollout.json"
    assert (
        cli(
            [
                "dump",
                "diff",
                str(case / "dump"),
                str(case / "rollout.npz"),
                "--rollout",
                "--json",
                str(out),
                "--fail-on-diff",
            ]
        )
        == 0
    )
    rollout = json.loads(out.read_text())["rollout"]
    assert rollout["requests"] == sequences and rollout["uncaptured_tokens"] == sequences
    assert rollout["compared_tokens"] == sequences * (SEQ_LEN - 1)


def test_an_injected_disagreement_in_rank_1s_trace_is_found_at_its_global_layer(sources):
    from moeverify.cli import main as cli

    case = sources / "deepseek_v3-pp2"  # rank 1 is the second stage: its local layer 0 is global layer 2
    lines = (case / "trace" / "router_trace_rank1.jsonl").read_text().splitlines()
    recs = [json.loads(line) for line in lines]
    target = next(i for i, r in enumerate(recs) if r["layer"] == 0)
    row = recs[target]["top_indices"][0]
    recs[target]["top_indices"][0] = [e for e in range(8) if e not in row][: len(row)]
    bad = case / "bad_trace"
    bad.mkdir()
    (bad / "router_trace_rank0.jsonl").write_text((case / "trace" / "router_trace_rank0.jsonl").read_text())
    (bad / "router_trace_rank1.jsonl").write_text("\n".join(json.dumps(r) for r in recs) + "\n")
    assert _convert(bad, case / "bad_dump", "pp2") == 0
    out = case / "bad.json"
    assert cli(["dump", "diff", str(case / "dump"), str(case / "bad_dump"), "--json", str(out), "--fail-on-diff"]) == 1
    assert json.loads(out.read_text())["first_divergent_layer"] == {"2": 1}


def test_convert_layout_refuses_a_missing_rank_vpp_and_a_layout_that_does_not_fit(sources, capsys):
    from moeverify.cli import main as cli

    case = sources / "qwen3_moe-ep2"
    one = case / "one_rank"
    one.mkdir()
    (one / "router_trace_rank1.jsonl").write_text((case / "trace" / "router_trace_rank1.jsonl").read_text())
    capsys.readouterr()
    assert _convert(one, case / "x1", "ep2") == 2
    assert "rank(s) [0] missing" in capsys.readouterr().err
    assert _convert(case / "trace", case / "x2", "tp4") == 2
    assert "does not fit --world-size 2" in capsys.readouterr().err
    assert _convert(case / "trace", case / "x3", "pp2-vpp2") == 2
    assert "under VPP" in capsys.readouterr().err
    assert cli(["dump", "convert", str(case / "trace"), str(case / "x4"), "--layout", "ep2"]) == 2
    assert "needs --world-size, --num-layers, --seq-len, --batch" in capsys.readouterr().err
    stray = case / "stray"  # another spelling of rank 0, a leftover rank 2, a record naming another rank
    for i, (name, source) in enumerate((("router_trace_rank00.jsonl", 0), ("router_trace_rank2.jsonl", 1))):
        stray.mkdir(exist_ok=True)
        for r in range(2):
            (stray / f"router_trace_rank{r}.jsonl").write_text(
                (case / "trace" / f"router_trace_rank{r}.jsonl").read_text()
            )
        (stray / name).write_text((case / "trace" / f"router_trace_rank{source}.jsonl").read_text())
        assert _convert(stray, case / f"x{5 + i}", "ep2") == 2
        assert "not a trace of this job" in capsys.readouterr().err
        (stray / name).unlink()
    (stray / "router_trace_rank1.jsonl").write_text((case / "trace" / "router_trace_rank0.jsonl").read_text())
    assert _convert(stray, case / "x7", "ep2") == 2
    assert "the record says rank 0, the file name rank 1" in capsys.readouterr().err
    assert not any((case / f"x{i}").exists() for i in range(1, 8))


def test_convert_layout_writes_every_step_of_the_traces(sources):
    from moeverify import record

    case = sources / "deepseek_v3-pp2"
    two = case / "two_steps"
    two.mkdir()
    for r in range(2):
        lines = (case / "trace" / f"router_trace_rank{r}.jsonl").read_text().splitlines()
        again = [json.dumps({**json.loads(line), "step": 1}) for line in lines]
        (two / f"router_trace_rank{r}.jsonl").write_text("\n".join(lines + again) + "\n")
    assert _convert(two, case / "two_dump", "pp2") == 0
    dump = record.load(case / "two_dump")
    assert sorted(dump.steps) == [0, 1] and dump.routes(step=1) == dump.routes(step=0)
    assert dump.routes(step=0).microbatches == MICROBATCHES and dump.model.moe_layers == (1, 2, 3)


if __name__ == "__main__":
    main()
