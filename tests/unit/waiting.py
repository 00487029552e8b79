"""Waiting in tests without betting on the host's speed.

A test that needs something to have happened (a child started, a process gone) waits for it, polling, up to
``SLOW_HOST_S``: far more than it takes on an idle host (a fraction of a second to a few seconds) and more than a
loaded one needs (``make test-load``: four busy processes on two cores). A bound that separates two outcomes (a
kill at the deadline, not at the end of a child's own sleep) leaves the same room.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

SLOW_HOST_S = 120.0
# A child Python that imports torch (and megatron) and runs a small job: seconds to a minute on an idle host, several
# minutes at a load average of 10-25 on two cores. Only a hang guard: a passing test never waits for it.
CHILD_S = 900.0


def wait_for(ready: Callable[[], bool], *, what: str, within_s: float = SLOW_HOST_S, every_s: float = 0.05) -> float:
    """Poll ``ready`` until it is true; its seconds. ``AssertionError`` naming ``what`` after ``within_s``."""
    t0 = time.monotonic()
    while not ready():
        if time.monotonic() - t0 > within_s:
            raise AssertionError(f"{what}: not within {within_s:.0f} s")
        time.sleep(every_s)
    return time.monotonic() - t0


def alive(pid: int) -> bool:
    """Whether process ``pid`` exists and is not a zombie (one that ended, not yet reaped by its parent)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, IndexError):
        return False
