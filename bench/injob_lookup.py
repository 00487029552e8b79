"""Benchmark: in-job R2's cost at layer scope, one MoE layer's router + local dispatch, forward and backward.

Variants, interleaved round by round in one process (the fastest round counts):
- ``unpatched``: Megatron-Core as installed (the patch reverted);
- ``r2.replay``: a training forward under ``MOEVERIFY_ROUTER_REPLAY=r2``: the chunk forward's token keys
  (prefix hashes of ``[1, T]`` ids), one sorted search in a table of the step's recorded tokens, the layer's
  gather, then Megatron's routing with the found ids, and the forward's found check (a flag read behind an
  event). With one MoE layer per forward, the keys and the search
  are all this layer's: the worst case;
- ``r2.replay_unchecked``: the same without the found check (what the check costs);
- ``r2.replay_gather``: the same with the forward's keys and search already done (a later layer of the same
  forward: what each layer pays in a many-layer model);
- ``r2.record_fwd`` vs ``unpatched_fwd``: a log-prob forward (no grad) recording into the table;
- ``r3.replay``: a forward under ``MOEVERIFY_ROUTER_REPLAY=r3:DIR``: as ``r2.replay``, plus the listing of the
  rollout directory each chunk forward makes (the table, read from ``RolloutWriter`` files, is built once);
- ``r2.replay_guard`` / ``r3.replay_guard``: the same with the live agreement guard on (in-job replay's default):
  a native top-k and the overlap histogram per call, on the device; the step's one host read (``end_step``) after
  each timed loop, as a trainer's optimizer step would. ``*.guard_vs_replay``: its cost against the same forward
  without it.

The table holds ``--recorded`` tokens (default 4x the micro-batch: a step's log-prob passes), the micro-batch's
tokens among them. H200: ``--device cuda --hidden 2048 --experts 128 --topk 8 --tokens 16384 --dtype bf16``.
Writes ``bench/results/injob_lookup.json``.

Legend of shape suffixes: T = tokens, H = hidden, E = experts, K = top-k.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import router_replay as bench  # noqa: E402 (the layer step and timer of the router-replay benchmark)

RESULTS = Path(__file__).resolve().parent / "results" / "injob_lookup.json"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--experts", type=int, default=32)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--recorded", type=int, default=None, help="tokens in the step's table (default 4 x --tokens)")
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    p.add_argument("--iters", type=int, default=None)
    p.add_argument("--rounds", type=int, default=11)
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    args.iters = args.iters or (50 if args.device == "cuda" else 10)
    args.recorded = args.recorded or 4 * args.tokens
    args.scope, args.scoring = "layer", "softmax"
    if args.recorded % args.tokens:
        p.error("--recorded must be a multiple of --tokens")
    return args


def main(argv=None) -> dict:
    import torch

    from moeverify import runtime
    from moeverify.patches import agreement, injob
    from moeverify.patches import router_replay as rr
    from moeverify.spec.layout import Layout

    args = parse_args(argv)
    bench.SCOPE[:] = ["layer"]
    runtime.init("cpu" if args.device == "cpu" else "cuda")
    with runtime.parallel(Layout(), seed=0):
        router = bench._router(args)
        chunk = torch.nn.ModuleList([router])  # the model chunk whose forward carries the token ids
        x = bench._input(args)
        g = torch.Generator().manual_seed(2)
        rows = [
            torch.randint(0, 150000, (1, args.tokens), generator=g).to(args.device)
            for _ in range(args.recorded // args.tokens)
        ]
        rr.apply()
        state = injob.InJobState(original=rr.original_routing(), num_experts=args.experts)
        rr._ACTIVE[id(router)] = (state, 0)

        def forward_of(ids):
            fwd = injob.ChunkForward(chunk, (ids,), {})
            injob._CURRENT.append(fwd)
            return fwd

        with torch.no_grad():
            for ids in rows:  # the step's log-prob passes
                forward_of(ids)
                router(x)
                injob._CURRENT.pop()
        ready = forward_of(rows[0])
        bench._layer_step(router, x)  # freezes the table; this forward's keys and search stay cached
        injob._CURRENT.pop()

        def replay():
            fwd = forward_of(rows[0])
            bench._layer_step(router, x)
            injob._CURRENT.pop()
            fwd.check()  # what the chunk's forward hook runs when the forward ends

        def replay_unchecked():
            forward_of(rows[0])
            bench._layer_step(router, x)
            injob._CURRENT.pop()

        def replay_gather():
            injob._CURRENT.append(ready)
            bench._layer_step(router, x)
            injob._CURRENT.pop()

        recorder = injob.InJobState(original=rr.original_routing(), num_experts=args.experts)

        def record_fwd():
            with torch.no_grad():
                recorder.phase = "training"  # each call starts a new step's table
                forward_of(rows[0])
                router(x)
                injob._CURRENT.pop()

        del rr._ACTIVE[id(router)]
        rollout = _rollout_dir(router, rows, args)
        r3_state = injob.RolloutState(original=rr.original_routing(), num_experts=args.experts, directory=rollout)

        @contextlib.contextmanager
        def guarded():  # the agreement guard on (in-job modes' default), its step flushed after the timed loop
            guard = agreement.guard()
            try:
                yield
                guard.end_step()
            finally:
                agreement.stop()

        def held(step, owner=state):
            def run():
                rr._ACTIVE[id(router)] = (owner, 0)
                try:
                    step()
                finally:
                    del rr._ACTIVE[id(router)]

            return run

        def unpatched_fwd():
            with torch.no_grad():
                router(x)

        variants = {
            "unpatched": lambda: bench._layer_step(router, x),
            "r2.replay": held(replay),
            "r2.replay_unchecked": held(replay_unchecked),
            "r2.replay_gather": held(replay_gather),
            "unpatched_fwd": unpatched_fwd,
            "r2.record_fwd": held(record_fwd, recorder),
            "r3.replay": held(replay, r3_state),
            "r2.replay_guard": (held(replay), guarded),
            "r3.replay_guard": (held(replay, r3_state), guarded),
        }
        timer = bench._timer(args)
        best = {name: float("inf") for name in variants}
        for _ in range(args.rounds):
            for name, step in variants.items():
                best[name] = min(best[name], timer(step))
        syncs = {name: _syncs(step) for name, step in variants.items()} if args.device == "cuda" else {}
        table = next(iter(state.tables.values()))
        rr.revert()
    base = {
        "r2.replay": "unpatched",
        "r2.replay_unchecked": "unpatched",
        "r2.replay_gather": "unpatched",
        "r2.record_fwd": "unpatched_fwd",
        "r3.replay": "unpatched",
        "r2.replay_guard": "unpatched",
        "r3.replay_guard": "unpatched",
    }
    metrics = {name: {"value": round(ms, 4), "unit": "ms"} for name, ms in best.items()}
    for name, peer in base.items():
        metrics[name].update(peer=peer, ratio=round(best[name] / best[peer], 4))
    for name in ("r2.replay", "r3.replay", "r2.replay_guard", "r3.replay_guard"):
        metrics[name]["goal"] = "<=1.02"
    for name in ("r2", "r3"):  # the guard's own cost: the same forward with and without it, same process
        metrics[f"{name}.guard_vs_replay"] = {
            "value": metrics[f"{name}.replay_guard"]["value"],
            "unit": "ms",
            "peer": metrics[f"{name}.replay"]["value"],
            "ratio": round(best[f"{name}.replay_guard"] / best[f"{name}.replay"], 4),
        }
    result = {
        "args": {k: str(v) for k, v in vars(args).items() if k != "out"},
        "metrics": metrics,
        "table_bytes": table.nbytes(),
        "table_tokens": int(table.keys_2G.shape[1]),
        "gpu": bench.gpu_info() if args.device == "cuda" else None,
        "syncs": syncs,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))
    return result


def _syncs(variant) -> str | None:
    """None if one step of ``variant`` makes no synchronizing CUDA call (``torch.cuda.set_sync_debug_mode``), else
    the first one's message. The found check's event wait (``r2.replay``) is a wait on an event, not a stream sync."""
    import torch

    step, around = variant if isinstance(variant, tuple) else (variant, contextlib.nullcontext)
    with around():
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            step()
            return None
        except RuntimeError as exc:
            return str(exc).splitlines()[0]
        finally:
            torch.cuda.set_sync_debug_mode("default")


def _rollout_dir(router, rows, args) -> str:
    """A rollout directory (``RolloutWriter``) holding the step's sequences with random distinct routes."""
    import tempfile

    import torch

    from moeverify.routing import layer_numbering
    from moeverify.routing.rollout_writer import RolloutWriter

    config = router.config
    width = len(layer_numbering.moe_layers(num_layers=config.num_layers, moe_layer_freq=config.moe_layer_freq))
    directory = tempfile.mkdtemp(prefix="moeverify-bench-r3-")
    g = torch.Generator().manual_seed(3)
    with RolloutWriter(directory, step=0) as w:
        for ids in rows:
            routes_TWK = torch.rand(args.tokens, width, args.experts, generator=g).argsort(-1)[..., : args.topk]
            w.add(ids[0].cpu(), routes_TWK)
    return directory


if __name__ == "__main__":
    main()
