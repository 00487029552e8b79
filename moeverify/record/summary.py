"""``inspect``: what a dump holds (shape, layout, steps) and how balanced its expert load is."""

from __future__ import annotations

import torch

from moeverify.record.reader import Dump


def summarize(dump: Dump, *, step: int | None = None) -> dict:
    """A JSON-able summary; load balance is for ``step`` (default: the first step)."""
    steps = {}
    for s, info in sorted(dump.steps.items()):
        steps[str(s)] = {
            "microbatches": info.microbatches,
            "batch": info.batch,
            "seq_len": None if info.seq_len is None else list(info.seq_len),
        }
    out = {
        "path": str(dump.path),
        "schema": dump.manifest["schema"],
        "version": dump.manifest["version"],
        "model": dump.model.as_dict(),
        "layout": dump.layout.name(dump.world_size),
        "world_size": dump.world_size,
        "ids_dtype": dump.manifest["ids_dtype"],
        "probs": dump.has_probs,
        "token_identity": "fingerprints" if dump.has_fingerprints else "unknown",
        "steps": steps,
        "versions": dump.manifest.get("versions", {}),
        "load": {},
    }
    if not dump.steps:
        return out
    step = min(dump.steps) if step is None else step
    routes = dump.routes(step=step)
    out["load_step"] = step
    out["tokens"] = (
        sum(routes.get(routes.layers[0], mb).shape[0] for mb in range(routes.microbatches)) if routes.layers else 0
    )
    for layer in routes.layers:
        load_E = torch.zeros(routes.num_experts, dtype=torch.int64)
        for mb in range(routes.microbatches):
            load_E += torch.bincount(routes.get(layer, mb).reshape(-1).to(torch.int64), minlength=routes.num_experts)
        mean = load_E.double().mean()
        out["load"][str(layer)] = {
            "min": int(load_E.min()),
            "max": int(load_E.max()),
            "max_over_mean": float(load_E.max() / mean) if mean > 0 else 0.0,
            "cv": float(load_E.double().std(unbiased=False) / mean) if mean > 0 else 0.0,
            "idle_experts": int((load_E == 0).sum()),
        }
    return out


def summary_table(summary: dict):
    """``rich`` renderables: a header line and the per-layer load table."""
    from rich.table import Table  # lazy: rich
    from rich.text import Text  # lazy: rich

    model = summary["model"]
    steps = summary["steps"]
    title = Text(
        f"{summary['path']}: {model['num_layers']} layers, MoE {model['moe_layers']}, "
        f"top-{model['topk']} of {model['num_experts']} ({summary['ids_dtype']}), layout {summary['layout']} "
        f"on {summary['world_size']} rank(s), {len(steps)} step(s) {list(steps)}, "
        f"micro-batches {[v['microbatches'] for v in steps.values()]}, probs {summary['probs']}, token identity "
        + ("per-sequence fingerprints" if summary["token_identity"] == "fingerprints" else "unknown")
    )
    table = Table(title=f"expert load, step {summary.get('load_step', '-')}, {summary.get('tokens', 0)} tokens")
    for col in ("layer", "min", "max", "max/mean", "cv", "idle experts"):
        table.add_column(col, justify="right")
    for layer, row in summary["load"].items():
        table.add_row(
            Text(str(layer)),
            str(row["min"]),
            str(row["max"]),
            f"{row['max_over_mean']:.3f}",
            f"{row['cv']:.3f}",
            str(row["idle_experts"]),
        )
    return title, table
