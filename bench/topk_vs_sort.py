"""Whether a stable descending sort of a set's ``[T, K]`` keys at its ascending ids gives the slot order the CUDA
top-k gives that set (``replay_state.topk_order``), and what each costs on the device.

Usage (GPU): python bench/topk_vs_sort.py [--tokens 16384] [--out PATH]; skipped without CUDA.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def main(argv=None) -> int:
    import torch

    if not torch.cuda.is_available():
        print(f"{Path(__file__).name}: no CUDA device here; skipped (a GPU benchmark)")
        return 0
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    from moeverify.patches.replay_state import topk_order

    def sort_order(key_TE, sorted_ids_TK):
        order_TK = key_TE.gather(1, sorted_ids_TK).sort(dim=1, descending=True, stable=True).indices
        return sorted_ids_TK.gather(1, order_TK)

    cases, differ = 0, 0
    g = torch.Generator(device="cuda").manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        for experts in (8, 16, 32, 64, 128, 256, 512):
            for topk in (1, 2, 3, 4, 6, 8, 12, 16):
                if topk > experts:
                    continue
                for levels in (2, 4, 16, None):  # tie-heavy keys, then continuous ones
                    rows = 4096
                    if levels is None:
                        keys = torch.rand(rows, experts, generator=g, device="cuda").to(dtype)
                    else:
                        keys = (torch.randint(0, levels, (rows, experts), generator=g, device="cuda") * 0.25).to(dtype)
                    ids = torch.topk(keys, topk, dim=1, sorted=True).indices.sort(dim=1).values
                    a, b = topk_order(keys, ids), sort_order(keys, ids)
                    cases += 1
                    differ += int(not torch.equal(a, b))
    T, E, K = args.tokens, 128, 8
    keys = torch.randn(T, E, device="cuda", dtype=torch.float32)
    ids = torch.topk(keys, K, dim=1).indices.sort(dim=1).values

    def timed(fn, iters=200):
        for _ in range(10):
            fn()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / iters * 1e3

    result = {
        "cases": cases,
        "cases_differ": differ,
        "topk_order_us": timed(lambda: topk_order(keys, ids)),
        "sort_order_us": timed(lambda: sort_order(keys, ids)),
        "gpu": torch.cuda.get_device_name(),
        "shape": [T, E, K],
    }
    print(json.dumps(result))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
