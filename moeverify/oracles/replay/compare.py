"""Comparison helpers of the replay oracles, on plain tensors (no Megatron import).

Legend of shape suffixes: T = tokens (a router's own order), E = experts, K = top-k.
``routing_map_TE`` is a router's boolean token -> expert assignment, ``probs_TE`` the dense
routing probabilities (zero where not routed), ``topk_ids_TK`` the selected expert ids.

Bitwise means equal raw bits in the tensor's own dtype (``moeverify.oracles.bits``), never "close".
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from moeverify.oracles.bits import bitwise_equal, differ
from moeverify.oracles.replay.grad_print import GradPrint


def describe_mismatch(a: torch.Tensor, b: torch.Tensor) -> str:
    """A short reason why two tensors are not bitwise equal (shape, dtype, or first differing element)."""
    if a.shape != b.shape:
        return f"shape {tuple(a.shape)} != {tuple(b.shape)}"
    if a.dtype != b.dtype:
        return f"dtype {a.dtype} != {b.dtype}"
    if a.numel() == 0:
        return "equal (empty)"
    differ_N = differ(a, b)
    count = int(differ_N.sum())
    if not count:
        return "equal"
    i = int(differ_N.nonzero()[0])
    x, y = a.reshape(-1)[i].item(), b.reshape(-1)[i].item()
    extra = ""
    if a.is_floating_point():
        extra = f", max |diff| {float((a.double() - b.double()).abs().max()):.3e}"
    return f"{count} of {a.numel()} element(s) differ; first at flat index {i}: {x!r} != {y!r}{extra}"


def compare_maps(expected: Mapping, got: Mapping, *, what: str) -> tuple[int, list[str]]:
    """Bitwise comparison of two ``{key: tensor}`` maps.

    Returns ``(checked, failures)``: one item per key of the union; a key missing on either side is a
    failure naming it.
    """
    failures = []
    keys = sorted(set(expected) | set(got), key=str)
    for key in keys:
        if key not in got:
            failures.append(f"{what} {key}: missing in the run under test")
        elif key not in expected:
            failures.append(f"{what} {key}: present only in the run under test")
        elif isinstance(expected[key], GradPrint) or isinstance(got[key], GradPrint):
            digest = next(v.digest for v in (expected[key], got[key]) if isinstance(v, GradPrint))
            a, b = (
                v if isinstance(v, GradPrint) else GradPrint.of(v, digest=digest) for v in (expected[key], got[key])
            )
            if not a.same(b):
                failures.append(f"{what} {key}: {a.describe(b)}")
        elif not bitwise_equal(expected[key], got[key]):
            failures.append(f"{what} {key}: {describe_mismatch(expected[key], got[key])}")
    return len(keys), failures


def topk_ids_from_map(routing_map_TE: torch.Tensor) -> torch.Tensor:
    """``[T, K]`` expert ids (ascending) from a boolean routing map with exactly K trues per row."""
    if routing_map_TE.dim() != 2 or routing_map_TE.dtype != torch.bool:
        raise ValueError(
            f"routing map must be a 2-D bool tensor, got {routing_map_TE.dtype} {tuple(routing_map_TE.shape)}"
        )
    counts_T = routing_map_TE.sum(dim=1)
    if counts_T.numel() and int(counts_T.min()) != int(counts_T.max()):
        raise ValueError(
            f"routing map rows select between {int(counts_T.min())} and {int(counts_T.max())} "
            "experts; expected the same K for every token"
        )
    k = int(counts_T[0]) if counts_T.numel() else 0
    experts_E = torch.arange(routing_map_TE.shape[1], device=routing_map_TE.device).expand_as(routing_map_TE)
    return experts_E[routing_map_TE].reshape(-1, k)


def map_from_topk_ids(topk_ids_TK: torch.Tensor, *, num_experts: int) -> torch.Tensor:
    """Boolean ``[T, E]`` routing map of ``[T, K]`` expert ids (order within a row does not matter)."""
    out_TE = torch.zeros(topk_ids_TK.shape[0], num_experts, dtype=torch.bool, device=topk_ids_TK.device)
    out_TE.scatter_(1, topk_ids_TK.to(torch.int64), True)
    return out_TE


def same_experts(a_TK: torch.Tensor, b_TK: torch.Tensor) -> torch.Tensor:
    """``[T]`` bool: token routed to the same expert set in both (order within a row ignored)."""
    if a_TK.shape != b_TK.shape:
        raise ValueError(f"route shapes differ: {tuple(a_TK.shape)} vs {tuple(b_TK.shape)}")
    return (a_TK.to(torch.int64).sort(dim=1).values == b_TK.to(torch.int64).sort(dim=1).values).all(dim=1)


def agreement(a_TK: torch.Tensor, b_TK: torch.Tensor) -> float:
    """Fraction of tokens whose top-k expert set is identical (the R3 per-layer agreement metric)."""
    same_T = same_experts(a_TK, b_TK)
    return float(same_T.float().mean()) if same_T.numel() else 1.0


def close_within(expected: float, got: float, *, rtol: float, atol: float) -> bool:
    """``|got - expected| <= atol + rtol * |expected|`` (and both finite)."""
    if not (torch.isfinite(torch.tensor(expected)) and torch.isfinite(torch.tensor(got))):
        return False
    return abs(got - expected) <= atol + rtol * abs(expected)
