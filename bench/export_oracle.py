"""Export oracle benchmark: memory and time of the sharded export check on a >= 200M-parameter model.

Run on 4 CPU ranks:
    python -m torch.distributed.run --nproc-per-node 4 bench/export_oracle.py [--weights both|real|init]
        [--out bench/results/export_oracle.json]

The tiny ``qwen2`` family scaled up (hidden 1024, vocab 81920, ffn 4096: about 231M parameters) under
TP2 x PP2, with weights from one of two sources (``--weights both``, the default, measures each):

- ``real``: a safetensors HF checkpoint of the scaled model with real values (seeded normal draws) is
  written once, registered as a user model (``moeverify.spec.models.user``) and loaded through
  Megatron-Bridge's own loading path (``to_megatron_provider(load_weights=True)``);
- ``init``: the family built with ``moeverify.models.build`` overrides (Megatron's own init); its HF key
  set and shapes come from a shape-only checkpoint written next to it (values are not read by anyone).

Measured on rank 0, each phase from a fresh peak-RSS mark:

- ``bare``: one ``bridge.export_hf_weights(model_chunks, cpu=True)`` pass, tensors dropped;
- ``oracle``: ``moeverify.oracles.export.run_subject(sharded)`` (which runs that export itself);
- ``gather_everything``: the naive oracle: every rank's pieces (positions and values of all rows)
  gathered to rank 0 as Python objects, then merged into full buffers (``BENCH_SKIP_NAIVE=1`` skips it).

Metrics (``bench/results/export_oracle.json``; ``metrics`` are the real-weights run's, ``init_weights``
holds the other): oracle time vs the bare export (goal <= 1.2), oracle peak extra RSS vs the bare
export's (goal <= 1.1), oracle peak vs the largest HF tensor, gather-everything peak vs the oracle's.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import sys
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

SCALE = dict(hidden_size=1024, ffn_hidden_size=4096, kv_channels=256, vocab_size=81920)
# --scale small: the same family and layout at about a fifth of the parameters, for quick before/after
# ratios on a loaded development machine (the benchmark's numbers are the full-scale ones)
SMALL = dict(hidden_size=512, ffn_hidden_size=2048, kv_channels=128, vocab_size=40960)


def _rss_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


class PeakRss:
    """Peak RSS above the level at entry: the kernel's high-water mark when it can be reset, else sampled."""

    def __enter__(self):
        gc.collect()
        self.base = _rss_kib("VmRSS")
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            self.kernel = True
        except OSError:
            self.kernel = False
        self.peak, self._stop = self.base, threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self):
        while not self._stop.wait(0.002):
            self.peak = max(self.peak, _rss_kib("VmRSS"))

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        if self.kernel:
            self.peak = max(self.peak, _rss_kib("VmHWM"))
        self.extra_mib = (self.peak - self.base) / 1024


def _hf_shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    h, v, f = cfg["hidden_size"], cfg["vocab_size"], cfg["intermediate_size"]
    heads, groups, d = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    shapes = {"model.embed_tokens.weight": (v, h), "lm_head.weight": (v, h), "model.norm.weight": (h,)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes.update(
            {
                p + "input_layernorm.weight": (h,),
                p + "post_attention_layernorm.weight": (h,),
                p + "self_attn.q_proj.weight": (heads * d, h),
                p + "self_attn.q_proj.bias": (heads * d,),
                p + "self_attn.k_proj.weight": (groups * d, h),
                p + "self_attn.k_proj.bias": (groups * d,),
                p + "self_attn.v_proj.weight": (groups * d, h),
                p + "self_attn.v_proj.bias": (groups * d,),
                p + "self_attn.o_proj.weight": (h, heads * d),
                p + "mlp.gate_proj.weight": (f, h),
                p + "mlp.up_proj.weight": (f, h),
                p + "mlp.down_proj.weight": (h, f),
            }
        )
    return shapes


def _suffix() -> str:
    return "" if SCALE["hidden_size"] == 1024 else f"-h{SCALE['hidden_size']}"


def _scaled_config() -> dict:
    from moeverify.models import hf_config_dict

    return dict(
        hf_config_dict("qwen2"),
        hidden_size=SCALE["hidden_size"],
        intermediate_size=SCALE["ffn_hidden_size"],
        head_dim=SCALE["kv_channels"],
        vocab_size=SCALE["vocab_size"],
    )


def _write_checkpoint(dst: Path, cfg: dict, tensors) -> None:
    """Write ``config.json`` and ``model.safetensors`` once (rank 0), then every rank goes on."""
    from safetensors.torch import save_file

    if dist.get_rank() == 0 and not (dst / "model.safetensors").exists():
        dst.mkdir(parents=True, exist_ok=True)
        (dst / "config.json").write_text(json.dumps(cfg, indent=1))
        save_file(tensors(), str(dst / "model.safetensors.tmp"))
        os.replace(dst / "model.safetensors.tmp", dst / "model.safetensors")
    dist.barrier()


def shape_checkpoint(dtype: torch.dtype) -> tuple[Path, dict]:
    """A checkpoint directory with the scaled model's key set and shapes (uninitialised values)."""
    cfg = _scaled_config()
    shapes = _hf_shapes(cfg)
    dst = Path(os.environ.get("TMPDIR", "/tmp")) / f"moeverify-bench-export-{str(dtype).split('.')[-1]}{_suffix()}"
    _write_checkpoint(dst, cfg, lambda: {k: torch.empty(s, dtype=dtype) for k, s in shapes.items()})
    return dst, shapes


def real_checkpoint(dtype: torch.dtype = torch.bfloat16) -> tuple[Path, dict]:
    """A checkpoint directory of the scaled model with real values: seeded normal draws (norms around 1)."""
    cfg = _scaled_config()
    shapes = _hf_shapes(cfg)
    dst = Path(os.environ.get("TMPDIR", "/tmp")) / f"moeverify-bench-export-real-{str(dtype).split('.')[-1]}{_suffix()}"

    def tensors():
        gen = torch.Generator().manual_seed(0)
        out = {}
        for k, s in shapes.items():
            t = torch.randn(s, generator=gen) * 0.02
            out[k] = (t + 1 if k.endswith("norm.weight") else t).to(dtype)
        return out

    _write_checkpoint(dst, cfg, tensors)
    return dst, shapes


def gather_everything(sctx) -> None:
    """The naive oracle: all pieces of all rows to rank 0 as Python objects, merged there at once."""
    from moeverify.oracles.export.rows import drain, pieces
    from moeverify.subjects import sharded

    rows = drain(sharded(sctx), rank=sctx.rank)
    mine = [
        [(p.hf_name, p.hf_shape, p.positions_P, p.values_P.clone()) for p in pieces(r, rank=sctx.rank)] for r in rows
    ]
    everything = [None] * sctx.world_size if sctx.rank == 0 else None
    dist.gather_object(mine, everything, dst=0)
    if sctx.rank == 0:
        buffers = {}
        for rank_rows in everything:
            for row in rank_rows:
                for name, shape, pos, val in row:
                    if pos.numel():
                        buf = buffers.setdefault(name, torch.empty(math.prod(shape), dtype=val.dtype))
                        buf[pos] = val
    dist.barrier()


def _phase(fn):
    dist.barrier()
    with PeakRss() as peak:
        t0 = time.perf_counter()
        result = fn()
        seconds = time.perf_counter() - t0
    dist.barrier()
    return peak.extra_mib, seconds, result


def _profiled(fn):
    """Run ``fn``; with BENCH_PROFILE=PATH set, rank 0 writes cProfile stats there."""
    path = os.environ.get("BENCH_PROFILE")
    if not path or dist.get_rank() != 0:
        return fn()
    import cProfile
    import pstats

    prof = cProfile.Profile()
    result = prof.runcall(fn)
    with open(path, "w") as f:
        pstats.Stats(prof, stream=f).sort_stats("tottime").print_stats(25)
        pstats.Stats(prof, stream=f).sort_stats("cumulative").print_stats("moeverify", 40)
    return result


TIMELINE: str | None = None  # --timeline PATH
REPEATS = 1  # --repeats N


def _timeline(sctx, built, bare_s: float) -> None:
    """Run the oracle once more with every rank's phases timed; rank 0 writes them (bench/export_timeline.py)."""
    sys.path.insert(0, str(Path(__file__).parent))
    import export_timeline

    from moeverify.oracles import export
    from moeverify.subjects import sharded

    bare = export_timeline.Timeline()  # the bare export, each tensor timed the same way
    dist.barrier()
    for _name, _t in bare.reference(built.bridge.export_hf_weights(built.model_chunks, cpu=True, show_progress=False)):
        del _t
    timeline = export_timeline.Timeline()
    dist.barrier()
    with timeline.patched():
        t0 = time.perf_counter()
        export.run_subject(
            sharded,
            sctx,
            reference=timeline.reference(
                built.bridge.export_hf_weights(built.model_chunks, cpu=True, show_progress=False)
            ),
        )
        total = time.perf_counter() - t0
    everything = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(timeline.events, everything, dst=0)
    bare_events = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(bare.events, bare_events, dst=0)
    if dist.get_rank() == 0:
        export_timeline.write(TIMELINE, everything, total, bare_s, bare_events=bare_events)
    dist.barrier()


def _later(again: dict) -> dict | None:
    if not again["bare_s"]:
        return None
    import statistics

    bare, oracle = statistics.median(again["bare_s"]), statistics.median(again["oracle_s"])
    return dict(again, median_ratio=round(oracle / bare, 3))


def _build(weights: str, layout, rt):
    """The scaled model and its checkpoint directory, for ``weights`` ``real`` or ``init``."""
    from moeverify import models
    from moeverify.spec.models import user

    if weights == "real":
        hf_path, shapes = real_checkpoint()
        built = models.build(user.read(hf_path, where="bench").ref, layout, load_weights=True)
        return built, hf_path, shapes
    built = models.build("qwen2", layout, overrides=dict(SCALE), load_weights=False)
    dtype = next(built.model_chunks[0].parameters()).dtype
    hf_path, shapes = shape_checkpoint(dtype)
    return built, hf_path, shapes


def measure(weights: str, layout, rt) -> dict | None:
    """Bare export, oracle and (unless skipped) the naive oracle on one model; rank 0's report."""
    from moeverify import runtime
    from moeverify.oracles import export
    from moeverify.subjects import sharded

    with runtime.parallel(layout):
        built, hf_path, shapes = _build(weights, layout, rt)
        dtype = next(built.model_chunks[0].parameters()).dtype
        params = sum(math.prod(s) for s in shapes.values())
        largest = max(math.prod(s) for s in shapes.values()) * torch.empty((), dtype=dtype).element_size() / 2**20
        sctx = export.SubjectContext(
            bridge=built.bridge,
            model_chunks=built.model_chunks,
            layout=layout,
            rank=rt.rank,
            world_size=rt.world_size,
            hf_path=hf_path,
            built=built,
            timeout_s=1200,
            stats={},
        )

        def bare():
            for _name, _t in built.bridge.export_hf_weights(built.model_chunks, cpu=True, show_progress=False):
                del _t

        bare_mib, bare_s, _ = _phase(bare)
        oracle_mib, oracle_s, tallies = _phase(lambda: _profiled(lambda: export.run_subject(sharded, sctx)))
        first = {"bare_s": round(bare_s, 3), "oracle_s": round(oracle_s, 3), "ratio": round(oracle_s / bare_s, 3)}
        again = {"bare_s": [], "oracle_s": []}
        for _ in range(REPEATS - 1):  # later calls, alternating (each process's first call pays one-time costs)
            again["bare_s"].append(round(_phase(bare)[1], 3))
            again["oracle_s"].append(round(_phase(lambda: export.run_subject(sharded, sctx))[1], 3))
        if TIMELINE:  # a second oracle run, instrumented (its time is not the benchmark's figure)
            _timeline(sctx, built, bare_s)
        if os.environ.get("BENCH_SKIP_NAIVE"):  # quick runs: the naive oracle takes the longest
            naive_mib, naive_s = float("nan"), float("nan")
        else:
            naive_mib, naive_s, _ = _phase(lambda: gather_everything(sctx))
        stats = dict(sctx.stats)
        built = sctx = None  # drop the model before leaving the parallel state (the closures share these cells)
    if rt.rank != 0:
        return None
    failed = {k: t.failures[:2] for k, t in tallies.items() if not t.passed}
    return {
        "metrics": {
            "oracle_time_vs_bare_export": {
                "value": round(oracle_s, 2),
                "unit": "s",
                "peer": round(bare_s, 2),
                "ratio": round(oracle_s / bare_s, 3),
                "goal": "<=1.2",
            },
            "oracle_peak_rss_vs_bare_export_peak": {
                "value": round(oracle_mib, 1),
                "unit": "MiB",
                "peer": round(bare_mib, 1),
                "ratio": round(oracle_mib / bare_mib, 3),
                "goal": "<=1.1",
            },
            "oracle_peak_rss_vs_largest_tensor": {
                "value": round(oracle_mib, 1),
                "unit": "MiB",
                "peer": round(largest, 1),
                "ratio": round(oracle_mib / largest, 3),
            },
            "gather_everything_vs_oracle_peak_rss": {
                "value": round(oracle_mib, 1),
                "unit": "MiB",
                "peer": round(naive_mib, 1),
                "ratio": round(naive_mib / oracle_mib, 3),
            },
        },
        "context": {
            "model": "qwen2 scaled",
            "weights": weights,
            "parameters": params,
            "dtype": str(dtype),
            "layout": "tp2-pp2",
            "ranks": rt.world_size,
            "bare_export_peak_vs_largest_tensor": round(bare_mib / largest, 3),
            "gather_everything_seconds": round(naive_s, 2),
            "oracle_passed": not failed,
            "first_calls": first,
            "later_calls": _later(again),
            "oracle_failures": failed,
            "checked": {k: t.checked for k, t in tallies.items()},
            "other_ranks_elements": stats,
        },
    }


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results/export_oracle.json")
    ap.add_argument(
        "--weights",
        choices=("both", "real", "init"),
        default="both",
        help="real: a safetensors checkpoint with real values loaded through Megatron-Bridge; "
        "init: Megatron's own init; both: each, real first (default)",
    )
    ap.add_argument(
        "--scale",
        choices=("full", "small"),
        default="full",
        help="full: hidden 1024, vocab 81920 (about 231M parameters; the benchmark); small: hidden 512, "
        "vocab 40960, for quick before/after ratios on a loaded machine",
    )
    ap.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="call the bare export and the oracle this many times each, alternating; the first pair is the "
        "benchmark's figure, later ones are reported as later_calls (medians)",
    )
    ap.add_argument(
        "--timeline",
        metavar="PATH",
        help="also run the oracle once instrumented and write every rank's phases to PATH (JSON) and "
        "PATH's .png (bench/export_timeline.py)",
    )
    args = ap.parse_args()
    global TIMELINE, REPEATS
    TIMELINE, REPEATS = args.timeline, args.repeats
    if args.scale == "small":
        SCALE.update(SMALL)
    from moeverify import runtime
    from moeverify.spec.layout import Layout

    rt = runtime.init("cpu")
    layout = Layout(tp=2, pp=2)
    reports = {w: measure(w, layout, rt) for w in (("real", "init") if args.weights == "both" else (args.weights,))}
    if rt.rank == 0:
        first = next(iter(reports))
        report = dict(reports[first])
        if "init" in reports and first != "init":
            report["init_weights"] = reports["init"]
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=2))
        print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
