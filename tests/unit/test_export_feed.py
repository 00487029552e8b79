"""ReferenceFeed: the reference export in a thread, gated by rank 0's holdings, errors re-raised on the caller."""

import threading
import time

import pytest
import torch

from moeverify.oracles.export.feed import ReferenceFeed


class _Collector:
    def __init__(self, holds: int = 0):
        self.taken, self.holds = [], holds

    def take_reference(self, name, tensor):
        self.taken.append(name)

    def nbytes(self):
        return self.holds


class _Counting:
    """A reference iterator that records how many tensors were pulled."""

    def __init__(self, items):
        self.items, self.pulled = list(items), 0

    def __iter__(self):
        for item in self.items:
            self.pulled += 1
            yield item


def _items(sizes):
    return [(f"t{i}", torch.zeros(n, dtype=torch.bfloat16)) for i, n in enumerate(sizes)]


def test_export_feed_drains_everything_in_order():
    items = _items([4, 8, 2])
    feed = ReferenceFeed(items, keep=True, numels={n: t.numel() for n, t in items}).start()
    collector = _Collector()
    feed.finish(collector)
    assert collector.taken == ["t0", "t1", "t2"]


@pytest.mark.timing
def test_export_feed_large_holdings_stop_pulls_until_demand():
    items = _items([100, 100, 100])
    ref = _Counting(items)
    feed = ReferenceFeed(ref, keep=True, numels={n: t.numel() for n, t in items})
    feed.report(10**6)  # the main thread holds far more than the gate allows beside an export
    feed.start()
    time.sleep(0.2)
    assert ref.pulled == 0
    collector = _Collector(holds=10**6)
    feed.wait_until(lambda: "t0" in collector.taken, collector)  # demand pulls past the gate
    time.sleep(0.1)
    assert collector.taken == ["t0"] and ref.pulled == 1
    feed.finish(collector)
    assert collector.taken == ["t0", "t1", "t2"]


def test_export_feed_reference_error_is_raised_on_the_caller():
    def broken():
        yield "t0", torch.zeros(2)
        raise RuntimeError("bridge export failed")

    feed = ReferenceFeed(broken(), keep=True, numels={"t0": 2, "t1": 2}).start()
    with pytest.raises(RuntimeError, match="bridge export failed"):
        feed.finish(_Collector())


def test_export_feed_other_ranks_keep_nothing():
    items = _items([4, 4])
    feed = ReferenceFeed(items, keep=False, numels={n: t.numel() for n, t in items}).start()
    feed.finish(None)
    assert not feed._arrived


def test_export_feed_thread_sees_the_callers_torch_function_mode():
    seen = []

    class Mode(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            seen.append(threading.current_thread().name)
            return func(*args, **(kwargs or {}))

    def reference():
        yield "t0", torch.zeros(2) + 1

    with Mode():
        feed = ReferenceFeed(reference(), keep=True, numels={"t0": 2}).start()
    feed.finish(_Collector())
    assert "moeverify-export-reference" in seen
