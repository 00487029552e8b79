"""Run the replay oracles over implementations x MoE families x router variants (and layouts) and
write docs/replay_matrix.md from the records.

    python tools/replay_matrix.py                 # run everything, then render
    python tools/replay_matrix.py --render-only   # re-render from the JSON kept in --work

Each run is ``moeverify run`` on a one-scenario file written to ``--work`` (one implementation per
process: verl's patch replaces TopKRouter methods process-wide). Variant tables run every router
variant on ``--variant-layout`` (2 ranks); layout tables run the ``default`` variant on each layout.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from moeverify.layout import Layout, parse_layout_name  # noqa: E402
from moeverify.oracles.replay.oracle import SUBCHECKS  # noqa: E402
from moeverify.checks import REPLAY_IMPLS  # noqa: E402
from moeverify.router_variants import VARIANTS  # noqa: E402

IMPLS = tuple(REPLAY_IMPLS)
FAMILIES = ("qwen3_moe", "deepseek_v3")
LAYOUTS = (("tp1", 1), ("ep2", 2), ("tp2-sp", 2), ("pp2-vpp2", 2), ("cp2", 2))


FINDINGS = """\
## How the oracles work
Every rank of the layout drives the model through Megatron's own pipeline schedule
(`get_forward_backward_func`) with several micro-batches (3; 4 under PP2 x VPP2), log-prob pass first
(forward only, no grad, routes recorded), training pass second (forward + backward, routes replayed).
Data: seeded token ids per DP rank, labels = next token; loss = mean token cross-entropy (vocab-parallel,
fp32). Models are the tiny `moeverify.models` families in fp32 with dropout off. Router variants
(`moeverify/router_variants.py`) override the family's TransformerConfig at build time.

- **equivalence**: recorded routes == routes the routers took; replayed training pass == plain native
  training pass bit for bit (routing maps, router probs, logits, per-sequence losses, every gradient).
- **drift**: router weights perturbed (seeded, weight-scale noise): native routing must change (else the
  check fails: it would prove nothing); the replayed pass follows the recorded routes for 100% of tokens.
  Per-layer native-vs-replayed agreement (R3's metric) is listed under each variant table.
- **recompute**: full (uniform, 1 layer) and MoE-only (selective `["moe"]`) recompute on perturbed weights:
  gradients == the no-recompute replay bit for bit, each micro-batch recomputed once per layer with its
  forward's routes, and the implementation reports every route consumed.
- **cross_layout**: a 1-rank-layout reference (every rank runs it with dp = world on the global batch)
  records global routes; `moeverify.views.to_local` converts them to each rank's view; replayed under the
  scenario layout they must be followed token for token and give per-sequence losses within rtol 1e-4 /
  atol 1e-4 of the reference (not bitwise: TP, EP, SP and CP change fp32 reduction orders).
- **native_parity**: the implementation's replay vs Megatron-Core's native `RouterReplay` replaying the same
  routes on a second build of the same weights (Megatron's own routing restored while it runs): identical
  routing, probs, logits and gradients. For `native` itself this is a determinism self-check.

Every oracle is shown to fail on a broken implementation (`moeverify/oracles/replay/faulty.py`, tested in
`tests/special_distributed/test_replay_oracle.py`): replaying the wrong micro-batch fails equivalence,
drift, cross_layout and native_parity; routes off by one layer fail drift and native_parity; detached
replay probabilities fail equivalence (router gradients); no replay in recompute fails recompute.

## Findings
**verl 0.9.1 `router_replay_patch`** replaces `TopKRouter.routing` with its own copy of megatron-core's
routing, which on megatron-core 0.19.2
- raises `ValueError: Invalid score_function: sqrtsoftplus` (0.19.2 offers sqrtsoftplus; verl's copy has
  only softmax and sigmoid);
- drops the router's `padding_mask` (accepted through `*args, **kwargs` and ignored), so aux losses and
  expert-bias token counts include padding tokens: with a padding mask its gradients differ from native
  routing (native_parity fails on the `padding` variant; equivalence still passes, because verl agrees
  with itself).

**Megatron-Core 0.19.2 native `RouterReplay`** replays its input without checking it (pinned in
`tests/unit/test_replay_oracle_native_findings.py`); reproduction on CPU, no model needed:
```python
import torch
from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function
from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction
rr = RouterReplay(); rr.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
logits = torch.randn(2, 4)
rr.set_target_indices(torch.tensor([[0, 1]]))          # 1 row for a 2-token call
print(topk_routing_with_score_function(logits, 2, router_replay=rr)[1].sum(1))  # tensor([2, 0])
rr.set_target_indices(torch.tensor([[0, 0], [1, 2]]))  # expert 0 twice
print(topk_routing_with_score_function(logits, 2, router_replay=rr)[1].sum(1))  # tensor([1, 2])
```
- a route table shorter than the router call (a rollout engine's missing last row, R3) silently routes the
  uncovered tokens to no expert at all;
- a duplicate expert id silently routes the token to fewer than top-k experts (verl patches the alltoall
  dispatcher's `num_out_tokens = T * K` for this case);
- out-of-range ids fail only inside `gather` ("index 9 is out of bounds for dimension 1 with size 4" on
  CPU, naming no layer, rank or micro-batch);
- `replay_backward_list` is appended on every `set_target_indices` and popped only by recompute: without
  recompute it grows every step unless the trainer calls `clear_global_indices()`;
- `RouterReplay.global_router_replay_instances` keeps the routers of every model ever built in the process
  (actor + reference, rebuilt decoders): `set_replay_data`/`get_recorded_data` then address the wrong
  routers or refuse with a count mismatch. The oracles address routers through the model instead.

**Megatron-Core 0.19.2 `TopKRouter._apply_expert_bias`** (router.py) computes
`routing_map & (~padding_mask)` with `routing_map` `[T, E]` and the flattened `padding_mask` `[T]`, which lines
the token mask up with the expert axis. With T != E every training forward of a router with expert bias that
is given a padding mask raises ("The size of tensor a (E) must match the size of tensor b (T)"); with
T == E (as many tokens in the router call as experts) it raises nothing and the counts are wrong in every
layer: expert `e` loses its counts whenever token `e` is padding, and padding tokens' experts are counted
(`tests/unit/test_router_replay_counts.py` pins it; `token_counts` fails `native` and `verl` there, T == E with
wrong counts, T != E with the error). moeverify's patch counts per token for the routers its sessions hold
(docs/router_replay.md). Fix: `routing_map & ~padding_mask.unsqueeze(-1)`. Reproduction: any DeepSeek-V3 (sigmoid + expert
bias) MoE layer called with `padding_mask` in training mode, e.g.
`moeverify run` on the scenario `{family: deepseek_v3, world_size: 1, checks: [replay],
options: {replay_impl: native, router_variants: [padding]}}`.

**CPU ranks (gloo)**: with batched p2p (`batch_p2p_comm=True`, Megatron's default) PP2 x VPP2 training
passes exchange activation and gradient messages with the same peer in the wrong order: micro-batches
after the first group compute on another message's tensor (forward-only passes are correct). The
equivalence oracle caught it (recorded log-prob routes differed from the training pass's). The oracles
build with `batch_p2p_comm=False` on CPU.
"""


def _run(work: Path, *, impl: str, family: str, layout: str, nproc: int, variants: str, timeout: int) -> Path:
    tag = f"{impl}__{family}__{layout}__{variants.replace(',', '+')}"
    notes, record, log = work / f"{tag}.notes.json", work / f"{tag}.json", work / f"{tag}.log"
    parsed, _ = parse_layout_name(layout)
    fields = {k: v for k, v in dataclasses.asdict(parsed).items() if v != getattr(Layout(), k)}
    options = {"replay_impl": impl, "replay_notes_path": str(notes),
               "router_variants": "full" if variants == "full" else variants.split(",")}
    scenario = {"family": family, "world_size": nproc, "layout": fields, "checks": ["replay"], "options": options}
    scenario_file = work / f"{tag}.yaml"
    scenario_file.write_text(json.dumps({"version": 1, "scenarios": [scenario]}))  # JSON is YAML
    cmd = [sys.executable, "-m", "moeverify", "run", str(scenario_file), "--json", str(record),
           "--run-dir", str(work / f"{tag}.run"), "--timeout", str(timeout)]
    start = time.monotonic()
    with open(log, "w") as f:
        try:
            rc = subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, timeout=timeout + 180).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    print(f"{tag}: exit {rc} in {time.monotonic() - start:.0f}s", flush=True)
    return notes


def _cell(sub: dict | None) -> str:
    if sub is None:
        return "not run"
    if sub["passed"]:
        return f"pass ({sub['checked']})"
    reason = sub["failures"][0] if sub["failures"] else "failed"
    reason = reason.split(": ", 1)[1] if reason.startswith("rank ") else reason
    reason = reason.split("] ", 1)[1] if reason.startswith("[") else reason  # the row names the variant
    return "**FAIL**: " + reason.replace("|", "\\|").replace("\n", " ")[:220]


def _load(work: Path, *, impl: str, family: str, layout: str, variants: str) -> dict | None:
    path = work / f"{impl}__{family}__{layout}__{variants.replace(',', '+')}.notes.json"
    if path.exists():
        return json.loads(path.read_text())
    record = path.with_name(path.name.replace(".notes.json", ".json"))
    if record.exists():  # the run crashed before writing notes: report its error on every variant
        records = json.loads(record.read_text())  # the runner's list: one record, this scenario's replay
        return {"crashed": (records[0].get("error") if records else None) or "no notes written"}
    return None


def _variant_rows(work: Path, family: str, layout: str) -> list[str]:
    rows = [f"### {family}, layout {layout}: every router variant", "",
            "| variant | impl | " + " | ".join(SUBCHECKS) + " |", "|---|---|" + "---|" * len(SUBCHECKS)]
    for variant in VARIANTS:
        for impl in IMPLS:
            data = _load(work, impl=impl, family=family, layout=layout, variants="full")
            if data is None or "crashed" in (data or {}):
                why = "not run" if data is None else f"**CRASH**: {data['crashed'][:200]}"
                rows.append(f"| {variant} | {impl} | " + " | ".join([why] * len(SUBCHECKS)) + " |")
                continue
            if variant in data.get("not_applicable", {}):
                why = "n/a: " + data["not_applicable"][variant].replace("|", "\\|")
                rows.append(f"| {variant} | {impl} | " + " | ".join([why] + ["n/a"] * (len(SUBCHECKS) - 1)) + " |")
                continue
            subs = data["variants"].get(variant, {}).get("subchecks", {})
            rows.append(f"| {variant} | {impl} | " + " | ".join(_cell(subs.get(s)) for s in SUBCHECKS) + " |")
    return rows + [""]


def _layout_rows(work: Path, family: str) -> list[str]:
    rows = [f"### {family}, default router: every layout", "",
            "| layout | impl | " + " | ".join(SUBCHECKS) + " |", "|---|---|" + "---|" * len(SUBCHECKS)]
    for layout, nproc in LAYOUTS:
        for impl in IMPLS:
            data = _load(work, impl=impl, family=family, layout=layout, variants="default")
            if data is None or "crashed" in data:
                why = "not run" if data is None else f"**CRASH**: {data['crashed'][:200]}"
                rows.append(f"| {layout} ({nproc} rank{"s" if nproc > 1 else ""}) | {impl} | " + " | ".join([why] * len(SUBCHECKS)) + " |")
                continue
            subs = data["variants"].get("default", {}).get("subchecks", {})
            rows.append(f"| {layout} ({nproc} rank{"s" if nproc > 1 else ""}) | {impl} | "
                        + " | ".join(_cell(subs.get(s)) for s in SUBCHECKS) + " |")
    return rows + [""]


def _drift_rows(work: Path, family: str, layout: str) -> list[str]:
    data = _load(work, impl="moeverify", family=family, layout=layout, variants="full")
    if not data or "crashed" in data:
        return []
    rows = [f"Drift (R3 metric), {family} {layout}, rank 0: fraction of tokens whose native top-k set after the "
            "router-weight perturbation equals the replayed one, per MoE layer:", "",
            "| variant | per-layer agreement |", "|---|---|"]
    for variant, entry in data["variants"].items():
        counts = entry.get("notes", {}).get("drift_agreement", {})
        text = ", ".join(f"L{layer}: {s / n:.3f}" for layer, (s, n) in sorted(counts.items(), key=lambda x: int(x[0])))
        rows.append(f"| {variant} | {text or 'n/a'} |")
    return rows + [""]


def render(work: Path, out: Path, *, variant_layout: str, preamble: str) -> None:
    lines = ["# Router replay: oracle x implementation x family x router variant", "",
             f"Generated by `tools/replay_matrix.py` from real runs ({datetime.date.today()}; CPU ranks, gloo, fp32;",
             "megatron-core 0.19.2, verl 0.9.1). Each cell: `pass (items checked)` or the first failure reason;",
             "every rank's failures are in the JSON records. Do not edit by hand: re-run the tool.", "",
             preamble, ""]
    for family in FAMILIES:
        lines += _variant_rows(work, family, variant_layout)
        lines += _drift_rows(work, family, variant_layout)
        lines += _layout_rows(work, family)
    out.write_text("\n".join(lines) + "\n")
    print(f"wrote {out}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", default=str(ROOT / "build" / "replay_matrix"), help="JSON records and logs")
    ap.add_argument("--out", default=str(ROOT / "docs" / "replay_matrix.md"))
    ap.add_argument("--render-only", action="store_true")
    ap.add_argument("--variant-layout", default="ep2", help="2-rank layout of the variant tables")
    ap.add_argument("--skip-layouts", action="store_true", help="only the variant tables")
    ap.add_argument("--skip-variants", action="store_true", help="only the layout tables")
    ap.add_argument("--families", default=None, help="comma-separated subset of the families to run")
    ap.add_argument("--impls", default=None, help="comma-separated subset of the implementations to run")
    ap.add_argument("--timeout", type=int, default=1800)
    args = ap.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    families = args.families.split(",") if args.families else FAMILIES
    impls = args.impls.split(",") if args.impls else IMPLS
    if not args.render_only:
        if not args.skip_variants:
            for family in families:
                for impl in impls:
                    _run(work, impl=impl, family=family, layout=args.variant_layout, nproc=2, variants="full",
                         timeout=args.timeout)
        if not args.skip_layouts:
            for family in families:
                for layout, nproc in LAYOUTS:
                    for impl in impls:
                        _run(work, impl=impl, family=family, layout=layout, nproc=nproc, variants="default",
                             timeout=args.timeout)
    render(work, Path(args.out), variant_layout=args.variant_layout, preamble=FINDINGS)
    return 0


if __name__ == "__main__":
    sys.exit(main())
