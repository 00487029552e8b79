"""Run the replay oracles over implementations x MoE families x router variants (and layouts) and
write docs/replay_matrix.md from the records (its hand-written sections, from "How the oracles work" to the first
table, are kept from the page as it is; the bug-class table in them is rendered from ``moeverify.spec.bug_classes``).

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

from moeverify.oracles.replay.oracle import SUBCHECKS  # noqa: E402
from moeverify.spec.bug_classes import with_table  # noqa: E402
from moeverify.spec.checks import REPLAY_IMPLS  # noqa: E402
from moeverify.spec.layout import Layout, parse_layout_name  # noqa: E402
from moeverify.spec.router_variants import VARIANTS  # noqa: E402

IMPLS = tuple(REPLAY_IMPLS)
FAMILIES = ("qwen3_moe", "deepseek_v3")
LAYOUTS = (("tp1", 1), ("ep2", 2), ("tp2-sp", 2), ("pp2-vpp2", 2), ("cp2", 2))


def preamble(page: Path) -> str:
    """The hand-written part of ``page`` (from "## How the oracles work" to the first generated table), kept as it
    is, with its bug-class table rendered anew from ``moeverify.spec.bug_classes``."""
    text = page.read_text()
    start, stop = text.find("## How the oracles work"), text.find("\n### ")
    if start < 0 or stop < start:
        raise SystemExit(f"{page}: no '## How the oracles work' section before the first '### ' table to keep")
    return with_table(text[start:stop], "replay").rstrip("\n")


def _run(work: Path, *, impl: str, family: str, layout: str, nproc: int, variants: str, timeout: int) -> Path:
    tag = f"{impl}__{family}__{layout}__{variants.replace(',', '+')}"
    notes, record, log = work / f"{tag}.notes.json", work / f"{tag}.json", work / f"{tag}.log"
    parsed, _ = parse_layout_name(layout)
    fields = {k: v for k, v in dataclasses.asdict(parsed).items() if v != getattr(Layout(), k)}
    options = {
        "replay_impl": impl,
        "replay_notes_path": str(notes),
        "router_variants": "full" if variants == "full" else variants.split(","),
    }
    scenario = {"family": family, "world_size": nproc, "layout": fields, "checks": ["replay"], "options": options}
    scenario_file = work / f"{tag}.yaml"
    scenario_file.write_text(json.dumps({"version": 1, "scenarios": [scenario]}))  # JSON is YAML
    cmd = [
        sys.executable,
        "-m",
        "moeverify",
        "run",
        str(scenario_file),
        "--json",
        str(record),
        "--run-dir",
        str(work / f"{tag}.run"),
        "--timeout",
        str(timeout),
    ]
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
    rows = [
        f"### {family}, layout {layout}: every router variant",
        "",
        "| variant | impl | " + " | ".join(SUBCHECKS) + " |",
        "|---|---|" + "---|" * len(SUBCHECKS),
    ]
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
    rows = [
        f"### {family}, default router: every layout",
        "",
        "| layout | impl | " + " | ".join(SUBCHECKS) + " |",
        "|---|---|" + "---|" * len(SUBCHECKS),
    ]
    for layout, nproc in LAYOUTS:
        for impl in IMPLS:
            data = _load(work, impl=impl, family=family, layout=layout, variants="default")
            if data is None or "crashed" in data:
                why = "not run" if data is None else f"**CRASH**: {data['crashed'][:200]}"
                rows.append(
                    f"| {layout} ({nproc} rank{'s' if nproc > 1 else ''}) | {impl} | "
                    + " | ".join([why] * len(SUBCHECKS))
                    + " |"
                )
                continue
            subs = data["variants"].get("default", {}).get("subchecks", {})
            rows.append(
                f"| {layout} ({nproc} rank{'s' if nproc > 1 else ''}) | {impl} | "
                + " | ".join(_cell(subs.get(s)) for s in SUBCHECKS)
                + " |"
            )
    return rows + [""]


def _drift_rows(work: Path, family: str, layout: str) -> list[str]:
    data = _load(work, impl="moeverify", family=family, layout=layout, variants="full")
    if not data or "crashed" in data:
        return []
    rows = [
        f"Drift (R3 metric), {family} {layout}, rank 0: fraction of tokens whose native top-k set after the "
        "router-weight perturbation equals the replayed one, per MoE layer:",
        "",
        "| variant | per-layer agreement |",
        "|---|---|",
    ]
    for variant, entry in data["variants"].items():
        counts = entry.get("notes", {}).get("drift_agreement", {})
        text = ", ".join(f"L{layer}: {s / n:.3f}" for layer, (s, n) in sorted(counts.items(), key=lambda x: int(x[0])))
        rows.append(f"| {variant} | {text or 'n/a'} |")
    return rows + [""]


def render(work: Path, out: Path, *, variant_layout: str, preamble: str) -> None:
    lines = [
        "# Router replay: oracle x implementation x family x router variant",
        "",
        f"Generated by `tools/replay_matrix.py` from real runs ({datetime.date.today()}; CPU ranks, gloo, fp32;",
        "megatron-core 0.19.2, verl 0.9.1). Each cell: `pass (items checked)` or the first failure reason;",
        "every rank's failures are in the JSON records. Do not edit the tables by hand: re-run the tool (it keeps",
        "the sections above them as written and renders their bug-class table from `moeverify/spec/bug_classes.py`).",
        "",
        preamble,
        "",
    ]
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
                    _run(
                        work,
                        impl=impl,
                        family=family,
                        layout=args.variant_layout,
                        nproc=2,
                        variants="full",
                        timeout=args.timeout,
                    )
        if not args.skip_layouts:
            for family in families:
                for layout, nproc in LAYOUTS:
                    for impl in impls:
                        _run(
                            work,
                            impl=impl,
                            family=family,
                            layout=layout,
                            nproc=nproc,
                            variants="default",
                            timeout=args.timeout,
                        )
    render(work, Path(args.out), variant_layout=args.variant_layout, preamble=preamble(Path(args.out)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
