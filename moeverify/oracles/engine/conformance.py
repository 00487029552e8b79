"""A rollout engine's captured routes against the trainer's native routing of the same tokens and weights.

``native_routes(chunk, tokens)`` runs one sequence through a Megatron model (one rank, no replay bound) and notes,
per MoE layer and token, the experts its router picks and the score gap that decided the last pick (the k-th best
score minus the (k+1)-th: how near the choice was to a tie). ``compare(decoded, native, ...)`` holds a decoded engine
payload (``EngineRoutes``: rows from its start offset on, decoder-layer columns) against it, per layer and position:
every MoE column must hold the trainer's expert set; a dense column must be left unwritten (0). Where the two differ,
the gap says whether kernels' rounding could explain it (``near_tie``: the gap below ``TIE`` of the score scale) or
not. ``Cell`` is one such comparison's counts, and names the first rows that differ.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from moeverify.errors import SHOW
from moeverify.routing.engine_routes import EngineRoutes

TIE = 1e-4  # a score gap below this (fp32 logits of order 1) is a near tie: kernel rounding may flip the pick


@dataclasses.dataclass
class Native:
    """One sequence's native routing: ``ids`` ``[S, L, K]`` sorted expert ids and ``gaps`` ``[S, L]`` per MoE
    layer (``layers``, global decoder layer numbers from 0)."""

    ids: np.ndarray
    gaps: np.ndarray
    layers: list[int]


def _routers(chunk) -> list:
    routers = [m for m in chunk.modules() if type(m).__name__ == "TopKRouter"]
    if not routers:
        raise ValueError("the model has no TopKRouter: nothing routes")
    return routers


def _score(router, logits: torch.Tensor) -> torch.Tensor:
    """The score the router's top-k ranks (megatron-core 0.19 ``topk_routing_with_score_function``): the logits'
    order for softmax, sigmoid plus the expert bias where there is one (group limits left out: the gap is a report)."""
    scores = logits.float() if router.score_function == "softmax" else torch.sigmoid(logits.float())
    if getattr(router, "expert_bias", None) is not None:
        scores = scores + router.expert_bias.float()
    return scores


@torch.no_grad()
def native_routes(chunk, tokens: list[int]) -> Native:
    """Route ``tokens`` (one sequence, every position) natively through ``chunk`` (one rank, whole model)."""
    routers = _routers(chunk)
    got: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def hook(router, inputs, outputs):
        hidden = inputs[0]
        logits = router.gating(hidden).reshape(-1, router.config.num_moe_experts)
        scores = _score(router, logits).sort(dim=-1, descending=True).values
        k = router.topk
        gaps = scores[:, k - 1] - scores[:, k]
        ids = outputs[1].reshape(-1, router.config.num_moe_experts).int().topk(k).indices.sort().values
        got[router.layer_number - 1] = (ids.cpu(), gaps.cpu())

    handles = [r.register_forward_hook(hook) for r in routers]
    try:
        device = next(chunk.parameters()).device
        ids = torch.tensor([tokens], dtype=torch.long, device=device)
        pos = torch.arange(len(tokens), device=device)[None]
        was = chunk.training
        chunk.eval()
        try:
            chunk(ids, pos, None)
        finally:
            chunk.train(was)
    finally:
        for h in handles:
            h.remove()
    layers = sorted(got)
    return Native(
        ids=torch.stack([got[layer][0] for layer in layers], dim=1).numpy().astype(np.int64),
        gaps=torch.stack([got[layer][1] for layer in layers], dim=1).numpy(),
        layers=layers,
    )


@dataclasses.dataclass
class Cell:
    """Counts of one comparison: (position, layer) routes checked, equal, differing on a near tie, differing
    otherwise; dense columns checked and written; the first differences, described."""

    checked: int = 0
    equal: int = 0
    near_tie: int = 0
    wrong: int = 0
    dense_checked: int = 0
    dense_written: int = 0
    first: list[str] = dataclasses.field(default_factory=list)

    def add(self, other: Cell) -> Cell:
        for f in dataclasses.fields(self):
            value = getattr(other, f.name)
            setattr(self, f.name, getattr(self, f.name) + (value if f.name != "first" else value[:SHOW]))
        self.first = self.first[:SHOW]
        return self

    @property
    def ok(self) -> bool:
        """Every route checked is the trainer's or a near tie, no dense column written, and something checked."""
        return self.checked > 0 and self.wrong == 0 and self.dense_written == 0

    def summary(self) -> str:
        return (
            f"{self.checked} routes checked: {self.equal} equal, {self.near_tie} near ties, {self.wrong} wrong; "
            f"{self.dense_checked} dense cells, {self.dense_written} written"
            + (f"; first: {'; '.join(self.first)}" if self.first else "")
        )


def compare(decoded: EngineRoutes, native: Native, *, num_layers: int, what: str = "") -> Cell:
    """``decoded`` (decoder-layer columns, or MoE columns for ``"routers"`` numbering; rows from ``decoded.start``)
    against ``native`` of the same tokens."""
    rows = decoded.routes
    if decoded.numbering == "routers":  # one column per MoE layer, in layer order
        if rows.shape[1] != len(native.layers):
            raise ValueError(f"{what}: {rows.shape[1]} MoE columns, the model has {len(native.layers)} MoE layers")
        columns = {layer: i for i, layer in enumerate(native.layers)}
    else:
        if rows.shape[1] != num_layers:
            raise ValueError(f"{what}: {rows.shape[1]} layer columns, the model has {num_layers} layers")
        columns = {layer: layer for layer in range(num_layers)}
    cell = Cell()
    column = {layer: i for i, layer in enumerate(native.layers)}
    for r in range(rows.shape[0]):
        pos = decoded.start + r
        for layer, c in columns.items():
            got = np.sort(rows[r, c].astype(np.int64))
            if layer not in column:
                cell.dense_checked += 1
                if got.any():
                    cell.dense_written += 1
                    _note(cell, f"{what} position {pos} dense layer {layer}: written {got.tolist()}")
                continue
            want = native.ids[pos, column[layer]]
            cell.checked += 1
            if np.array_equal(got, want):
                cell.equal += 1
                continue
            gap = float(native.gaps[pos, column[layer]])
            if gap < TIE:
                cell.near_tie += 1
            else:
                cell.wrong += 1
                _note(
                    cell,
                    f"{what} position {pos} layer {layer}: engine {got.tolist()}, trainer {want.tolist()} "
                    f"(score gap {gap:.3g})",
                )
    return cell


def _note(cell: Cell, text: str) -> None:
    if len(cell.first) < SHOW:
        cell.first.append(text)


def _hf_linear(hf: dict, name: str):
    """The HF weight behind an engine's linear layer (vLLM's fused names: ``qkv_proj`` = q, k, v stacked)."""
    if name.endswith("qkv_proj"):
        base = name[: -len("qkv_proj")]
        return torch.cat([hf[f"{base}{p}_proj.weight"] for p in "qkv"])
    if name.endswith("gate_up_proj"):
        base = name[: -len("gate_up_proj")]
        return torch.cat([hf[f"{base}gate_proj.weight"], hf[f"{base}up_proj.weight"]])
    return hf[f"{name}.weight"]


def held_vs_hf(held: dict, hf: dict, *, num_layers: int, num_experts: int) -> int:
    """Every tensor an engine (vLLM 0.32, Qwen3-MoE names) keeps readable against the HF tensors it was given,
    bitwise: experts' ``w13_weight`` ``[E, 2I, H]`` (gate then up) and ``w2_weight`` ``[E, H, I]``, norms,
    embeddings, head. Returns the count checked; raises ``AssertionError`` naming the first that differs."""
    checked = 0
    for name, got in sorted(held.items()):
        if name.endswith(".w13_weight") or name.endswith(".w2_weight"):
            layer = name.split(".mlp.")[0]
            parts = ("gate_proj", "up_proj") if name.endswith("w13_weight") else ("down_proj",)
            want = torch.stack(
                [torch.cat([hf[f"{layer}.mlp.experts.{e}.{p}.weight"] for p in parts]) for e in range(num_experts)]
            )
        elif name in hf:
            want = hf[name]
        else:
            continue  # engine-only buffers (rotary caches, attention scales)
        if got.dtype != want.dtype or got.shape != want.shape or not torch.equal(got, want):
            raise AssertionError(f"engine tensor {name}: {got.dtype} {tuple(got.shape)} differs from the HF tensors")
        checked += 1
    return checked


def probed_vs_hf(probes: dict, hf: dict) -> dict:
    """Packed linear layers' outputs on seeded inputs (``<module>.x``/``.y``) against ``x @ W.T`` of the HF
    weights, and each MoE layer's expert kernel (``<layer>.experts.x/ids/w/y``) against the experts computed here
    from the HF ``gate_proj``/``up_proj``/``down_proj`` (SiLU-gated, weighted sum over the picked experts): the
    largest absolute difference of each kind (kernels differ in summation order, not in weights)."""
    linears = sorted(k[:-2] for k in probes if k.endswith(".x") and ".experts." not in k)
    worst = {"linear": 0.0, "experts": 0.0}
    for name in linears:
        x, y = probes[f"{name}.x"], probes[f"{name}.y"]
        worst["linear"] = max(worst["linear"], float((y - x @ _hf_linear(hf, name).T).abs().max()))
    layers = sorted(k[: -len(".experts.x")] for k in probes if k.endswith(".experts.x"))
    for layer in layers:
        x, ids, w, y = (probes[f"{layer}.experts.{k}"] for k in ("x", "ids", "w", "y"))
        prefix = layer.split(".mlp.")[0] + ".mlp"  # vLLM's experts module sits under the layer's mlp
        want = torch.zeros_like(y)
        for t in range(x.shape[0]):
            for k in range(ids.shape[1]):
                e = int(ids[t, k])
                gate, up, down = (hf[f"{prefix}.experts.{e}.{p}_proj.weight"] for p in ("gate", "up", "down"))
                want[t] += w[t, k] * (down @ (torch.nn.functional.silu(gate @ x[t]) * (up @ x[t])))
        worst["experts"] = max(worst["experts"], float((y - want).abs().max()))
    return {"linears": len(linears), "expert_layers": len(layers), **{f"max_abs_{k}": v for k, v in worst.items()}}
