"""Run the replay oracles over implementations x MoE families x router variants (and layouts) and
write docs/replay_matrix.md from the records.

    python tools/replay_matrix.py                 # run everything, then render
    python tools/replay_matrix.py --render-only   # re-render from the JSON kept in --work

Each run is ``python -m torch.distributed.run -m moeverify.oracles.replay_main`` (one implementation
per process: verl's patch replaces TopKRouter methods process-wide). Variant tables run every router
variant on ``--variant-layout`` (2 ranks); layout tables run the ``default`` variant on each layout.
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from moeverify.oracles.replay import SUBCHECKS  # noqa: E402
from moeverify.oracles.replay_variants import VARIANTS  # noqa: E402

IMPLS = ("moeverify", "native", "verl")
FAMILIES = ("qwen3_moe", "deepseek_v3")
LAYOUTS = (("tp1", 1), ("ep2", 2), ("tp2-sp", 2), ("pp2-vpp2", 2), ("cp2", 2))


def _run(work: Path, *, impl: str, family: str, layout: str, nproc: int, variants: str, timeout: int) -> Path:
    tag = f"{impl}__{family}__{layout}__{variants.replace(',', '+')}"
    notes, record, log = work / f"{tag}.notes.json", work / f"{tag}.json", work / f"{tag}.log"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
           "-m", "moeverify.oracles.replay_main", f"{family}/{layout}", "--impl", impl, "--variants", variants,
           "--json", str(record), "--notes", str(notes)]
    start = time.monotonic()
    with open(log, "w") as f:
        try:
            rc = subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, timeout=timeout).returncode
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
    return "**FAIL**: " + reason.replace("|", "\\|").replace("\n", " ")[:220]


def _load(work: Path, *, impl: str, family: str, layout: str, variants: str) -> dict | None:
    path = work / f"{impl}__{family}__{layout}__{variants.replace(',', '+')}.notes.json"
    if path.exists():
        return json.loads(path.read_text())
    record = path.with_name(path.name.replace(".notes.json", ".json"))
    if record.exists():  # the run crashed before writing notes: report its error on every variant
        data = json.loads(record.read_text())
        return {"crashed": data.get("error") or "no notes written"}
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
                rows.append(f"| {layout} ({nproc} rank) | {impl} | " + " | ".join([why] * len(SUBCHECKS)) + " |")
                continue
            subs = data["variants"].get("default", {}).get("subchecks", {})
            rows.append(f"| {layout} ({nproc} rank) | {impl} | "
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
    ap.add_argument("--timeout", type=int, default=1800)
    ap.add_argument("--preamble", default=str(ROOT / "docs" / "replay_matrix_notes.md"),
                    help="hand-written findings included verbatim before the tables")
    args = ap.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    if not args.render_only:
        for family in FAMILIES:
            for impl in IMPLS:
                _run(work, impl=impl, family=family, layout=args.variant_layout, nproc=2, variants="full",
                     timeout=args.timeout)
        if not args.skip_layouts:
            for family in FAMILIES:
                for layout, nproc in LAYOUTS:
                    for impl in IMPLS:
                        _run(work, impl=impl, family=family, layout=layout, nproc=nproc, variants="default",
                             timeout=args.timeout)
    pre = Path(args.preamble)
    render(work, Path(args.out), variant_layout=args.variant_layout, preamble=pre.read_text() if pre.exists() else "")
    return 0


if __name__ == "__main__":
    sys.exit(main())
