"""Grouped runner vs one torchrun per scenario: wall time per scenario, measured in the same run.

The grouped runner pays imports and rendezvous once per world size; the peer starts a torchrun for
every scenario, as a shell loop over scenarios would. Both run the same N 2-rank scenarios with the
same check through the real CLI (``python -m moeverify run``). Writes bench/results/runner.json.

    python bench/runner.py [--check roundtrip] [--scenario NAME ...]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_SCENARIOS = ("qwen2/tp2", "qwen2/pp2", "qwen3_moe/ep2-dp2", "qwen3_moe/pp2")
GOAL = ">=2"


def _run(filters: list[str], *, check: str, scenario_file: str, out: Path) -> tuple[float, int, int]:
    """Wall seconds, exit code and number of passed records of one ``moeverify run``."""
    cmd = [
        sys.executable,
        "-m",
        "moeverify",
        "run",
        scenario_file,
        "--check",
        check,
        "--json",
        str(out),
        "--run-dir",
        str(out.with_suffix("")),
    ]
    for name in filters:
        cmd += ["--filter", name]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    passed = sum(r["passed"] for r in json.loads(out.read_text())) if out.exists() else 0
    if proc.returncode != 0:
        print(proc.stdout[-3000:] + proc.stderr[-3000:], file=sys.stderr)
    return wall, proc.returncode, passed


def measure(names: list[str], *, check: str, scenario_file: str) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        grouped_s, grouped_rc, grouped_ok = _run(
            names, check=check, scenario_file=scenario_file, out=Path(tmp) / "grouped.json"
        )
        separate = [
            _run([n], check=check, scenario_file=scenario_file, out=Path(tmp) / f"one{i}.json")
            for i, n in enumerate(names)
        ]
    separate_s = sum(s for s, _, _ in separate)
    n = len(names)
    all_ok = grouped_rc == 0 and all(rc == 0 for _, rc, _ in separate)
    grouped_per, separate_per = grouped_s / n, separate_s / n
    return {
        "metrics": {
            "runner_wall_per_scenario": {
                "value": round(grouped_per, 2),
                "unit": "s/scenario",
                "peer": round(separate_per, 2),
                "ratio": round(separate_per / grouped_per, 2),
                "goal": GOAL,
            }
        },
        "scenarios": names,
        "check": check,
        "all_passed": all_ok,
        "grouped": {"wall_s": round(grouped_s, 2), "exit_code": grouped_rc, "passed": grouped_ok},
        "one_torchrun_each": {
            "wall_s": [round(s, 2) for s, _, _ in separate],
            "exit_codes": [rc for _, rc, _ in separate],
            "passed": sum(ok for _, _, ok in separate),
        },
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", default="roundtrip")
    parser.add_argument("--scenario", action="append", dest="scenarios", metavar="NAME")
    parser.add_argument("--file", default=str(ROOT / "scenarios/release.yaml"))
    args = parser.parse_args(argv)
    names = args.scenarios or list(DEFAULT_SCENARIOS)
    result = measure(names, check=args.check, scenario_file=args.file)
    m = result["metrics"]["runner_wall_per_scenario"]
    print(f"{'metric':28} {'grouped':>10} {'one each':>10} {'ratio':>7} goal")
    print(f"{'wall per scenario (s)':28} {m['value']:>10.2f} {m['peer']:>10.2f} {m['ratio']:>7.2f} {m['goal']}")
    print(f"{len(names)} x 2-rank scenarios, check {args.check}; all passed: {result['all_passed']}")
    out = ROOT / "bench/results/runner.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out.relative_to(ROOT)}")
    return 0 if result["all_passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
