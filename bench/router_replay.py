"""Benchmark: one MoE layer's router + token dispatch (or the router alone), forward and backward, per replay
implementation.

Variants: ``unpatched`` (Megatron-Core as installed), moeverify ``record`` and ``replay``,
Megatron-Core's native ``RouterReplay`` (record / replay) and verl 0.9.1's ``router_replay_patch``
(record / replay) when it imports. moeverify and native run in one process, interleaved round by round
with one ``unpatched`` baseline (moeverify's patch is reverted while native's variants and the baseline
run), so their ratios share a denominator; replay and record are also timed against native's as adjacent
pairs (``--pairs``: the median of per-pair ratios, free of the host's slower drifts); verl runs in its own process
(it replaces ``TopKRouter`` methods wholesale) with its own same-process baseline.

Dispatch is Megatron's local permutation (``moe_utils.permute`` / ``unpermute`` by the routing map),
what the token dispatchers do around their collectives, so the cost the patch adds is weighed
against a realistic per-layer amount of routing work.

``--scope router`` times ``TopKRouter`` alone (forward + backward of its probs), the replay context
entered once per step as a trainer does; ``--scoring sigmoid`` uses sigmoid scores with expert bias and
group-limited top-k (DeepSeek-V3 style) instead of softmax.

CPU (default): a small realistic shape that runs in well under two minutes.
H200: ``--device cuda --hidden 2048 --experts 128 --topk 8 --tokens 16384 --dtype bf16``.

``moeverify.slot_order`` times the slot order alone (``canonical_ids`` on ids kept ascending: on a GPU a top-k of
the ``[T, K]`` keys at them; on the CPU their argsort and the native grad-mode top-k where a row ties), as a share of
the unpatched step: what bitwise replay at top-k >= 3 costs; ``moeverify.slot_order.given`` the same with the ids
also given in the scores' own order (a recording replayed on the weights it was recorded with: on the CPU a test
that the scores strictly descend along them, no sort). ``gpu`` in the results names the card and driver.

Writes ``bench/results/router_replay.json``: ``{"metrics": {NAME: {"value", "unit", "peer", "ratio",
"goal"}}}``.

Legend of shape suffixes: T = tokens, H = hidden, E = experts, K = top-k.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

IMPLS = ("moeverify", "verl")  # native runs in moeverify's process
GOALS = {"moeverify.record": "<=1.02", "moeverify.replay": "<=1.00"}
RESULTS = Path(__file__).resolve().parent / "results" / "router_replay.json"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where the layer runs")
    p.add_argument("--hidden", type=int, default=256, metavar="H", help="hidden size")
    p.add_argument("--experts", type=int, default=32, metavar="E", help="routed experts")
    p.add_argument("--topk", type=int, default=8, metavar="K", help="experts per token")
    p.add_argument("--tokens", type=int, default=2048, metavar="T", help="tokens per micro-batch")
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32", help="activation and parameter dtype")
    p.add_argument("--iters", type=int, default=None, help="timed iterations per round (default by device)")
    p.add_argument("--rounds", type=int, default=11, help="interleaved rounds; the fastest round counts")
    p.add_argument(
        "--pairs",
        type=int,
        default=20,
        help="paired blocks per comparison (replay vs native replay, record vs native record): adjacent in time, "
        "in ABBA order; the median of the per-pair ratios is reported with its quartiles",
    )
    p.add_argument(
        "--scope",
        choices=("layer", "router"),
        default="layer",
        help="layer: router + local dispatch; router: TopKRouter alone",
    )
    p.add_argument(
        "--scoring",
        choices=("softmax", "sigmoid"),
        default="softmax",
        help="sigmoid: sigmoid scores + expert bias + group-limited top-k",
    )
    p.add_argument("--impl", choices=IMPLS, help=argparse.SUPPRESS)  # child process: one implementation
    p.add_argument(
        "--out",
        type=Path,
        default=None,
        help="results JSON path (default bench/results/router_replay[_router][_sigmoid].json)",
    )
    args = p.parse_args(argv)
    if args.topk > args.experts:
        p.error(f"--topk {args.topk} exceeds --experts {args.experts}")
    if args.iters is None:
        args.iters = 50 if args.device == "cuda" else 10
    if args.scoring == "sigmoid" and args.experts % 8:
        p.error(f"--scoring sigmoid uses 8 expert groups: --experts {args.experts} is not divisible by 8")
    if args.out is None:
        suffix = ("_router" if args.scope == "router" else "") + ("_sigmoid" if args.scoring == "sigmoid" else "")
        args.out = RESULTS.with_name(f"router_replay{suffix}.json")
    return args


def _config(args, *, native: bool):
    import torch
    from megatron.core.transformer.transformer_config import TransformerConfig

    scoring = (
        {}
        if args.scoring == "softmax"
        else dict(
            moe_router_score_function="sigmoid",
            moe_router_enable_expert_bias=True,
            moe_router_num_groups=8,
            moe_router_group_topk=4,
            moe_router_topk_scaling_factor=2.5,
        )
    )
    return TransformerConfig(
        num_layers=1,
        hidden_size=args.hidden,
        num_attention_heads=8,
        num_moe_experts=args.experts,
        moe_router_topk=args.topk,
        **scoring,
        use_cpu_initialization=True,
        moe_aux_loss_coeff=0.0,
        add_bias_linear=False,
        moe_router_dtype="fp32",
        bf16=args.dtype == "bf16",
        params_dtype=torch.bfloat16 if args.dtype == "bf16" else torch.float32,
        moe_enable_routing_replay=native,
    )


def _router(args, *, native: bool = False):
    import torch
    from megatron.core.transformer.moe.moe_utils import get_default_pg_collection
    from megatron.core.transformer.moe.router import TopKRouter

    torch.manual_seed(0)
    router = TopKRouter(_config(args, native=native), pg_collection=get_default_pg_collection())
    router.set_layer_number(1)
    return router.to(args.device)


def _router_step(router, x_SBH):
    """The router alone, forward and backward."""
    probs_TE, _ = router(x_SBH)
    probs_TE.float().square().mean().backward()


def _layer_step(router, x_SBH):
    """Router + local dispatch + weighted combine, forward and backward."""
    from megatron.core.transformer.moe.moe_utils import permute, unpermute

    if SCOPE[0] == "router":
        return _router_step(router, x_SBH)
    probs_TE, map_TE = router(x_SBH)
    tokens_TH = x_SBH.view(-1, x_SBH.shape[-1])
    num_out = tokens_TH.shape[0] * router.topk
    permuted, _, sorted_indices, _, _ = permute(tokens_TH, map_TE, num_out_tokens=num_out)
    out_TH = unpermute(permuted, sorted_indices, tokens_TH.shape, probs=probs_TE, routing_map=map_TE)
    out_TH.float().square().mean().backward()


def _timer(args):
    import torch

    def run(variant) -> float:
        step, around = variant if isinstance(variant, tuple) else (variant, contextlib.nullcontext)
        with around():
            step()  # warm-up: first call compiles / allocates
            if args.device == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(args.iters):
                step()
            if args.device == "cuda":
                torch.cuda.synchronize()
            return (time.perf_counter() - start) / args.iters * 1e3

    return run


def _input(args):
    import torch

    g = torch.Generator().manual_seed(1)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    return torch.randn(args.tokens, 1, args.hidden, generator=g).to(args.device, dtype).requires_grad_()


def _variants_moeverify(args, x):
    import torch

    from moeverify.patches import router_replay as rr

    router = _router(args)
    rr.apply()
    session = rr.ReplaySession(router)
    with session.record():
        _layer_step(router, x)
    routes = session.routes()

    def record():
        with session.record():
            _layer_step(router, x)

    def replay():
        with session.replay(routes):
            _layer_step(router, x)

    def replay_fidelity():  # the runtime fidelity report on (its cost vs plain replay, same process)
        with session.replay(routes, fidelity=True):
            _layer_step(router, x)

    def replay_agreement():  # the live agreement guard on, one flush per step (its cost vs plain replay)
        from moeverify.patches import agreement

        guard = agreement.guard()
        try:
            with session.replay(routes):
                _layer_step(router, x)
            guard.end_step()
        finally:
            agreement.stop()

    @contextlib.contextmanager
    def reverted():
        rr.revert()
        try:
            yield
        finally:
            rr.apply()

    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    slot_order, slot_order_given = _slot_order_step(args, routes.get(0, 0))
    native = _router(args, native=True)  # Megatron-Core's own RouterReplay, timed with moeverify's patch reverted
    x_holder[:] = [x]
    native_steps = _native_steps(native, RouterReplayAction, routes.get(0, 0).to(torch.int64))
    return {
        "unpatched": (lambda: _layer_step(router, x), reverted),
        "record": record,
        "replay": replay,
        "replay_fidelity": replay_fidelity,
        "replay_agreement": replay_agreement,
        "slot_order": slot_order,
        "slot_order.given": slot_order_given,
        "native.record": (native_steps["record"], reverted),
        "native.replay": (native_steps["replay"], reverted),
    }


def _slot_order_step(args, ids_TK):
    """What the slot order adds to one replayed routing call, two ways: the hook's ``canonical_ids`` on ``[T, K]``
    ids kept ascending once per ``Routes`` (``moeverify.patches.replay_state``: on a GPU one top-k of the ``[T, K]``
    keys at the ids and two gathers; on the CPU an argsort of those keys, and the native grad-mode top-k where a row
    ties), and ``canonical_replay`` given the ids in the scores' own order (a recording replayed on its weights: on
    the CPU a test that they strictly descend, then native replay's gather; on a GPU the same as the first)."""
    import torch

    from moeverify.patches.replay_state import canonical_ids, canonical_replay

    scores_TE = torch.randn(ids_TK.shape[0], args.experts, generator=torch.Generator().manual_seed(2)).to(args.device)
    topk = ids_TK.shape[1]
    given_TK = scores_TE.topk(topk, dim=1).indices  # the scores' own descending order
    sorted_ids_TK = given_TK.sort(dim=1).values

    def native_topk(scores, topk, num_groups=None, group_topk=None):  # Megatron's plain ``_compute_topk``
        return torch.topk(scores, k=topk, dim=1, sorted=torch.is_grad_enabled())

    def step():
        canonical_ids(scores_TE, sorted_ids_TK, native_topk, topk=topk)

    def given():
        canonical_replay(scores_TE, sorted_ids_TK, native_topk, topk=topk, given_TK=given_TK)

    return step, given


def _native_steps(router, action_enum, ids_TK):
    rep = router.router_replay

    def record():
        rep.set_router_replay_action(action_enum.RECORD)
        _layer_step(router, x_holder[0])
        rep.clear_router_replay_action()

    def replay():
        rep.set_target_indices(ids_TK)
        rep.set_router_replay_action(action_enum.REPLAY_FORWARD)
        _layer_step(router, x_holder[0])
        rep.clear_router_replay_action()
        rep.clear_indices()

    return {"record": record, "replay": replay}


x_holder: list = []
SCOPE = ["layer"]  # set by run_child from --scope


def _variants_verl(args, x):
    from moeverify.oracles.replay.impls import load_verl_router_replay_patch

    plain = _router(args)
    _, map_TE = plain(x)
    ids_TK = map_TE.nonzero()[:, 1].view(map_TE.shape[0], -1)
    module = load_verl_router_replay_patch()
    with contextlib.redirect_stdout(open(os.devnull, "w")):
        module.apply_router_replay_patch()
    router = _router(args, native=True)  # built after the patch: carries verl's RouterReplay
    x_holder[:] = [x]
    # `plain` keeps its instance state but its class methods are verl's now; verl routes natively
    # when no action is set, which is the closest unpatched baseline this process can time.
    return {"unpatched": lambda: _layer_step(plain, x), **_native_steps(router, module.RouterReplayAction, ids_TK)}


def run_child(args) -> dict:
    """Time one implementation's variants and the same-process baseline, interleaved by round."""
    import torch

    from moeverify import runtime
    from moeverify.spec.layout import Layout

    if args.device == "cpu":
        torch.set_num_threads(1)  # one core per process: steadier figures on a shared machine
    SCOPE[0] = args.scope
    runtime.init(args.device)
    with runtime.parallel(Layout(), seed=0):
        x = _input(args)
        variants = {"moeverify": _variants_moeverify, "verl": _variants_verl}[args.impl](args, x)
        timer = _timer(args)
        rounds = {name: [] for name in variants}
        names = list(variants)
        for r in range(args.rounds):
            for name in names[r % len(names) :] + names[: r % len(names)]:  # rotate: no variant always first
                rounds[name].append(timer(variants[name]))
        paired = {
            f"{a}/{b}": _paired(timer, variants[a], variants[b], args.pairs)
            for a, b in PAIRS
            if args.pairs and a in variants and b in variants
        }
    # The fastest round is the one least disturbed by other work on the machine (timeit's rule).
    return {**{name: min(ms) for name, ms in rounds.items()}, "paired": paired}


# Comparisons timed as adjacent pairs: a drift of the host's speed (other work, clocks) slower than one pair cancels
# in each pair's ratio, where the fastest-round rule compares rounds taken minutes apart.
PAIRS = (("replay", "native.replay"), ("record", "native.record"), ("replay", "unpatched"))


def _paired(timer, a, b, pairs: int) -> list[float]:
    """Per-pair ratios a / b, the pair's order alternating (ABBA) so neither side always runs first."""
    ratios = []
    for i in range(pairs):
        if i % 2:
            t_b, t_a = timer(b), timer(a)
        else:
            t_a, t_b = timer(a), timer(b)
        ratios.append(t_a / t_b)
    return ratios


def _quartiles(values: list[float]) -> dict:
    """Median and quartiles of ``values`` (linear interpolation between order statistics)."""
    xs = sorted(values)

    def at(q: float) -> float:
        pos = q * (len(xs) - 1)
        lo = int(pos)
        hi = min(lo + 1, len(xs) - 1)
        return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)

    return {"median": round(at(0.5), 4), "q1": round(at(0.25), 4), "q3": round(at(0.75), 4), "n": len(xs)}


def gpu_info() -> dict | None:
    """The GPU the run used: model, driver, memory (``nvidia-smi``), and torch's view of it; None without CUDA."""
    import torch

    if not torch.cuda.is_available():
        return None
    info = {"name": torch.cuda.get_device_name(), "torch": torch.__version__, "cuda": torch.version.cuda}
    try:
        out = subprocess.run(
            [
                "nvidia-smi",
                "--query-gpu=name,driver_version,memory.total",
                "--format=csv,noheader",
                f"--id={torch.cuda.current_device()}",
            ],
            capture_output=True,
            text=True,
            timeout=30,
        )
        name, driver, memory = (part.strip() for part in out.stdout.strip().splitlines()[0].split(","))
        info.update(nvidia_smi_name=name, driver=driver, memory=memory)
    except (OSError, subprocess.SubprocessError, IndexError, ValueError) as exc:
        info["nvidia_smi_error"] = str(exc)
    return info


def _metric(value, peer, goal):
    return {
        "value": round(value, 4),
        "unit": "ms",
        "peer": round(peer, 4),
        "ratio": round(value / peer, 4),
        "goal": goal,
    }


def run_parent(args) -> dict:
    medians, errors = {}, {}
    for impl in IMPLS:
        cmd = [sys.executable, __file__, "--impl", impl, *sys.argv[1:]]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
        if proc.returncode:
            errors[impl] = (proc.stderr.strip().splitlines() or ["?"])[-1]
            continue
        medians[impl] = json.loads(proc.stdout.strip().splitlines()[-1])
    metrics = {}
    if "moeverify" in medians:
        times = medians["moeverify"]
        metrics["unpatched"] = _metric(times["unpatched"], times["unpatched"], None)
        for name in ("record", "replay", "native.record", "native.replay"):
            key = name if name.startswith("native.") else f"moeverify.{name}"
            metrics[key] = _metric(times[name], times["unpatched"], GOALS.get(key))
        metrics["moeverify.replay_fidelity"] = _metric(times["replay_fidelity"], times["unpatched"], None)
        metrics["moeverify.fidelity_vs_replay"] = _metric(times["replay_fidelity"], times["replay"], None)
        metrics["moeverify.replay_agreement"] = _metric(times["replay_agreement"], times["unpatched"], None)
        metrics["moeverify.agreement_vs_replay"] = _metric(times["replay_agreement"], times["replay"], None)
        # the canonical slot order's own ops, against the unpatched step: the share of it that ordering costs
        metrics["moeverify.slot_order"] = _metric(times["slot_order"], times["unpatched"], None)
        metrics["moeverify.slot_order.given"] = _metric(times["slot_order.given"], times["unpatched"], None)
    if "verl" in medians:
        times = medians["verl"]
        metrics["verl.unpatched"] = _metric(times["unpatched"], times["unpatched"], None)
        for name in ("record", "replay"):
            metrics[f"verl.{name}"] = _metric(times[name], times["unpatched"], None)
    if "moeverify" in medians:
        ours = medians["moeverify"]["replay"] / medians["moeverify"]["unpatched"]
        theirs = medians["moeverify"]["native.replay"] / medians["moeverify"]["unpatched"]
        metrics["moeverify.replay_vs_native"] = {
            "value": round(ours, 4),
            "unit": "ratio to unpatched",
            "peer": round(theirs, 4),
            "ratio": round(ours / theirs, 4),
            "goal": "<=1.02" if args.scope == "router" else "<=1.00",
        }
    paired = {}
    if "moeverify" in medians:
        goals = {"replay/native.replay": "<=1.02" if args.scope == "router" else "<=1.00", "record/native.record": None}
        for name, ratios in medians["moeverify"].pop("paired").items():
            paired[name] = {**_quartiles(ratios), "goal": goals.get(name)}
    shape = {
        k: getattr(args, k)
        for k in (
            "device",
            "hidden",
            "experts",
            "topk",
            "tokens",
            "dtype",
            "iters",
            "rounds",
            "pairs",
            "scope",
            "scoring",
        )
    }
    host = {
        "cpus": os.cpu_count(),
        "load_avg_1m": round(os.getloadavg()[0], 1),
        "threads_per_process": 1 if args.device == "cpu" else None,
    }
    return {
        "metrics": metrics,
        "paired": paired,
        "shape": shape,
        "host": host,
        "gpu": gpu_info() if args.device == "cuda" else None,
        "errors": errors,
    }


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.impl:
        print(json.dumps(run_child(args)))
        return 0
    result = run_parent(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    for name, m in result["metrics"].items():
        print(
            f"{name:28s} {m['value']:10.4f} {m['unit']:20s} peer {m['peer']:10.4f} ratio {m['ratio']:.4f} "
            f"goal {m['goal'] or '-'}"
        )
    for name, q in result["paired"].items():
        print(
            f"paired {name:21s} median {q['median']:.4f} (quartiles {q['q1']:.4f}-{q['q3']:.4f}, {q['n']} pairs) "
            f"goal {q['goal'] or '-'}"
        )
    for impl, err in result["errors"].items():
        print(f"{impl}: not measured: {err}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
