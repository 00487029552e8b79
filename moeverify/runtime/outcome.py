"""Agreeing across ranks on how a step ended, without a collective a failed rank may never join.

A step that every rank runs (a replay subcheck, say) can raise on all ranks alike (a refusal that
depends only on configuration shared by every rank) or on one rank alone (a crash). The first is a
result; the second leaves the other ranks waiting in a collective the failed rank has left, until
the collective timeout. ``agree`` tells them apart through the process group's key-value store,
which needs no peer to be inside the same collective:

- every rank posts ``ok`` or its error under a key numbered by the step's sequence number (every
  rank calls ``agree`` in the same order, so the numbers line up);
- a rank that raised waits ``AGREE_TIMEOUT_S`` for the others; one that did not waits the
  collective timeout (a failed rank posts at once, so that wait is short);
- all ranks raised: ``agree`` returns (the caller records the error as a result);
- some raised: every rank that can see it raises ``RankDisagreement`` naming the ranks;
- a raising rank that does not hear from every peer in time raises ``RankDisagreement`` naming the
  silent ranks; ending that rank lets torchrun end the group, instead of the timeout.

Assumes torch's default-group store accessor ``distributed_c10d._get_default_store`` (torch 2.11 to
2.14); without it ``agree`` raises ``EnvironmentProblem`` rather than skip the agreement.
"""

from __future__ import annotations

import datetime
import itertools

import torch.distributed as dist
from torch.distributed import distributed_c10d

from moeverify.errors import EnvironmentProblem, RankDisagreement
from moeverify.spec import timeouts

_steps = itertools.count()
_OK = "ok"


def __getattr__(name: str) -> float:
    """``AGREE_TIMEOUT_S``: the public name of ``timeouts.AGREE_S``, read when used (never at import)."""
    if name == "AGREE_TIMEOUT_S":
        return timeouts.AGREE_S
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _store():
    get = getattr(distributed_c10d, "_get_default_store", None)
    if get is None:
        raise EnvironmentProblem(
            "torch.distributed.distributed_c10d._get_default_store is gone (torch 2.11 to 2.14 "
            "have it); moeverify.runtime.outcome needs the default group's store"
        )
    return get()


def agree(error: BaseException | None, *, what: str, wait_s: float | None = None) -> None:
    """Every rank reports whether ``what`` raised on it (``error``); raise where the ranks differ.

    Returns when no rank raised or every rank did. A 1-rank or non-distributed run returns at once.
    """
    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() == 1:
        return

    store, rank, world, step = _store(), dist.get_rank(), dist.get_world_size(), next(_steps)
    keys = [f"moeverify/agree/{step}/{r}" for r in range(world)]
    mine = _OK if error is None else (f"{type(error).__name__}: {error}"[:400] or type(error).__name__)
    store.set(keys[rank], mine)
    wait = wait_s if wait_s is not None else (timeouts.AGREE_S if error is not None else timeouts.COLLECTIVE_S)
    try:
        store.wait(keys, datetime.timedelta(seconds=wait))
    except Exception:  # noqa: BLE001 (the store's timeout: DistStoreError, a RuntimeError subclass, by version)
        silent = [r for r in range(world) if not store.check([keys[r]])]
        raise RankDisagreement(
            f"{what}: rank {rank} raised {mine}; rank(s) {silent} did not end this step within {wait:g} s "
            f"(waiting in a collective rank {rank} left, or still running): a one-rank error, not a result "
            f"shared by every rank"
        ) from error
    outcomes = {r: store.get(keys[r]).decode() for r in range(world)}
    failed = {r: v for r, v in outcomes.items() if v != _OK}
    if failed and len(failed) < world:
        first = min(failed)
        raise RankDisagreement(
            f"{what}: rank(s) {sorted(failed)} raised (rank {first}: {failed[first]}), rank(s) "
            f"{sorted(set(outcomes) - set(failed))} did not: a one-rank error, not a result shared by every rank"
        ) from error
