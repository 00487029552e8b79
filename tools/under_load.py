"""Run a command with the CPUs busy: ``--busy N`` processes spinning (``while 1: pass``) beside it for as long as it
runs, each ended by its own pid when the command ends (and by the kernel if this process dies first).

    python tools/under_load.py --busy 4 -- python -m pytest -q -m timing tests/unit

``make test-load`` runs the timing-sensitive unit tests (marker ``timing``) this way: a test that waits on a child,
a thread, a signal or the clock must pass on a loaded host, not only on an idle one (tests/unit/waiting.py).
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from moeverify.runner.lifetime import die_with_parent  # noqa: E402 (the checkout's, beside this file)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--busy", type=int, default=4, help="spinning processes beside the command (default 4)")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND ARGS...")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command or args.busy < 0:
        parser.error("give --busy N (N >= 0) and -- COMMAND")
    spinners = [
        subprocess.Popen([sys.executable, "-c", "while 1: pass"], preexec_fn=lambda: die_with_parent(signal.SIGKILL))
        for _ in range(args.busy)
    ]
    print(
        f"under_load: {args.busy} busy process(es) on {os.cpu_count()} CPU(s): pids "
        f"{' '.join(str(s.pid) for s in spinners)}",
        flush=True,
    )
    t0 = time.monotonic()
    try:
        code = subprocess.call(command)
    finally:
        for s in spinners:
            s.kill()
        for s in spinners:
            s.wait()
    print(f"under_load: exit {code} after {time.monotonic() - t0:.0f} s with {args.busy} busy process(es)", flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
