"""PNG plots of a routing diff for ``dump diff --plot`` (matplotlib, Agg backend, imported only when a plot is
asked for)."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from moeverify.record.diff_report import DiffReport


def plot_diff(report: DiffReport, path: str | os.PathLike, *, buckets: int = 64) -> Path:
    """Two panels: layer x token-bucket disagreement heatmap, and per-layer expert-load bars (A vs B)."""
    import matplotlib  # lazy: matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt  # lazy: matplotlib

    fig, (ax_heat, ax_load) = plt.subplots(2, 1, figsize=(10, 8), constrained_layout=True)
    heat_LB = report.bucket_disagreement(buckets)
    image = ax_heat.imshow(
        heat_LB.numpy(),
        aspect="auto",
        cmap="magma",
        vmin=0.0,
        vmax=max(1e-9, float(heat_LB.max())),
        interpolation="nearest",
    )
    agreement = report.agreement_L.tolist()
    ax_heat.set_yticks(
        range(len(report.layers)), [f"{layer}  ({agreement[i]:.1%} agree)" for i, layer in enumerate(report.layers)]
    )
    first = report.first_divergent_layer()
    if first:  # the earliest layer where any token diverges: where to start looking
        row = report.layers.index(min(first))
        ax_heat.axhline(row, color="cyan", linewidth=1.5, linestyle="--")
        ax_heat.annotate(
            f"first divergence: layer {min(first)}", xy=(0, row), xytext=(2, row - 0.35), color="cyan", fontsize=9
        )
    ax_heat.set_xlabel(f"token bucket ({report.tokens} tokens in {heat_LB.shape[1]} buckets)")
    ax_heat.set_ylabel("MoE layer")
    ax_heat.set_title(
        f"fraction of tokens whose top-{report.topk} set differs "
        f"({report.tokens_diverging_any_layer:.2%} diverge in >= 1 layer; "
        f"{report.routers_differing_per_token:.3f} of {len(report.layers)} routers differ per token)"
    )
    fig.colorbar(image, ax=ax_heat)
    _load_bars(ax_load, report)
    path = Path(path)
    fig.savefig(path, dpi=100, format=path.suffix[1:].lower())  # exactly this path (none appends a .png)
    plt.close(fig)
    return path


def _load_bars(ax, report: DiffReport) -> None:
    """Expert load of A and B, all layers side by side (layer-major expert axis)."""
    load_a = report.load_a_LE.reshape(-1).float()
    load_b = report.load_b_LE.reshape(-1).float()
    x = torch.arange(load_a.numel()).numpy()
    ax.bar(x - 0.2, load_a.numpy(), width=0.4, label="A")
    ax.bar(x + 0.2, load_b.numpy(), width=0.4, label="B")
    experts = report.num_experts
    for i in range(1, len(report.layers)):
        ax.axvline(i * experts - 0.5, color="grey", linewidth=0.5)
    if experts * len(report.layers) <= 64:  # expert ids under the bars while they stay readable
        ax.set_xticks(x, [str(e % experts) for e in x], fontsize=6)
        ax.set_xlabel("expert id, layer by layer")
    else:
        step = max(1, experts // 8)
        ax.set_xticks(
            [i * experts + e for i in range(len(report.layers)) for e in range(0, experts, step)],
            [str(e) for _ in report.layers for e in range(0, experts, step)],
            fontsize=6,
        )
    for i, layer in enumerate(report.layers):
        ax.annotate(
            f"layer {layer}",
            xy=(i * experts + experts / 2 - 0.5, 1.0),
            xycoords=("data", "axes fraction"),
            ha="center",
            va="bottom",
            fontsize=8,
        )
    ax.set_ylabel("tokens routed")
    ax.set_title("expert load per layer (A vs B)", pad=16)
    ax.legend()
