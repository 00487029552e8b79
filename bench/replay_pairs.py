"""Which passes of one model differ, bit for bit: plain vs plain, replay vs replay, plain vs replay.

A diagnostic for a replay check that fails at some shape: it builds the model once (the replay check's own
builds: ``replay_dtype`` fp32 or bf16, no dropout) and runs, over the check's micro-batches, two plain grad-mode
passes, a log-prob pass that records, two training passes that replay it, a third plain pass, and a grad-mode
pass routed natively in the no-grad slot order (finding F12's reference). Every pair is compared as the oracle
compares passes (routing maps and probs, logits, losses, gradients). Plain vs plain tells run-to-run determinism;
plain vs replay what the replay changes. It found the tie order of bf16 top-k (gradients off by bf16 ulps below
every router, forwards bitwise) on an H200 at Qwen3-30B-A3B's width.

    python bench/replay_pairs.py --model bench/qwen3_30b_a3b.json --layers 1 --backend cuda --dtype bf16

Prints one line per pair (items checked, failures) and the first failures.
"""

from __future__ import annotations

import argparse
import sys
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, default=ROOT / "bench" / "qwen3_30b_a3b_narrow.json")
    p.add_argument("--layers", type=int, default=1)
    p.add_argument("--backend", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="bf16")
    p.add_argument("--show", type=int, default=6, help="failures shown per pair")
    args = p.parse_args(argv)

    from moeverify import runtime
    from moeverify.oracles.replay import drive as rd
    from moeverify.oracles.replay import pass_checks as rc
    from moeverify.oracles.replay import setup as st
    from moeverify.oracles.replay import slot_order
    from moeverify.oracles.replay.impls import make_impl
    from moeverify.oracles.results import Tally
    from moeverify.routing import views
    from moeverify.spec.checks import ReplayOptions
    from moeverify.spec.layout import Layout
    from moeverify.spec.models import user
    from moeverify.spec.router_variants import VARIANTS

    ref = user.read(args.model, {"num_hidden_layers": args.layers}).ref
    runtime.init(args.backend)
    with runtime.parallel(Layout(), seed=0):
        scenario = types.SimpleNamespace(name="pairs", model=ref, seed=0, layout=Layout())
        ctx = types.SimpleNamespace(scenario=scenario, world_size=1, rank=0, options={})
        opts = ReplayOptions.from_options({"replay_dtype": args.dtype}, where="replay_pairs")
        impl = make_impl("moeverify")
        impl.apply()
        setup = st.make_setup(ctx, opts, impl, VARIANTS["default"], views.rank_coords(Layout(), rank=0, world_size=1))
        chunks = st.build(setup, Layout(), overrides=impl.overrides())
        impl.bind(chunks)
        items, seq = setup.items, setup.batches.seq_len

        def plain():
            return rd.run_pass(chunks, items, seq_len=seq, forward_only=False)

        plain1, plain2 = plain(), plain()
        routes = rd.record_pass(chunks, items, seq_len=seq, impl=impl).routes
        replay1 = rd.replay_pass(chunks, items, seq_len=seq, impl=impl, routes=routes)
        replay2 = rd.replay_pass(chunks, items, seq_len=seq, impl=impl, routes=routes)
        plain3 = plain()
        nograd_order = slot_order.reference_pass(chunks, plain)
        pairs = [
            ("plain 1 vs plain 2", plain1, plain2),
            ("plain 1 vs plain 3", plain1, plain3),
            ("replay 1 vs replay 2", replay1, replay2),
            ("plain 1 vs replay 1", plain1, replay1),
            ("plain 3 vs replay 2", plain3, replay2),
            ("plain 1 vs no-grad slot order", plain1, nograd_order),
        ]
        for name, a, b in pairs:
            t = Tally()
            rc.compare_passes(t, a, b, prefix="")
            print(f"{name}: {t.checked} item(s) checked, {len(t.failures) + t.dropped} failure(s)", flush=True)
            for msg in t.failures[: args.show]:
                print(f"    {msg[:300]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
