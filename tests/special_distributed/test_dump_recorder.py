"""The standalone recorder on a real tiny Megatron MoE model, 2 CPU ranks (gloo): record a training step
(forward + backward, full recompute) and a forward-only step through Megatron's pipeline schedule,
merge the dump, and compare with what an independent router probe saw on every rank.

The test launches this file under torchrun; ``main()`` is the per-rank driver.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = int(os.environ.get("MOEVERIFY_TEST_TIMEOUT_S", "900"))
CASES = (("deepseek_v3", "pp2", {"pp": 2}), ("qwen3_moe", "ep2", {"ep": 2}))
SEQ_LEN, BATCH, MICROBATCHES = 8, 2, 2


def _probe_routes(result, layers, microbatches):
    """Local Routes from the probe's routing maps (nonzero columns, ascending expert id)."""
    from moeverify.routing.routes import Routes

    num_experts = next(iter(result.routing.values()))[0].shape[1] if result.routing else 1
    topk = int(next(iter(result.routing.values()))[0][0].sum()) if result.routing else 1
    per_layer = {
        layer: [result.routing[(layer, mb)][0].nonzero()[:, 1].view(-1, topk) for mb in range(microbatches)]
        for layer in layers
    }
    return Routes(per_layer, num_experts=num_experts, topk=topk)


def _run_case(out_dir: Path, family: str, name: str, layout_dict: dict, rt) -> dict:
    import torch
    from megatron.core import parallel_state as ps

    from moeverify import models, record, runtime
    from moeverify.oracles.replay import drive as rd
    from moeverify.patches.recorder import RouteRecorder, model_info
    from moeverify.record.writer import RankWriter
    from moeverify.routing import views
    from moeverify.routing.routes import Routes
    from moeverify.spec.layout import Layout

    layout = Layout(**layout_dict)
    path = out_dir / f"{family}-{name}"
    overrides = {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}
    with runtime.parallel(layout):
        built = models.build(family, layout, overrides=overrides)
        coords = views.rank_coords(layout, rank=rt.rank, world_size=rt.world_size)
        megatron_coords = (
            ps.get_tensor_model_parallel_rank(),
            ps.get_pipeline_model_parallel_rank(),
            ps.get_context_parallel_rank(),
            ps.get_data_parallel_rank(),
            ps.get_expert_model_parallel_rank(),
        )
        info = model_info(built.config)
        batches = rd.Batches(
            seq_len=SEQ_LEN,
            batch=BATCH,
            microbatches=MICROBATCHES,
            dp=layout.dp(rt.world_size),
            vocab_size=int(models.hf_config_dict(family)["vocab_size"]),
        )
        items = rd.local_microbatches(batches, layout, dp_rank=coords.dp, cp_rank=coords.cp)
        writer = RankWriter(path, model=info, coords=coords, layout=layout, world_size=rt.world_size)
        probes = {}
        with RouteRecorder(built.model_chunks, writer) as rec:
            for step, forward_only in ((0, False), (1, True)):
                rec.begin_step(step)
                probes[step] = rd.run_pass(built.model_chunks, items, seq_len=SEQ_LEN, forward_only=forward_only)
                writer.flush()
        writer.close()
        layers = views.layers_of(layout, pp_rank=coords.pp, num_layers=info.num_layers, moe_layers=info.moe_layers)
        local = {step: _probe_routes(p, layers, MICROBATCHES) for step, p in probes.items()}
        recompute_calls = sum(len(v) for v in probes[0].recompute.values())
        gathered = [None] * rt.world_size
        torch.distributed.all_gather_object(gathered, (coords, {s: _plain(r) for s, r in local.items()}))
        if rt.rank == 0:
            record.finalize(path, world_size=rt.world_size)
        torch.distributed.barrier()
        result = {
            "case": f"{family}/{name}",
            "rank": rt.rank,
            "coords_match": megatron_coords == (coords.tp, coords.pp, coords.cp, coords.dp, coords.ep),
            "recompute_calls": recompute_calls,
        }
        dump = record.load(path)
        result["local_equal"] = all(dump.local_routes(step=s, rank=rt.rank) == local[s] for s in local)
        if rt.rank == 0:
            for step in local:
                by_rank = {c: _unplain(r[step]) for c, r in gathered}
                reference = Routes.to_global(
                    by_rank,
                    layout,
                    world_size=rt.world_size,
                    seq_len=SEQ_LEN,
                    batch=BATCH,
                    num_layers=info.num_layers,
                    moe_layers=info.moe_layers,
                )
                merged = dump.routes(step=step)
                result[f"step{step}_global_equal"] = merged == reference
                result[f"step{step}_tokens"] = int(merged.get(merged.layers[0], 0).shape[0])
                result["layers"] = list(merged.layers)
        return result


def _plain(routes):
    return {
        "experts": routes.num_experts,
        "topk": routes.topk,
        "data": {layer: [routes.get(layer, mb) for mb in range(routes.microbatches)] for layer in routes.layers},
    }


def _unplain(obj):
    from moeverify.routing.routes import Routes

    return Routes(obj["data"], num_experts=obj["experts"], topk=obj["topk"])


def main() -> None:
    from moeverify import runtime

    out_dir = Path(sys.argv[1])
    rt = runtime.init("cpu")
    results = []
    try:
        for family, name, layout in CASES:
            results.append(_run_case(out_dir, family, name, layout, rt))
    finally:
        (out_dir / f"result-rank{rt.rank}.json").write_text(json.dumps(results, indent=1))
        import torch

        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def test_dump_recorder_real_model_two_ranks(tmp_path):
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        __file__,
        str(tmp_path),
    ]
    proc = subprocess.run(
        cmd, cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT_S, env={**os.environ, "PYTHONPATH": str(ROOT)}
    )
    outputs = {r: tmp_path / f"result-rank{r}.json" for r in range(2)}
    assert proc.returncode == 0 and all(p.exists() for p in outputs.values()), (
        f"torchrun exit {proc.returncode}:\n{proc.stderr[-6000:]}"
    )
    per_rank = {r: json.loads(p.read_text()) for r, p in outputs.items()}
    for rank, results in per_rank.items():
        assert [r["case"] for r in results] == [f"{f}/{n}" for f, n, _ in CASES], f"rank {rank}: {results}"
        for r in results:
            assert r["coords_match"], f"rank {rank} {r['case']}: views.rank_coords != megatron parallel_state"
            assert r["local_equal"], f"rank {rank} {r['case']}: dump's local routes != router probe"
            assert r["recompute_calls"] > 0, f"rank {rank} {r['case']}: recompute never ran, the test proves nothing"
    for r in per_rank[0]:
        assert r["step0_global_equal"] and r["step1_global_equal"], f"{r['case']}: merged dump != probe merge: {r}"
    deepseek, qwen = per_rank[0]
    assert deepseek["layers"] == [1, 2, 3] and deepseek["step0_tokens"] == BATCH * SEQ_LEN
    assert qwen["layers"] == [0, 1, 2, 3] and qwen["step0_tokens"] == 2 * BATCH * SEQ_LEN  # ep2 = dp2 here


if __name__ == "__main__":
    main()
