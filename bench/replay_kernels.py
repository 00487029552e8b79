"""Device-side view of one router step per variant of ``bench/router_replay.py``: the CUDA kernels a step runs and
their device time (``torch.profiler``), so a replay variant's extra device work is seen kernel by kernel.

Usage (GPU): python bench/replay_kernels.py --hidden 2048 --experts 128 --topk 8 --tokens 16384 --dtype bf16
    [--scope router] [--variants unpatched replay native.replay]
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import router_replay as bench  # noqa: E402  (the variants and shapes of bench/router_replay.py)


def main(argv=None) -> int:
    import torch
    import torch as _torch
    from torch.profiler import ProfilerActivity, profile

    from moeverify import runtime
    from moeverify.spec.layout import Layout

    if not _torch.cuda.is_available():  # ``make bench`` runs every script: this one measures a GPU
        print(f"{Path(__file__).name}: no CUDA device here; skipped (a GPU benchmark)")
        return 0
    argv = list(argv if argv is not None else sys.argv[1:])
    names = ["unpatched", "record", "replay", "native.replay"]
    if "--variants" in argv:
        at = argv.index("--variants")
        names, argv = argv[at + 1 :], argv[:at]
    args = bench.parse_args(argv + ["--device", "cuda"])
    bench.SCOPE[0] = args.scope
    runtime.init("cuda")
    print("gpu:", bench.gpu_info())
    with runtime.parallel(Layout(), seed=0):
        x = bench._input(args)
        variants = bench._variants_moeverify(args, x)
        for name in names:
            step, around = (
                variants[name] if isinstance(variants[name], tuple) else (variants[name], contextlib.nullcontext)
            )
            with around():
                for _ in range(3):
                    step()
                torch.cuda.synchronize()
                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    for _ in range(10):
                        step()
                    torch.cuda.synchronize()
            events = [e for e in prof.key_averages() if e.device_time_total > 0]
            total = sum(e.self_device_time_total for e in events) / 10
            print(f"== {name}: device {total:.1f} us/step")
            for e in sorted(events, key=lambda e: -e.self_device_time_total)[:14]:
                print(f"   {e.self_device_time_total / 10:8.1f} us  x{e.count // 10:<3d} {e.key[:110]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
