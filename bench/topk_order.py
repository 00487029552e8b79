"""Check and time the GPU slot order of replay: ``replay_state.topk_order`` against Megatron's own grad-mode top-k.

``topk_order`` orders a replayed set by one ``torch.topk`` of its ``[T, K]`` keys laid out in ascending id order.
Where native routing picked that set, this must be native's grad-mode order bitwise, ties included (the replayed
training pass then sums probabilities and gradients as native does). Checked here on tie-heavy scores (a few
distinct values a row), bf16-rounded softmax scores and sigmoid scores with a fine expert bias, for plain and
group-limited top-k (Megatron-Core's ``group_limited_topk``), fp32 and bf16 keys, many expert counts and top-k.

Also times, per call at ``--tokens`` x ``--experts`` top-``--topk``: the old order (argsort of the keys, native
top-k, its sort and compare), the new ``topk_order``, native replay's single gather, and a native top-k.

Usage (GPU): python bench/topk_order.py [--out bench/results/topk_order_<card>.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def _native(scores, topk, num_groups, group_topk):
    import torch
    from megatron.core.transformer.moe.moe_utils import group_limited_topk

    with torch.enable_grad():
        if group_topk:
            return group_limited_topk(
                scores=scores,
                topk=topk,
                num_tokens=scores.shape[0],
                num_experts=scores.shape[1],
                num_groups=num_groups,
                group_topk=group_topk,
            )
        return torch.topk(scores, k=topk, dim=1, sorted=torch.is_grad_enabled())


def _scores(kind, tokens, experts, dtype, g):
    import torch

    if kind == "ties":
        raw = torch.randint(0, 5, (tokens, experts), generator=g, device="cuda").to(torch.float32) * 0.25
    elif kind == "bf16_softmax":
        raw = torch.randn(tokens, experts, generator=g, device="cuda").to(torch.bfloat16).float().softmax(dim=1)
    else:  # sigmoid + a fine expert bias, bf16 logits (DeepSeek-V3 style)
        logits = torch.randn(tokens, experts, generator=g, device="cuda").to(torch.bfloat16).float()
        raw = logits.sigmoid() + torch.randn(experts, generator=g, device="cuda") * 1e-3
    return raw.to(dtype)


def check() -> dict:
    import torch

    from moeverify.patches.replay_state import canonical_slots, topk_order

    g = torch.Generator(device="cuda").manual_seed(0)
    cases, bad = 0, []
    tied_rows = differs_from_id_order = 0
    for experts in (8, 16, 64, 128, 160, 256, 384, 512):
        for topk in (1, 2, 3, 4, 6, 8, 10, 16):
            if topk > experts // 2:
                continue
            for groups in (None, (8, 4)):
                if groups and (experts % 8 or topk < 4 or topk > 4 * experts // 8):
                    continue
                for tokens in (1000, 16384):
                    for dtype in (torch.float32, torch.bfloat16):
                        for kind in ("ties", "bf16_softmax", "sigmoid_bias"):
                            scores = _scores(kind, tokens, experts, dtype, g)
                            with torch.no_grad():
                                _, native_TK = _native(scores, topk, *(groups or (None, None)))
                                sorted_TK = native_TK.sort(dim=1).values
                                ours_TK = topk_order(scores, sorted_TK)
                                key_TK = scores.gather(1, sorted_TK)
                                by_id_TK = sorted_TK.gather(1, canonical_slots(key_TK))
                            cases += 1
                            wrong = int((ours_TK != native_TK).any(dim=1).sum())
                            ranked = key_TK.sort(dim=1).values
                            tied = (ranked[:, 1:] == ranked[:, :-1]).any(dim=1)
                            tied_rows += int(tied.sum())
                            differs_from_id_order += int((by_id_TK != native_TK).any(dim=1).sum())
                            if wrong:
                                bad.append(
                                    {
                                        "experts": experts,
                                        "topk": topk,
                                        "groups": groups,
                                        "tokens": tokens,
                                        "dtype": str(dtype),
                                        "kind": kind,
                                        "rows_wrong": wrong,
                                    }
                                )
    return {
        "cases": cases,
        "cases_wrong": bad,
        "tied_rows": tied_rows,
        "rows_where_native_is_not_ties_by_id": differs_from_id_order,
    }


def timing(tokens: int, experts: int, topk: int, iters: int = 200) -> dict:
    import torch

    from moeverify.patches import replay_state

    g = torch.Generator(device="cuda").manual_seed(1)
    scores = torch.randn(tokens, experts, generator=g, device="cuda").softmax(dim=1)
    ids_TK = torch.rand(tokens, experts, generator=g, device="cuda").argsort(dim=1)[:, :topk]
    sorted_TK = ids_TK.sort(dim=1).values

    def native_topk(s, k, num_groups=None, group_topk=None):
        return torch.topk(s, k=k, dim=1, sorted=torch.is_grad_enabled())

    def old():
        key_TK = scores.gather(1, sorted_TK)
        order_TK = replay_state.canonical_slots(key_TK)
        ids = sorted_TK.gather(1, order_TK)
        _, native_TK = replay_state.grad_mode_topk(native_topk, scores, topk)
        same_T = (native_TK.sort(dim=1).values == sorted_TK).all(dim=1)
        return torch.where(same_T[:, None], native_TK, ids)

    variants = {
        "old_order": old,
        "topk_order": lambda: replay_state.topk_order(scores, sorted_TK),
        "native_replay_gather": lambda: scores.gather(1, ids_TK),
        "native_topk": lambda: torch.topk(scores, k=topk, dim=1, sorted=True),
    }
    out = {}
    for name, fn in variants.items():
        for _ in range(10):
            fn()
        torch.cuda.synchronize()
        best_host = best_dev = float("inf")
        for _ in range(5):
            start_ev, end_ev = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            t0 = time.perf_counter()
            start_ev.record()
            for _ in range(iters):
                fn()
            end_ev.record()
            host = (time.perf_counter() - t0) / iters * 1e6
            torch.cuda.synchronize()
            best_host = min(best_host, host)
            best_dev = min(best_dev, start_ev.elapsed_time(end_ev) / iters * 1e3)
        out[name] = {"host_us_per_call": round(best_host, 2), "device_us_per_call": round(best_dev, 2)}
    return out


def main(argv=None) -> int:
    import torch as _torch

    if not _torch.cuda.is_available():  # ``make bench`` runs every script: this one measures a GPU
        print(f"{Path(__file__).name}: no CUDA device here; skipped (a GPU benchmark)")
        return 0
    import router_replay as bench

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    result = {
        "gpu": bench.gpu_info(),
        "check": check(),
        "timing": {"shape": [args.tokens, args.experts, args.topk], **timing(args.tokens, args.experts, args.topk)},
    }
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 1 if result["check"]["cases_wrong"] else 0


if __name__ == "__main__":
    sys.exit(main())
