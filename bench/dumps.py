"""Routing dumps: size, write cost, training-step overhead and diff speed, against peers measured in the same run.

Workload: top-8 of 128 experts, 16 MoE layers, 2 micro-batches of 4096 tokens (131,072 token-layer rows).
- size: a dump directory (manifest, rank record, safetensors with uint8 ids) vs ``torch.save`` of the
  same tensors as int64, and vs megatron-core's ``RouterTracer`` JSONL (the real tracer when
  megatron-core imports, else the same records written with ``json.dumps`` as the tracer does);
- write throughput: ``RankWriter`` (background thread, validated, atomic) vs ``torch.save`` of int64;
- step overhead: a synthetic MoE-shaped training step (per layer: matmul, router, top-k, backward)
  with and without handing each layer's routes to a background ``RankWriter`` the way ``RouteRecorder``
  does (ids already known distinct and in range); steps alternate, medians compared;
- diff: token-layer rows/s on one core (``torch.set_num_threads(1)``) with 1 % of rows differing,
  vs a straightforward ``torch.sort`` set comparison; also 0 % and 100 % reordered rows (informational).

Writes ``bench/results/dumps.json`` (``{"metrics": {NAME: {"value", "unit", "peer", "ratio", "goal"}}}``;
``ratio`` is oriented so that larger is better except for ``step_overhead``, whose goal is ``<=``; the
diff throughput goal applies to ``value`` and says so in ``goal_on``).

    python bench/dumps.py [--tokens 4096] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from moeverify import record  # noqa: E402
from moeverify.record import format as fmt  # noqa: E402
from moeverify.record.writer import RankWriter  # noqa: E402
from moeverify.routes import Routes  # noqa: E402

RESULTS = ROOT / "bench" / "results" / "dumps.json"
EXPERTS, TOPK, LAYERS, MICROBATCHES = 128, 8, 16, 2


def _routes(tokens: int, *, seed: int = 0) -> Routes:
    gen = torch.Generator().manual_seed(seed)
    return Routes({layer: [torch.rand(tokens, EXPERTS, generator=gen).topk(TOPK, dim=1).indices
                           for _ in range(MICROBATCHES)] for layer in range(LAYERS)}, num_experts=EXPERTS, topk=TOPK)


def _dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.iterdir() if p.is_file())


def _jsonl_bytes(routes: Routes, path: Path) -> tuple[int, str]:
    """Bytes of megatron-core's router trace for ``routes`` (one record per layer and micro-batch)."""
    try:
        from megatron.core.transformer.moe.router_trace import RouterTracer

        tracer = RouterTracer(str(path), max_steps=1, rank=0, training_mode=True)
        for mb in range(routes.microbatches):
            tracer.record_indices([routes.get(layer, mb) for layer in routes.layers], layer_ids=list(routes.layers))
        tracer.advance_step()
        tracer.flush()
        return (path / "router_trace_rank0.jsonl").stat().st_size, "megatron-core RouterTracer"
    except ImportError:
        lines = []
        for mb in range(routes.microbatches):
            for layer in routes.layers:
                ids = routes.get(layer, mb)
                lines.append(json.dumps({"step": 0, "stage": "pre_dispatch", "block": "decoder", "layer": layer,
                                         "rank": 0, "num_tokens": ids.shape[0], "topk": ids.shape[1],
                                         "top_indices": ids.tolist()}) + "\n")
        return len("".join(lines).encode()), "RouterTracer record format (json.dumps)"


def measure_size(routes: Routes, rows: int, tmp: Path) -> dict:
    record.save(tmp / "dump", routes)
    dump_b = _dir_bytes(tmp / "dump")
    tensors = {fmt.tensor_name(step=0, mb=mb, layer=layer, kind="ids"): routes.get(layer, mb).to(torch.int64)
               for layer in routes.layers for mb in range(routes.microbatches)}
    torch.save(tensors, tmp / "ids.pt")
    pt_b = (tmp / "ids.pt").stat().st_size
    jsonl_b, jsonl_how = _jsonl_bytes(routes, tmp / "trace")
    per = lambda b: round(b / rows, 3)
    return {
        "bytes_vs_torch_save_int64": {"value": per(dump_b), "unit": "bytes/token-layer", "peer": per(pt_b),
                                      "ratio": round(pt_b / dump_b, 2), "goal": ">=8"},
        "bytes_vs_router_trace_jsonl": {"value": per(dump_b), "unit": "bytes/token-layer", "peer": per(jsonl_b),
                                        "ratio": round(jsonl_b / dump_b, 2), "goal": ">=4", "peer_is": jsonl_how},
    }


def _best(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def measure_write(routes: Routes, rows: int, tmp: Path, repeats: int) -> dict:
    model = fmt.ModelInfo(num_layers=LAYERS, moe_layers=tuple(routes.layers), num_experts=EXPERTS, topk=TOPK)
    count = iter(range(10**6))

    def ours():
        with RankWriter(tmp / f"w{next(count)}", model=model) as writer:
            writer.add_routes(routes, step=0)

    tensors = {f"{layer}/{mb}": routes.get(layer, mb).to(torch.int64) for layer in routes.layers
               for mb in range(routes.microbatches)}
    ours_s = _best(ours, repeats)
    peer_s = _best(lambda: torch.save(tensors, tmp / "peer.pt"), repeats)
    return {"write_throughput": {"value": round(rows / ours_s), "unit": "token-layer rows/s",
                                 "peer": round(rows / peer_s), "ratio": round(peer_s / ours_s, 2), "goal": None}}


def _step(weights, router_w, x, writer, step):
    h = x
    for layer, (w, r) in enumerate(zip(weights, router_w)):
        h = torch.tanh(h @ w)
        ids = (h.detach() @ r).topk(TOPK, dim=1).indices
        if writer is not None:
            writer.add(step=step, mb=0, layer=layer, ids_TK=ids, validated=True)  # as RouteRecorder does
    h.square().mean().backward()


def measure_step_overhead(tokens: int, tmp: Path, repeats: int) -> dict:
    gen = torch.Generator().manual_seed(0)
    hidden = 512
    weights = [(torch.randn(hidden, hidden, generator=gen) / hidden**0.5).requires_grad_() for _ in range(LAYERS)]
    router_w = [torch.randn(hidden, EXPERTS, generator=gen) for _ in range(LAYERS)]
    x = torch.randn(tokens, hidden, generator=gen)
    model = fmt.ModelInfo(num_layers=LAYERS, moe_layers=tuple(range(LAYERS)), num_experts=EXPERTS, topk=TOPK)
    base, rec = [], []
    writer = RankWriter(tmp / "steps", model=model, queue_size=4 * LAYERS)
    for step in range(2 * repeats + 2):
        use = step % 2 == 1
        t0 = time.perf_counter()
        _step(weights, router_w, x, writer if use else None, step)
        (rec if use else base).append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    writer.close()
    drain = time.perf_counter() - t0
    base_s, rec_s = statistics.median(base[1:]), statistics.median(rec[1:])
    return {"step_overhead": {"value": round(rec_s, 4), "unit": "s/step", "peer": round(base_s, 4),
                              "ratio": round(rec_s / base_s, 3), "goal": "<=1.05",
                              "note": f"{tokens} tokens x {LAYERS} layers per step; close() drained in {drain:.3f} s"}}


def _naive_diff(a: Routes, b: Routes) -> None:
    for layer in a.layers:
        for mb in range(a.microbatches):
            sa, sb = a.get(layer, mb).sort(dim=1).values, b.get(layer, mb).sort(dim=1).values
            (sa == sb).all(dim=1)
            torch.isin(a.get(layer, mb), b.get(layer, mb))  # not row-wise; a lower bound on the peer's cost


def _perturbed(a: Routes, *, fraction: float, reorder: bool) -> Routes:
    data = {}
    for layer in a.layers:
        data[layer] = []
        for mb in range(a.microbatches):
            ids = a.get(layer, mb).clone()
            n = int(ids.shape[0] * fraction)
            if reorder:
                ids[:n] = ids[:n].flip(1)
            else:  # replace one expert with the smallest one not chosen
                taken = torch.zeros(n, EXPERTS, dtype=torch.bool).scatter_(1, ids[:n].long(), True)
                ids[:n, -1] = (~taken).to(torch.uint8).argmax(dim=1).to(ids.dtype)
            data[layer].append(ids)
    return Routes(data, num_experts=EXPERTS, topk=TOPK)


def measure_diff(tokens: int, repeats: int) -> dict:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        a = _routes(tokens * 4, seed=1)
        a = Routes({l: [a.get(l, m).to(torch.uint8) for m in range(MICROBATCHES)] for l in a.layers},
                   num_experts=EXPERTS, topk=TOPK)
        rows = tokens * 4 * LAYERS * MICROBATCHES
        out = {}
        b = _perturbed(a, fraction=0.01, reorder=False)
        ours = _best(lambda: record.diff(a, b), repeats)
        peer = _best(lambda: _naive_diff(a, b), max(1, repeats // 2))
        check = record.diff(a, b).to_json()
        out["diff_throughput"] = {"value": round(rows / ours), "unit": "token-layer rows/s (1 core)",
                                  "peer": round(rows / peer), "ratio": round(peer / ours, 2), "goal": ">=50000000",
                                  "goal_on": "value",
                                  "note": f"1% of rows differ; agreement {check['layers']['0']['agreement']:.4f}"}
        for name, frac, reorder in (("diff_throughput_identical", 0.0, False),
                                    ("diff_throughput_all_reordered", 1.0, True),
                                    ("diff_throughput_10pct_differ", 0.1, False)):
            b = _perturbed(a, fraction=frac, reorder=reorder)
            ours = _best(lambda: record.diff(a, b), repeats)
            out[name] = {"value": round(rows / ours), "unit": "token-layer rows/s (1 core)", "peer": None,
                         "ratio": None, "goal": None}
        return out
    finally:
        torch.set_num_threads(threads)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=4096, help="tokens per micro-batch (default 4096)")
    p.add_argument("--repeats", type=int, default=5, help="timing repeats; the best (or median for steps) is kept")
    p.add_argument("--out", type=Path, default=RESULTS, help="results JSON path")
    args = p.parse_args(argv)
    routes = _routes(args.tokens)
    rows = args.tokens * LAYERS * MICROBATCHES
    metrics = {}
    metrics.update(measure_diff(args.tokens, args.repeats))  # first: before any multi-threaded work
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        metrics.update(measure_size(routes, rows, tmp))
        metrics.update(measure_write(routes, rows, tmp, args.repeats))
        metrics.update(measure_step_overhead(args.tokens, tmp, 2 * args.repeats))
    result = {"metrics": metrics, "workload": {"tokens_per_microbatch": args.tokens, "microbatches": MICROBATCHES,
                                               "moe_layers": LAYERS, "experts": EXPERTS, "topk": TOPK,
                                               "torch_threads": torch.get_num_threads()},
              "host": {"cpus": os.cpu_count(), "torch": torch.__version__, "python": platform.python_version(),
                       "load_average_1m": round(os.getloadavg()[0], 2)}}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    _print(metrics)
    return 0


def _print(metrics: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="routing dumps")
    for col in ("metric", "value", "unit", "peer", "ratio", "goal"):
        table.add_column(col, justify="right" if col not in ("metric", "unit") else "left")
    for name, m in metrics.items():
        table.add_row(name, f"{m['value']:,}", m["unit"], "-" if m["peer"] is None else f"{m['peer']:,}",
                      "-" if m["ratio"] is None else str(m["ratio"]), m["goal"] or "-")
    Console().print(table)


if __name__ == "__main__":
    raise SystemExit(main())
