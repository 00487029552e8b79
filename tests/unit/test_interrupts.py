"""Signals while groups run become a flag raised at the poll loop's safe point (moeverify/runner/interrupts.py)."""

from __future__ import annotations

import signal
import threading

import pytest

from moeverify.runner import interrupts

pytestmark = pytest.mark.timing


def _signal_self(sig) -> None:
    """``sig`` to this (the main) thread: delivered before ``pthread_kill`` returns, and its Python handler run
    before it returns too (``pthread_kill`` checks for signals). ``os.kill`` of the process may be delivered to
    another thread, whose handler a loaded host may not run for a while."""
    signal.pthread_kill(threading.main_thread().ident, sig)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_first_signal_waits_for_check_and_second_raises_at_once(sig):
    before = signal.getsignal(sig)
    with pytest.raises(KeyboardInterrupt):
        with interrupts.deferred():
            _signal_self(sig)  # no exception here, in the middle of whatever the main thread does
            reached = True
            with pytest.raises(KeyboardInterrupt):
                _signal_self(sig)  # a second signal: the loop may be stuck, so it raises now
            interrupts.check()
    assert reached
    assert signal.getsignal(sig) is before


def test_signal_after_the_last_check_still_interrupts_and_flag_is_cleared():
    with pytest.raises(KeyboardInterrupt):
        with interrupts.deferred():
            _signal_self(signal.SIGINT)
    with interrupts.deferred():
        interrupts.check()  # the earlier signal does not leak into a later run
