"""``moeverify bench [NAME ...]``: run the benchmark scripts of bench/ (each prints its ratios against peers)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from moeverify.commands.common import REPO_ROOT
from moeverify.errors import UsageError


def register(subparsers) -> None:
    p = subparsers.add_parser("bench", help="run benchmark scripts from bench/")
    p.add_argument("names", nargs="*", metavar="NAME", help="bench/NAME.py to run (default: all)")
    p.add_argument("--list", action="store_true", help="list the benchmarks (the NAMEs given, else all)")
    p.set_defaults(func=_cmd_bench)


def _bench_scripts() -> dict[str, Path]:
    folder = REPO_ROOT / "bench"
    return {p.stem: p for p in sorted(folder.glob("*.py")) if not p.name.startswith("_")}


def _cmd_bench(args) -> int:
    scripts = _bench_scripts()
    unknown = [n for n in args.names if n not in scripts]
    if unknown:  # with --list too: a name that is not a benchmark is never ignored
        raise UsageError(f"unknown benchmark(s) {unknown}; available: {', '.join(scripts) or 'none'}")
    if args.list:  # the named ones, or all
        print("\n".join(args.names or scripts) or "(no benchmarks in bench/)")
        return 0
    worst = 0
    for name in args.names or list(scripts):
        print(f"== bench/{name}.py", flush=True)
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(filter(None, (str(REPO_ROOT), os.environ.get("PYTHONPATH")))),
        }
        rc = subprocess.call([sys.executable, str(scripts[name])], cwd=REPO_ROOT, env=env)
        worst = max(worst, 1 if rc else 0)
    return worst
