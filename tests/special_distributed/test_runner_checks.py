"""Tiny checks the runner's distributed tests add to the check registry (``tiny_checks_site/sitecustomize.py``).

They exercise the runner, not the oracles: a check that passes after a real collective, one that
fails a subcheck, one that raises on rank 1 (or on the last rank), one that hangs on rank 1, one that SIGKILLs rank 1,
one that sleeps on every rank, and one that reports the options it received. No model is built. (No test functions here:
pytest collects nothing.)
"""

from __future__ import annotations

import os
import signal
import time

import torch
import torch.distributed as dist

from moeverify.oracles.results import Tally

HANG_S = 3600


def _world_sum(ctx) -> int:
    value = torch.tensor([ctx.rank + 1])
    dist.all_reduce(value)
    return int(value.item())


def passing(ctx) -> dict[str, Tally]:
    tally = Tally()
    expected = ctx.world_size * (ctx.world_size + 1) // 2
    tally.check(_world_sum(ctx) == expected, f"rank {ctx.rank}: all_reduce sum != {expected}")
    tally.check(dist.get_world_size() == ctx.scenario.world_size, "world size differs from the scenario's")
    return {"collective": tally}


def failing(ctx) -> dict[str, Tally]:
    tally = Tally()
    _world_sum(ctx)
    tally.fail(f"planted failure seen by rank {ctx.rank}")
    return {"planted": tally}


def raise_on_rank1(ctx) -> dict[str, Tally]:
    _world_sum(ctx)
    if ctx.rank == 1:
        raise ValueError("planted error on rank 1")
    dist.barrier()  # rank 0 waits here until the group is torn down
    return {"unreachable": Tally()}


def raise_on_last_rank(ctx) -> dict[str, Tally]:
    _world_sum(ctx)
    if ctx.rank == ctx.world_size - 1:  # on two nodes: a rank of node 1
        raise ValueError(f"planted error on rank {ctx.rank}")
    dist.barrier()
    return {"unreachable": Tally()}


def hang_on_rank1(ctx) -> dict[str, Tally]:
    _world_sum(ctx)
    if ctx.rank == 1:
        time.sleep(HANG_S)
    dist.barrier()
    return {"unreachable": Tally()}


def sigkill_on_rank1(ctx) -> dict[str, Tally]:
    _world_sum(ctx)
    if ctx.rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)  # no traceback, no stacks: what the OOM killer does
    dist.barrier()
    return {"unreachable": Tally()}


def sleep_long(ctx) -> dict[str, Tally]:
    _world_sum(ctx)
    time.sleep(HANG_S)  # every rank: the test interrupts or kills the parent meanwhile
    return {"unreachable": Tally()}


def echo_options(ctx) -> dict[str, Tally]:
    tally = Tally()
    tally.check(ctx.options.get("subject") == "sharded", f"subject option {ctx.options.get('subject')!r}")
    tally.check(ctx.options.get("replay_impl") == "native", f"replay_impl option {ctx.options.get('replay_impl')!r}")
    return {"options": tally}
