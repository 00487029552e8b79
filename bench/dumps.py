"""Routing dumps: size, write cost, training-step overhead and diff speed, against peers measured in the same run.

Workload: top-8 of 128 experts, 16 MoE layers, 2 micro-batches of 4096 tokens (131,072 token-layer rows).
- size: a dump directory (manifest, safetensors with uint8 ids; finalize removes the rank records; format v2 packs the
layers of
  a micro-batch in one tensor) vs ``torch.save`` of the same per-layer tensors as int64, and vs megatron-core's
  ``RouterTracer`` JSONL (the real tracer when megatron-core imports, else the same records written with
  ``json.dumps`` as the tracer does);
- write throughput: ``RankWriter`` (background thread, validated, atomic) vs ``torch.save`` of int64;
- step overhead: a synthetic MoE-shaped training step (per layer: matmul, router, top-k, backward)
  with and without handing each layer's routes to a background ``RankWriter`` the way ``RouteRecorder``
  does (ids already known distinct and in range); steps alternate, medians compared;
- diff: token-layer rows/s on one core (``torch.set_num_threads(1)``) with 1 % of rows differing,
  vs a straightforward ``torch.sort`` set comparison; also 0 % and 100 % reordered rows (informational);
- diff from disk at scale (``--stream-tokens`` tokens, default 65,536, x 60 MoE layers x top-8 of 128, sequences of 4096
  tokens, two one-rank dumps with geometry, 1 % of rows differing and 1 % reordered): the streaming engine
  (``diff_stream``, one layer at a time) vs the in-memory one (``Dump.routes`` + ``diff``), each in a fresh
  process on one core, both ending in the full JSON record (which must be identical): token-layer rows/s;
  and the streaming engine against the in-memory kernel alone (``diff`` of the two dumps' routes, read before
  the clock starts), both in turn in one fresh process, the fastest of 3 runs each (``diff_stream_vs_kernel``,
  goal >= 0.5: reading, checking and merging from disk at least half the kernel's speed; the first, cold, runs
  are reported beside it);
  and peak RSS (``VmHWM``, reset by ``/proc/self/clear_refs``; ``getrusage``'s ``ru_maxrss`` would keep
  the parent's peak across ``exec``) above the process's RSS after imports and ``record.load``,
  as bytes and as multiples of one layer's ids (``tokens x 8`` bytes, one side) and of all ids of both
  dumps. ``--full`` runs it at 1M tokens (1,048,576 x 60 x 8 = 62.9M rows per side).

Writes ``bench/results/dumps.json`` (``{"metrics": {NAME: {"value", "unit", "peer", "ratio", "goal"}}}``;
``ratio`` is oriented so that larger is better except for ``step_overhead``, whose goal is ``<=``; the
diff throughput goal applies to ``value`` and says so in ``goal_on``).

    python bench/dumps.py [--tokens 4096] [--repeats 5] [--stream-tokens 65536 | --full] [--size-only]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
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
from moeverify.routing.routes import Routes  # noqa: E402

RESULTS = ROOT / "bench" / "results" / "dumps.json"
EXPERTS, TOPK, LAYERS, MICROBATCHES = 128, 8, 16, 2
STREAM_LAYERS, STREAM_SEQ_LEN, STREAM_MB_TOKENS, FULL_TOKENS = 60, 4096, 131072, 1 << 20
STREAM_TOKENS = 65536  # default diff-from-disk workload: keeps the default run under 2 minutes on 2 cores


def _routes(tokens: int, *, seed: int = 0) -> Routes:
    gen = torch.Generator().manual_seed(seed)
    return Routes(
        {
            layer: [torch.rand(tokens, EXPERTS, generator=gen).topk(TOPK, dim=1).indices for _ in range(MICROBATCHES)]
            for layer in range(LAYERS)
        },
        num_experts=EXPERTS,
        topk=TOPK,
    )


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
                lines.append(
                    json.dumps(
                        {
                            "step": 0,
                            "stage": "pre_dispatch",
                            "block": "decoder",
                            "layer": layer,
                            "rank": 0,
                            "num_tokens": ids.shape[0],
                            "topk": ids.shape[1],
                            "top_indices": ids.tolist(),
                        }
                    )
                    + "\n"
                )
        return len("".join(lines).encode()), "RouterTracer record format (json.dumps)"


def measure_size(routes: Routes, rows: int, tmp: Path) -> dict:
    record.save(tmp / "dump", routes)
    dump_b = _dir_bytes(tmp / "dump")
    tensors = {
        fmt.tensor_name(step=0, mb=mb, layer=layer, kind="ids"): routes.get(layer, mb).to(torch.int64)
        for layer in routes.layers
        for mb in range(routes.microbatches)
    }
    torch.save(tensors, tmp / "ids.pt")
    pt_b = (tmp / "ids.pt").stat().st_size
    jsonl_b, jsonl_how = _jsonl_bytes(routes, tmp / "trace")

    def per(b):
        return round(b / rows, 3)

    tensors_n = len(tensors)
    ours_fixed, peer_fixed = dump_b - rows * TOPK, pt_b - rows * TOPK * 8
    files = {p.name: p.stat().st_size for p in sorted((tmp / "dump").iterdir())}
    header = files[fmt.rank_file(0)] - rows * TOPK
    records = dump_b - files[fmt.rank_file(0)]
    return {
        "bytes_vs_torch_save_int64": {
            "value": per(dump_b),
            "unit": "bytes/token-layer",
            "peer": per(pt_b),
            "ratio": round(pt_b / dump_b, 4),
            "goal": ">=8",
            "files": files,
            "format_version": fmt.VERSION,
            "note": "uint8 ids are exactly 8x smaller than int64; beyond the ids the dump "
            f"holds {ours_fixed} bytes: manifest {records} (finalize folds the rank records in), "
            f"safetensors header {header} (format v{fmt.VERSION}: "
            f"{routes.microbatches} packed [L, T, K] tensors for {tensors_n} "
            f"(layer, micro-batch) pairs), against torch.save's {peer_fixed} "
            f"(about {round(peer_fixed / tensors_n)} per tensor). 8x needs the "
            f"dump's fixed bytes below 1/8 of torch.save's, {peer_fixed // 8}",
        },
        "bytes_vs_router_trace_jsonl": {
            "value": per(dump_b),
            "unit": "bytes/token-layer",
            "peer": per(jsonl_b),
            "ratio": round(jsonl_b / dump_b, 2),
            "goal": ">=4",
            "peer_is": jsonl_how,
        },
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

    tensors = {
        f"{layer}/{mb}": routes.get(layer, mb).to(torch.int64)
        for layer in routes.layers
        for mb in range(routes.microbatches)
    }
    ours_s = _best(ours, repeats)
    peer_s = _best(lambda: torch.save(tensors, tmp / "peer.pt"), repeats)
    return {
        "write_throughput": {
            "value": round(rows / ours_s),
            "unit": "token-layer rows/s",
            "peer": round(rows / peer_s),
            "ratio": round(peer_s / ours_s, 2),
            "goal": None,
        }
    }


def _step(weights, router_w, x, writer, step):
    h = x
    for layer, (w, r) in enumerate(zip(weights, router_w, strict=True)):
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
    return {
        "step_overhead": {
            "value": round(rec_s, 4),
            "unit": "s/step",
            "peer": round(base_s, 4),
            "ratio": round(rec_s / base_s, 3),
            "goal": "<=1.05",
            "note": f"{tokens} tokens x {LAYERS} layers per step; close() drained in {drain:.3f} s",
        }
    }


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
        a = Routes(
            {l: [a.get(l, m).to(torch.uint8) for m in range(MICROBATCHES)] for l in a.layers},
            num_experts=EXPERTS,
            topk=TOPK,
        )
        rows = tokens * 4 * LAYERS * MICROBATCHES
        out = {}
        b = _perturbed(a, fraction=0.01, reorder=False)
        ours = _best(lambda: record.diff(a, b), repeats)
        peer = _best(lambda: _naive_diff(a, b), max(1, repeats // 2))
        check = record.diff(a, b).to_json()
        out["diff_throughput"] = {
            "value": round(rows / ours),
            "unit": "token-layer rows/s (1 core)",
            "peer": round(rows / peer),
            "ratio": round(peer / ours, 2),
            "goal": ">=50000000",
            "goal_on": "value",
            "note": f"1% of rows differ; agreement {check['layers']['0']['agreement']:.4f}",
        }
        for name, frac, reorder in (
            ("diff_throughput_identical", 0.0, False),
            ("diff_throughput_all_reordered", 1.0, True),
            ("diff_throughput_10pct_differ", 0.1, False),
        ):
            b = _perturbed(a, fraction=frac, reorder=reorder)
            ours = _best(lambda: record.diff(a, b), repeats)
            out[name] = {
                "value": round(rows / ours),
                "unit": "token-layer rows/s (1 core)",
                "peer": None,
                "ratio": None,
                "goal": None,
            }
        return out
    finally:
        torch.set_num_threads(threads)


def _stream_ids(tokens: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """``[tokens, TOPK]`` distinct ids fast (a random start per token plus distinct offsets, mod 128), and
    ``[tokens]`` one more id per token that is not in its row."""
    offsets = torch.randperm(EXPERTS, generator=gen)[: TOPK + 1]
    start = torch.randint(0, EXPERTS, (tokens, 1), generator=gen)
    ids = ((start + offsets) % EXPERTS).to(torch.uint8)
    return ids[:, :TOPK].contiguous(), ids[:, TOPK]


def write_stream_dumps(tmp: Path, tokens: int) -> tuple[Path, Path]:
    """Two one-rank dumps (sequence geometry recorded) of ``tokens`` x 60 layers; B differs on 1 % of rows
    (one expert swapped) and reorders another 1 % (same set). Written a micro-batch at a time: each part holds
    one micro-batch's 60 layers packed (format v2), so a streamed layer is a slice of a packed tensor."""
    mb_tokens = min(tokens, STREAM_MB_TOKENS)
    if tokens % mb_tokens or mb_tokens % STREAM_SEQ_LEN:
        raise SystemExit(
            f"--stream-tokens {tokens}: need a multiple of {STREAM_SEQ_LEN} (and of {STREAM_MB_TOKENS} above it)"
        )
    mbs, batch = tokens // mb_tokens, mb_tokens // STREAM_SEQ_LEN
    model = fmt.ModelInfo(
        num_layers=STREAM_LAYERS, moe_layers=tuple(range(STREAM_LAYERS)), num_experts=EXPERTS, topk=TOPK
    )
    paths = tmp / "stream_a", tmp / "stream_b"
    writers = [RankWriter(p, model=model, background=False) for p in paths]
    gen = torch.Generator().manual_seed(7)
    for mb in range(mbs):
        for w in writers:
            w.add_tokens(step=0, mb=mb, seq_len=STREAM_SEQ_LEN, batch=batch)
    for mb in range(mbs):
        for layer in range(STREAM_LAYERS):
            a, spare = _stream_ids(mb_tokens, gen)
            b = a.clone()
            pick = torch.rand(mb_tokens, generator=gen)
            swap = (pick < 0.01).nonzero().flatten()
            b[swap, 0] = spare[swap]  # one expert swapped for one not chosen
            flip = (pick > 0.99).nonzero().flatten()
            b[flip] = b[flip].flip(1)  # the same set in another order
            writers[0].add(step=0, mb=mb, layer=layer, ids_TK=a, validated=True)  # distinct and in range by making
            writers[1].add(step=0, mb=mb, layer=layer, ids_TK=b, validated=True)
        for w in writers:
            w.flush()
    for w, p in zip(writers, paths, strict=True):
        w.close()
        record.finalize(p)
    return paths


def _status_bytes(key: str) -> int:
    with open("/proc/self/status") as f:
        return int(next(line for line in f if line.startswith(key + ":")).split()[1]) * 1024


def _reset_peak_rss() -> str:
    """Start the peak over from the current RSS. ``getrusage``'s ``ru_maxrss`` cannot: it keeps the parent's
    peak across ``exec``. Linux resets ``VmHWM`` when ``5`` is written to ``/proc/self/clear_refs``."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return "VmHWM after clear_refs"
    except OSError:
        return "ru_maxrss (may include the parent's peak)"


def _stream_child(engine: str, a: str, b: str, out: str) -> None:
    """One engine in this (fresh) process: time, peak RSS above the baseline, the record written to ``out``."""
    torch.set_num_threads(1)
    from moeverify.record.stream import DumpSource

    da, db = record.load(a), record.load(b)
    info = da.steps[0]
    geometry = {"seq_len": info.seq_len, "batch": info.batch}
    if engine == "pair":
        return _pair_child(da, db, geometry, out)
    how = _reset_peak_rss()
    baseline = _status_bytes("VmRSS")
    t0 = time.perf_counter()
    if engine == "stream":
        report = record.diff_stream(DumpSource(da), DumpSource(db), **geometry)
    else:
        report = record.diff(da.routes(), db.routes(), **geometry)
    result = report.to_json()
    seconds = time.perf_counter() - t0
    peak = (
        _status_bytes("VmHWM") if how.startswith("VmHWM") else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    )
    Path(out).write_text(json.dumps(result))
    print(
        json.dumps(
            {
                "seconds": seconds,
                "peak_rss": peak,
                "baseline_rss": baseline,
                "peak_from": how,
                "rows": report.tokens * len(report.layers),
            }
        )
    )


def _pair_child(da, db, geometry: dict, out: str, repeats: int = 3) -> None:
    """The streaming engine from disk and the kernel alone (``diff`` of both dumps' routes, read before the clock
    starts) in turn in this one process, ``repeats`` times each: the first (cold) and the fastest time of each."""
    from moeverify.record.stream import DumpSource

    ra, rb = da.routes(), db.routes()
    engines = {
        "stream": lambda: record.diff_stream(DumpSource(da), DumpSource(db), **geometry),
        "kernel": lambda: record.diff(ra, rb, **geometry),
    }
    times, records = {name: [] for name in engines}, {}
    for _ in range(repeats):
        for name, run in engines.items():
            t0 = time.perf_counter()
            records[name] = run().to_json()
            times[name].append(time.perf_counter() - t0)
    if records["stream"] != records["kernel"]:
        raise SystemExit("the streaming engine and the kernel gave different records")
    Path(out).write_text(json.dumps(records["stream"]))
    print(
        json.dumps(
            {
                "seconds": min(times["stream"]),
                "kernel_seconds": min(times["kernel"]),
                "first": {name: t[0] for name, t in times.items()},
                "rows": ra.microbatches
                and sum(ra.get(ra.layers[0], mb).shape[0] for mb in range(ra.microbatches)) * len(ra.layers),
            }
        )
    )


def measure_stream(tokens: int, tmp: Path, rounds: int = 2) -> dict:
    t0 = time.perf_counter()
    a, b = write_stream_dumps(tmp, tokens)
    written = time.perf_counter() - t0
    runs = {}
    for _ in range(rounds):  # engines alternate, each run in a fresh process; the fastest run of each is kept
        for engine in ("stream", "memory", "pair"):
            out = tmp / f"{engine}.json"
            proc = subprocess.run(
                [sys.executable, __file__, "--_child", engine, str(a), str(b), str(out)],
                capture_output=True,
                text=True,
                check=False,
            )
            if proc.returncode:
                raise SystemExit(f"{engine} child failed:\n{proc.stderr}")
            run = json.loads(proc.stdout.strip().splitlines()[-1])
            run["record"] = json.loads(out.read_text())
            best = runs.get(engine)
            if engine == "pair":
                if best is not None:
                    run["seconds"], run["kernel_seconds"] = (
                        min(run["seconds"], best["seconds"]),
                        min(run["kernel_seconds"], best["kernel_seconds"]),
                    )
                    run["first"] = {e: min(run["first"][e], best["first"][e]) for e in run["first"]}
                runs[engine] = run
                continue
            run["growth"] = run["peak_rss"] - run["baseline_rss"]
            if best is not None:
                if run["record"] != best["record"]:
                    raise SystemExit(f"two {engine} runs gave different records")
                run["growth"] = max(run["growth"], best["growth"])  # the worst run's memory, the best run's time
                run["peak_rss"] = max(run["peak_rss"], best["peak_rss"])
                run["baseline_rss"] = min(run["baseline_rss"], best["baseline_rss"])
                run["seconds"] = min(run["seconds"], best["seconds"])
            runs[engine] = run
    if not runs["stream"]["record"] == runs["memory"]["record"] == runs["pair"]["record"]:
        raise SystemExit("the streaming and in-memory records differ")
    check = runs["stream"]["record"]
    rows = runs["stream"]["rows"]
    layer_bytes = tokens * TOPK  # uint8 ids of one layer, one side
    total_bytes = 2 * STREAM_LAYERS * layer_bytes
    disk = sum(p.stat().st_size for d in (a, b) for p in d.iterdir())
    pair = runs.pop("pair")
    growth = {e: r["growth"] for e, r in runs.items()}
    rate = {e: round(rows / r["seconds"]) for e, r in runs.items()}
    note = (
        f"{tokens} tokens x {STREAM_LAYERS} layers x top-{TOPK} of {EXPERTS} per side from dumps on disk, "
        f"sequences of {STREAM_SEQ_LEN}; {check['tokens_diverging_any_layer']:.4f} of tokens diverge, "
        f"{check['routers_differing_per_token']:.4f} routers differ per token; records identical"
    )
    first = {e: round(rows / s) for e, s in pair["first"].items()}
    return {
        "diff_stream_vs_kernel": {
            "value": round(rows / pair["seconds"]),
            "unit": "token-layer rows/s (1 core, from disk)",
            "peer": round(rows / pair["kernel_seconds"]),
            "peer_is": "the in-memory kernel alone: diff() of the same two dumps' routes, read before the clock "
            "starts; both in turn in one process, 3 times each, the fastest of each",
            "ratio": round(pair["kernel_seconds"] / pair["seconds"], 3),
            "goal": ">=0.5",
            "first_runs": {
                "stream": first["stream"],
                "kernel": first["kernel"],
                "ratio": round(first["stream"] / first["kernel"], 3),
                "note": "the first run of each in a fresh process (cold: fresh buffers fault in)",
            },
            "note": note,
        },
        "diff_stream_throughput": {
            "value": rate["stream"],
            "unit": "token-layer rows/s (1 core, from disk)",
            "peer": rate["memory"],
            "peer_is": "in-memory: Dump.routes() + diff()",
            "ratio": round(rate["stream"] / rate["memory"], 3),
            "goal": ">=0.5",
            "note": note,
        },
        "diff_stream_peak_rss": {
            "value": growth["stream"],
            "unit": "bytes of peak RSS above the baseline",
            "peer": growth["memory"],
            "peer_is": "in-memory: Dump.routes() + diff()",
            "ratio": round(growth["memory"] / max(1, growth["stream"]), 2),
            "goal": None,
            "baseline_rss": {e: r["baseline_rss"] for e, r in runs.items()},
            "peak_rss": {e: r["peak_rss"] for e, r in runs.items()},
            "one_layer_bytes": layer_bytes,
            "total_ids_bytes": total_bytes,
            "dump_bytes_on_disk": disk,
            "stream_over_one_layer": round(growth["stream"] / layer_bytes, 2),
            "stream_over_total": round(growth["stream"] / total_bytes, 4),
            "memory_over_one_layer": round(growth["memory"] / layer_bytes, 2),
            "memory_over_total": round(growth["memory"] / total_bytes, 4),
            "peak_from": runs["stream"]["peak_from"],
            "seconds": {e: round(r["seconds"], 2) for e, r in runs.items()},
            "write_seconds": round(written, 1),
        },
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=4096, help="tokens per micro-batch (default 4096)")
    p.add_argument("--repeats", type=int, default=5, help="timing repeats; the best (or median for steps) is kept")
    p.add_argument("--out", type=Path, default=RESULTS, help="results JSON path")
    p.add_argument(
        "--stream-tokens",
        type=int,
        default=STREAM_TOKENS,
        help=f"tokens of the diff-from-disk workload (x {STREAM_LAYERS} layers x top-{TOPK}; default {STREAM_TOKENS})",
    )
    p.add_argument("--full", action="store_true", help=f"the diff-from-disk workload at {FULL_TOKENS} tokens")
    p.add_argument(
        "--stream-rounds",
        type=int,
        help="runs of each engine, alternating; the fastest is kept (default 1, with --full 2)",
    )
    p.add_argument(
        "--size-only",
        action="store_true",
        help="measure the dump size only and update those metrics "
        "in --out, keeping its other figures (seconds, not minutes)",
    )
    p.add_argument("--_child", nargs=4, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args._child:
        _stream_child(*args._child)
        return 0
    if args.size_only:
        return _size_only(args)
    stream_tokens = FULL_TOKENS if args.full else args.stream_tokens
    routes = _routes(args.tokens)
    rows = args.tokens * LAYERS * MICROBATCHES
    metrics = {}
    metrics.update(measure_diff(args.tokens, args.repeats))  # first: before any multi-threaded work
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        metrics.update(measure_size(routes, rows, tmp))
        metrics.update(measure_write(routes, rows, tmp, args.repeats))
        metrics.update(measure_step_overhead(args.tokens, tmp, 2 * args.repeats))
        rounds = args.stream_rounds or (2 if args.full else 1)
        metrics.update(measure_stream(stream_tokens, tmp, rounds=rounds))
    result = {
        "metrics": metrics,
        "workload": {
            "tokens_per_microbatch": args.tokens,
            "microbatches": MICROBATCHES,
            "moe_layers": LAYERS,
            "experts": EXPERTS,
            "topk": TOPK,
            "torch_threads": torch.get_num_threads(),
            "stream": {
                "tokens": stream_tokens,
                "moe_layers": STREAM_LAYERS,
                "topk": TOPK,
                "experts": EXPERTS,
                "seq_len": STREAM_SEQ_LEN,
                "full": args.full,
                "rounds": args.stream_rounds or (2 if args.full else 1),
            },
        },
        "host": _host(),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    _print(metrics)
    return 0


def _size_only(args) -> int:
    routes = _routes(args.tokens)
    with tempfile.TemporaryDirectory() as tmp:
        metrics = measure_size(routes, args.tokens * LAYERS * MICROBATCHES, Path(tmp))
    result = json.loads(args.out.read_text()) if args.out.is_file() else {"metrics": {}}
    if result.get("workload", {}).get("tokens_per_microbatch", args.tokens) != args.tokens:
        raise SystemExit(
            f"{args.out} was measured at {result['workload']['tokens_per_microbatch']} tokens per "
            f"micro-batch, not --tokens {args.tokens}; rerun it whole"
        )
    result["metrics"].update(metrics)
    result.setdefault("size_host", {}).update(_host())
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    _print(metrics)
    return 0


def _host() -> dict:
    mem = None
    try:
        with open("/proc/meminfo") as f:
            mem = int(next(line for line in f if line.startswith("MemTotal")).split()[1]) * 1024
    except (OSError, StopIteration, ValueError):
        pass
    cpu = (
        next(
            (
                line.split(":", 1)[1].strip()
                for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")
            ),
            platform.processor(),
        )
        if Path("/proc/cpuinfo").exists()
        else None
    )
    return {
        "cpus": os.cpu_count(),
        "cpu": cpu,
        "memory_bytes": mem,
        "platform": platform.platform(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "load_average_1m": round(os.getloadavg()[0], 2),
    }


def _print(metrics: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="routing dumps")
    for col in ("metric", "value", "unit", "peer", "ratio", "goal"):
        table.add_column(col, justify="right" if col not in ("metric", "unit") else "left")
    for name, m in metrics.items():
        table.add_row(
            name,
            f"{m['value']:,}",
            m["unit"],
            "-" if m["peer"] is None else f"{m['peer']:,}",
            "-" if m["ratio"] is None else str(m["ratio"]),
            m["goal"] or "-",
        )
    Console().print(table)


if __name__ == "__main__":
    raise SystemExit(main())
