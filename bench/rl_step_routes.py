"""Benchmark: in-job R3 at the size of a GRPO step, routes handed over with the batch (``injob.add_routes``).

One data-parallel rank's share of a step: ``--prompts`` prompts x ``--group`` responses of ``--seq`` tokens each
(``--prompt-len`` of them the shared prompt), the engine's routes ``[S - 1, L, K]`` per response. Measured in one
process, one run:
- memory: the rank's route table (device bytes, bytes per token) against the same step read whole by every rank
  (the ``r3:DIR`` file source: the whole step's tokens on every rank), and the host bytes the handed-over arrays hold;
- time to hand over (``add_routes``: checks, one host copy) and to build the table (checks, sort, deduplicate, per
  version), the build against native routing of the whole step (every token through every layer's router, as the
  step's log-prob forwards route them: the micro forward's figure times the forwards; a lower bound of those
  forwards' time, so the ratio overstates the build's share);
- a training forward's lookup (token keys of ``[B, S]``, the search, a gather per layer, the found flag) against
  native routing of the same forward (per layer: router logits ``[T, H] x [H, E]`` and Megatron's top-k), as a
  ratio: what replay adds to routing a forward of ``--micro`` responses over all ``--layers`` layers.

Defaults: Qwen3-30B-A3B's routing shape (48 layers, 128 experts, top-8, hidden 2048) and a GRPO step of 512 prompts
x 16 responses x 2k tokens over 64 data-parallel ranks (8 prompts a rank). ``--device cuda --dtype bf16`` on a GPU.
Writes ``bench/results/rl_step_routes.json``.

Legend: B = responses in a forward, S = positions, T = tokens, H = hidden, E = experts, K = top-k, L = layers.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import router_replay as bench  # noqa: E402 (its timer)

RESULTS = Path(__file__).resolve().parent / "results" / "rl_step_routes.json"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    p.add_argument("--layers", type=int, default=48)
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--prompts", type=int, default=8, help="prompts on this rank (512 over 64 DP ranks)")
    p.add_argument("--group", type=int, default=16, help="responses per prompt (GRPO group)")
    p.add_argument("--seq", type=int, default=2048, help="tokens per response, prompt included")
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument(
        "--dp", type=int, default=64, help="data-parallel ranks the step is spread over (for the whole-step figure)"
    )
    p.add_argument("--micro", type=int, default=8, help="responses per training forward")
    p.add_argument("--iters", type=int, default=None)
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    args.iters = args.iters or (20 if args.device == "cuda" else 3)
    return args


def main(argv=None) -> dict:
    import types

    import numpy as np
    import torch

    from moeverify.patches import batch_routes, injob
    from moeverify.patches import token_keys as tk

    args = parse_args(argv)
    device = torch.device(args.device)
    g = np.random.default_rng(0)
    n_seq = args.prompts * args.group
    sequences, routes = [], []
    for _ in range(args.prompts):
        prompt = g.integers(0, 150000, args.prompt_len)
        for _ in range(args.group):
            seq = np.concatenate([prompt, g.integers(0, 150000, args.seq - args.prompt_len)])
            sequences.append(seq)
            # an engine's routes: K distinct experts a row, int16 as vLLM returns them
            first = g.integers(0, args.experts, (args.seq - 1, args.layers, 1))
            routes.append(((first + np.arange(args.topk)) % args.experts).astype(np.int16))
    tokens = n_seq * args.seq
    source = batch_routes.BatchSource(max_tokens=1 << 40)
    batch_routes.attach(source)
    try:
        start = time.perf_counter()
        injob.add_routes(version=0, sequences=sequences, routes=routes, numbering="routers")
        handover_s = time.perf_counter() - start
        host_bytes = sum(
            int(a.nbytes)
            for parts in source._parts.values()
            for p in parts
            for a in p.values()
            if isinstance(a, np.ndarray)
        )
        del routes
        chunk = torch.nn.Linear(1, 1).to(device)
        config = types.SimpleNamespace(
            num_layers=args.layers, moe_layer_freq=1, num_moe_experts=args.experts, moe_router_topk=args.topk
        )
        start = time.perf_counter()
        table = source.table(chunk, layers=list(range(args.layers)), config=config, rank=0)
        if args.device == "cuda":
            torch.cuda.synchronize()
        build_s = time.perf_counter() - start
    finally:
        batch_routes.detach()
    table_bytes = table.nbytes()
    distinct = int(table.keys_2G.shape[1])

    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    micro = torch.from_numpy(np.stack(sequences[: args.micro])).to(device)
    t = micro.numel()
    x_TH = torch.randn(t, args.hidden, device=device, dtype=dtype)
    w_LHE = torch.randn(args.layers, args.hidden, args.experts, device=device, dtype=dtype) * 0.02

    def native():
        for layer in range(args.layers):
            torch.topk(torch.softmax((x_TH @ w_LHE[layer]).float(), dim=-1), args.topk, dim=-1, sorted=True)

    def lookup():
        found = table.lookup(tk.row_keys(micro))
        for layer in range(args.layers):
            table.ids(layer, found)
        table.check(found, layer=0, rank=0)

    timer = bench._timer(args)  # the router-replay benchmark's timer: warm-up, synchronised, mean of --iters
    best = {name: float("inf") for name in ("native", "lookup")}
    for _ in range(5):
        for name, step in (("native", native), ("lookup", lookup)):
            best[name] = min(best[name], timer(step))
    whole_step = tokens * args.dp
    per_token = table_bytes / distinct
    metrics = {
        "table_bytes_per_rank": {
            "value": table_bytes,
            "unit": "bytes",
            "peer": "whole_step_every_rank",
            "ratio": round(table_bytes / (per_token * whole_step), 5),
            "goal": f"<={1 / args.dp:.5f}",
        },  # this rank's share at most
        "whole_step_every_rank": {"value": int(per_token * whole_step), "unit": "bytes"},
        "table_bytes_per_token": {"value": round(per_token, 1), "unit": "bytes"},
        "host_bytes_handed_over": {"value": host_bytes, "unit": "bytes"},
        "handover": {"value": round(handover_s, 3), "unit": "s"},
        "table_build": {
            "value": round(build_s, 3),
            "unit": "s",
            "peer": "native_routing_step",
            "ratio": round(build_s / (best["native"] * tokens / t / 1000), 4),
            # on CPU ranks, where a log-prob forward's routing alone is slow; a GPU routes a step in a blink but
            # its log-prob forwards take far longer than routing, so no goal against routing alone there
            **({"goal": "<=0.1"} if args.device == "cpu" else {}),
        },  # once a step, against the routing alone of the step's log-prob forwards (a lower bound of them)
        "native_routing_step": {"value": round(best["native"] * tokens / t / 1000, 3), "unit": "s"},
        "native_routing_forward": {"value": round(best["native"], 3), "unit": "ms"},
        "lookup_forward": {
            "value": round(best["lookup"], 3),
            "unit": "ms",
            "peer": "native_routing_forward",
            "ratio": round(best["lookup"] / best["native"], 4),
            "goal": "<=0.05",
        },
    }
    result = {
        "args": {k: str(v) for k, v in vars(args).items() if k != "out"},
        "device": _device(),
        "rank_tokens": tokens,
        "distinct_tokens": distinct,
        "micro_tokens": t,
        "metrics": metrics,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))
    return result


def _device() -> str:
    import torch

    if not torch.cuda.is_available():
        return "cpu"
    import subprocess

    driver = (
        subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            check=False,
        )
        .stdout.strip()
        .splitlines()
    )
    return f"{torch.cuda.get_device_name(0)}, driver {driver[0] if driver else '(unknown)'}, CUDA {torch.version.cuda}"


if __name__ == "__main__":
    main()
