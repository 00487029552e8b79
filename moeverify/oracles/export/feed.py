"""The reference export in a background thread, overlapped with the collection of the subject's rows.

Every rank iterates ``bridge.export_hf_weights`` (its own collectives on Megatron's groups) in a
``ReferenceFeed`` thread while the main thread runs the oracle's per-row protocol on the oracle's own
gloo group, so the two streams of collectives never share a group. Rank 0 queues every tensor for its
collector; the other ranks queue the tensors their own pieces name, for their local comparison
(``local.py``), and drop the rest at once. Only the main thread touches what is queued.

Memory on rank 0 is gated, not overlapped blindly: the bridge's own export of a tensor briefly holds
about ``TRANSIENT`` times the tensor (gathered shards plus the result), which is the bare export's
peak. The thread starts the next export only while the oracle's holdings (queued references, held
references, open merges) plus ``TRANSIENT`` times the largest reference still to come stay within
``TRANSIENT + SLACK`` times the largest reference; the main thread opens merges during an export in
flight only under the same bound, and otherwise waits for that export to end. When the main thread
waits for a reference it needs, the thread pulls regardless (as a serial oracle would). So a small
tensor's export runs beside the merges, and a large one's beside nothing large. The other ranks'
threads are never gated (a gated thread there could hold back an export that rank 0 waits for while
that rank waits in a row's collective); they bound their holdings by dropping instead.
"""

from __future__ import annotations

import collections
import contextlib
import threading

import torch

TRANSIENT = 2.0  # the bridge's export of a tensor holds about this many copies of it at its peak
SLACK = 0.1  # the oracle's own holdings beside an export in flight, in largest-tensor units


class ReferenceFeed:
    """Iterate ``reference`` in a thread; on the keeping rank queue ``(name, tensor)`` under a memory gate.

    ``numels``: the elements of every reference name expected (checkpoint shapes), for the gate.
    ``gate=False`` (ranks other than 0, which check their pieces locally): the thread never waits, so
    no rank's export can stall another's; it keeps only ``wanted`` names, and hands ``(name, None)``
    instead of a tensor that would take its holdings past the same bound (that name's pieces then
    travel to rank 0 as before).
    """

    def __init__(
        self, reference, *, keep: bool, numels: dict[str, int], gate: bool = True, wanted: set[str] | None = None
    ) -> None:
        self._iter = iter(reference)
        self._keep = keep
        self._gate = gate
        self._wanted = wanted
        self._remaining = dict(numels)
        self._largest = max(numels.values(), default=0)
        self._itemsize = 2  # of the last reference seen: the gate's estimate for those still to come
        self._cond = threading.Condition()
        self._arrived: collections.deque = collections.deque()
        self._queued = 0  # bytes of arrived tensors not yet taken
        self._holdings = 0  # bytes the main thread holds (reported by it)
        self._demand = False  # the main thread waits for a reference: one pull past the gate
        self._draining = False  # after the last row: pull everything
        self._exporting = False
        self._done = False
        self._stop = False
        self._error: BaseException | None = None
        self._thread = threading.Thread(
            target=self._run, args=(thread_context(),), daemon=True, name="moeverify-export-reference"
        )

    def start(self) -> ReferenceFeed:
        self._thread.start()
        return self

    # -- the thread ----------------------------------------------------------------------------
    def _limit(self) -> float:
        return (TRANSIENT + SLACK) * self._largest * self._itemsize

    def _coming(self) -> float:
        return TRANSIENT * max(self._remaining.values(), default=0) * self._itemsize

    def _room(self) -> bool:
        if not self._keep or self._draining or not self._gate:
            return True
        return self._holdings + self._queued + self._coming() <= self._limit()

    def _run(self, context) -> None:
        with context():
            while True:
                with self._cond:
                    while not (self._stop or self._demand or self._room()):
                        self._cond.wait()
                    if self._stop:
                        return
                    self._exporting = True
                try:
                    item = next(self._iter, None)
                except BaseException as exc:  # re-raised on the main thread
                    with self._cond:
                        self._error, self._done, self._exporting = exc, True, False
                        self._cond.notify_all()
                    return
                with self._cond:
                    self._exporting = False
                    self._demand = False  # one delivery per demand: the main thread asks again if needed
                    if item is None:
                        self._done = True
                        self._cond.notify_all()
                        return
                    name, tensor = item
                    self._remaining.pop(name, None)
                    self._itemsize = tensor.element_size()
                    if self._keep and not self._gate:
                        if self._wanted is not None and name not in self._wanted:
                            pass  # not compared on this rank: dropped at once
                        elif self._holdings + self._queued + _nbytes(tensor) > self._limit():
                            self._arrived.append((name, None))  # over the bound: its pieces travel
                        else:
                            self._arrived.append(item)
                            self._queued += _nbytes(tensor)
                    elif self._keep:
                        self._arrived.append(item)
                        self._queued += _nbytes(tensor)
                    del item, tensor
                    self._cond.notify_all()

    # -- the main thread -----------------------------------------------------------------------
    def _take(self, collector) -> None:
        """Hand what arrived to the collector (outside the lock); report the new holdings."""
        while True:
            with self._cond:
                if not self._arrived:
                    return
                name, tensor = self._arrived.popleft()
                self._queued -= _nbytes(tensor)
            collector.take_reference(name, tensor)
            del tensor
            self.report(collector.nbytes())

    def report(self, holdings: int) -> None:
        """The main thread's holdings changed (merges opened or dropped, references held or checked)."""
        with self._cond:
            self._holdings = holdings
            self._cond.notify_all()

    def wait_until(self, ready, collector) -> None:
        """Pull (past the gate) until ``ready()`` or the reference is exhausted; the collector takes each."""
        while True:
            self._take(collector)
            if ready():
                return
            with self._cond:
                if self._error is not None:
                    raise self._error
                if self._done and not self._arrived:
                    return
                self._demand = True
                self._cond.notify_all()
                while not (self._arrived or self._done or self._error is not None):
                    self._cond.wait()

    def admit(self, extra: int) -> None:
        """Before the main thread allocates ``extra`` bytes: wait out an export that would not fit beside them."""
        if not self._keep or not self._gate or not extra:
            return
        with self._cond:
            while self._exporting and self._holdings + self._queued + extra + self._coming() > self._limit():
                self._cond.wait()

    def finish(self, collector) -> None:
        """Drain the rest of the reference (every rank), the collector taking each tensor; join the thread."""
        with self._cond:
            self._draining = True
            self._cond.notify_all()
        while True:
            if collector is not None:
                self._take(collector)
            with self._cond:
                if self._error is not None:
                    raise self._error
                if self._done and not self._arrived:
                    break
                if not self._arrived:
                    self._cond.wait_for(lambda: self._arrived or self._done or self._error is not None)
                elif collector is None:
                    self._arrived.clear()
        self._thread.join()

    def close(self) -> None:
        """After a failure on the main thread: stop pulling (a pull in flight ends with its collectives)."""
        with self._cond:
            self._stop = True
            self._arrived.clear()
            self._cond.notify_all()


def _nbytes(tensor: torch.Tensor | None) -> int:
    return 0 if tensor is None else tensor.numel() * tensor.element_size()


def thread_context():
    """What the export needs from the calling thread: its torch function modes, grad mode and CUDA device."""
    modes = list(torch.overrides._get_current_function_mode_stack())
    grad = torch.is_grad_enabled()
    device = torch.cuda.current_device() if torch.cuda.is_available() and torch.cuda.is_initialized() else None

    @contextlib.contextmanager
    def context():
        with contextlib.ExitStack() as stack:
            if device is not None:
                torch.cuda.set_device(device)
            stack.enter_context(torch.set_grad_enabled(grad))
            for mode in modes:
                stack.enter_context(mode)
            yield

    return context
