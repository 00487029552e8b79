"""Ctrl-C and SIGTERM while groups run: a flag read at safe points, not an exception at any bytecode.

A ``KeyboardInterrupt`` raised asynchronously can land between a lock's acquire and the ``try`` that
releases it (rich's console lock while a progress line prints, for one); the refresh thread then waits on
that lock forever and the run ignores the Ctrl-C. Inside :func:`deferred` the first SIGINT or SIGTERM only
sets a flag; the parent's poll loop calls :func:`check`, which raises ``KeyboardInterrupt`` there, outside
any lock, and the usual unwinding kills torchrun's group. A second signal raises at once (the loop may
be stuck), so the run always ends.
"""

from __future__ import annotations

import contextlib
import signal
import threading

_requested = threading.Event()


def _defer(signum, frame) -> None:
    if _requested.is_set():
        raise KeyboardInterrupt
    _requested.set()


def check() -> None:
    """Raise ``KeyboardInterrupt`` if a signal arrived since :func:`deferred` began."""
    if _requested.is_set():
        raise KeyboardInterrupt


@contextlib.contextmanager
def deferred():
    """SIGINT and SIGTERM set the flag :func:`check` reads (main thread only; a no-op elsewhere)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    _requested.clear()
    previous = {sig: signal.signal(sig, _defer) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
        check()  # a signal that came after the last poll still ends the run as interrupted
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        _requested.clear()
