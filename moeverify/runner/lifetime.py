"""Processes that never outlive the one that started them.

The parent runs torchrun in a session of its own (so the group can be killed as one), which also takes
torchrun out of the reach of a terminal's Ctrl-C. If the parent itself is killed (SIGKILL, OOM killer),
nothing would stop torchrun and its ranks from running on to the end of their plan. Linux's parent-death
signal closes that gap: torchrun gets SIGTERM when the parent dies (it then stops its ranks), and each
rank gets SIGKILL when torchrun dies.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

_PR_SET_PDEATHSIG = 1  # linux/prctl.h
# Loaded at import, in the parent: after a fork in a threaded parent (preexec_fn) only async-signal-safe
# work is safe, and dlopen is not.
_LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None


def die_with_parent(sig: int = signal.SIGTERM) -> None:
    """Ask the kernel to send ``sig`` to this process when its parent exits (Linux; elsewhere a no-op).

    Call it in the child (``preexec_fn``, or first thing in the child's main). If the parent is already
    gone when this runs, the child exits at once.
    """
    if _LIBC is None:
        return
    parent = os.getppid()
    if _LIBC.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        return  # not fatal: only the orphan guard is lost
    if os.getppid() != parent or parent == 1:
        os._exit(128 + int(sig))
