"""Where the router-replay patch spends its time on a GPU: host time per step and host syncs, per variant.

A router's forward + backward is launch-bound on a GPU (one router of 16k tokens is a few dozen small
kernels), so every microsecond of Python the patch adds shows in the step time, and a host sync would
stall the launch queue. For each variant of ``bench/router_replay.py`` (unpatched, moeverify record and
replay, Megatron-Core's native record and replay) this measures, in one process:

- ``host_us``: host time to issue one step (no synchronisation inside the timed loop; the queue is
  drained before and after);
- ``syncs``: whether one step synchronises with the device (``torch.cuda.set_sync_debug_mode("error")``);
- the top host-side operators of one step (``torch.profiler``), printed.

Usage (GPU): python bench/replay_overhead.py --hidden 2048 --experts 128 --topk 8 --tokens 16384 --dtype bf16
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import router_replay as bench  # noqa: E402  (the variants and shapes of bench/router_replay.py)


def _host_us(step, iters: int) -> float:
    import torch

    step()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(iters):
            step()
        best = min(best, (time.perf_counter() - start) / iters * 1e6)
        torch.cuda.synchronize()
    return best


def _syncs(step) -> str | None:
    import torch

    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
        return None
    except RuntimeError as exc:
        return str(exc).splitlines()[0]
    finally:
        torch.cuda.set_sync_debug_mode("default")


def _top_ops(step, rows: int = 12) -> str:
    from torch.profiler import ProfilerActivity, profile

    step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows)


def _cprofile(step, iters: int, rows: int = 25) -> str:
    import cProfile
    import io
    import pstats

    step()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(iters):
        step()
    prof.disable()
    text = io.StringIO()
    stats = pstats.Stats(prof, stream=text)
    stats.sort_stats("tottime").print_stats(rows)
    stats.sort_stats("cumulative").print_stats("moeverify", rows)  # where the patch's own host time goes
    return text.getvalue()


def main(argv=None) -> int:
    import contextlib

    import torch as _torch

    if not _torch.cuda.is_available():  # ``make bench`` runs every script: this one measures a GPU
        print(f"{Path(__file__).name}: no CUDA device here; skipped (a GPU benchmark)")
        return 0
    from moeverify import runtime
    from moeverify.spec.layout import Layout

    args = bench.parse_args(list(argv if argv is not None else sys.argv[1:]) + ["--device", "cuda"])
    bench.SCOPE[0] = args.scope
    runtime.init("cuda")
    results = {}
    with runtime.parallel(Layout(), seed=0):
        x = bench._input(args)
        for name, variant in bench._variants_moeverify(args, x).items():
            step, around = variant if isinstance(variant, tuple) else (variant, contextlib.nullcontext)
            with around():
                results[name] = {"host_us": _host_us(step, args.iters), "syncs": _syncs(step)}
                print(f"== {name}\n" + _top_ops(step))
                if name in ("unpatched", "record", "replay", "native.replay"):
                    print(f"== cProfile {name} ({args.iters} steps)\n" + _cprofile(step, args.iters))
    for name, r in results.items():
        print(f"{name:24s} host {r['host_us']:9.1f} us/step  sync: {r['syncs'] or 'none'}")
    print(json.dumps({"shape": vars(args) | {"out": None}, "results": results}, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
