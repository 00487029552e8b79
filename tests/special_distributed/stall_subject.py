"""A subject whose last rank stalls before yielding anything (for test_export_stall.py)."""

import time

from moeverify.subjects import sharded


def stalls(ctx):
    if ctx.rank == ctx.world_size - 1:
        time.sleep(float(ctx.options.get("stall_s", 20)))
    yield from sharded(ctx)
