"""runtime.parallel() on a 1-rank gloo world: state set inside, destroyed after, outer layout restored."""

import os
import subprocess
import sys

import pytest
from waiting import CHILD_S

_DIST_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")

SCRIPT = r"""
from megatron.core import parallel_state as ps
from moeverify import runtime
from moeverify.spec.layout import Layout
from moeverify.errors import LayoutError
rt = runtime.init("cpu")
assert rt.world_size == 1 and rt.dist_backend == "gloo"
assert runtime.init("auto") is rt  # idempotent
with runtime.parallel(Layout(), seed=3):
    outer_group = ps.get_tensor_model_parallel_group()
    with runtime.parallel(Layout(), seed=4):
        assert ps.model_parallel_is_initialized()
    assert ps.model_parallel_is_initialized(), "outer layout not restored"
    assert ps.get_tensor_model_parallel_world_size() == 1
try:
    with runtime.parallel(Layout(tp=2)):
        raise AssertionError("tp2 on one rank accepted")
except LayoutError as e:
    assert "world_size 1 is not divisible by tp*pp*cp" in str(e), e
assert not ps.model_parallel_is_initialized()
print("OK")
"""


@pytest.mark.timing
def test_runtime_parallel_nests_and_restores_outer_layout():
    env = {k: v for k, v in os.environ.items() if k not in _DIST_ENV}  # a fresh 1-rank world, not the worker's
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=CHILD_S, env=env)
    assert out.returncode == 0 and out.stdout.strip().endswith("OK"), out.stderr[-3000:]


GROUPS_SCRIPT = r"""
import os
import torch.distributed as dist
from torch.distributed import distributed_c10d
from megatron.core import parallel_state as ps
from moeverify import runtime
from moeverify.spec.layout import Layout
from moeverify.oracles.export.wire import control_group
runtime.init("cpu")
def threads():
    return len(os.listdir("/proc/self/task"))
def groups():
    return len(distributed_c10d._world.pg_map)
def settled_threads(target=None):
    # a destroyed gloo group's threads exit on their own time (a loaded host): the fewest seen while waiting up to
    # 10 s for the first pass's count; a leak keeps the count above it however long the wait
    import time
    fewest, deadline = threads(), time.monotonic() + (10 if target is not None else 1)
    while time.monotonic() < deadline and (target is None or fewest > target):
        time.sleep(0.05)
        fewest = min(fewest, threads())
    return fewest
base_groups, counts = groups(), []
for _ in range(4):
    with runtime.parallel(Layout(), seed=0):
        dist.all_reduce(__import__("torch").ones(1), group=ps.get_tensor_model_parallel_group())
        kept = control_group(60)
        with runtime.parallel(Layout(), seed=1):
            pass
        inner = groups()
        dist.all_reduce(__import__("torch").ones(1), group=ps.get_data_parallel_group())
    counts.append((groups(), settled_threads(counts[0][1] if counts else None)))
assert inner > base_groups + 5, ("megatron made fewer groups than expected", base_groups, inner)
assert counts[0][0] == base_groups + 1, ("groups left after parallel() (only the kept control group may stay)",
                                         base_groups, counts)
assert len(set(counts)) == 1, ("groups or threads grow from one parallel() to the next", counts)
assert kept in distributed_c10d._world.pg_map, "the kept control group was destroyed"
print("OK", base_groups, inner, counts)
"""


@pytest.mark.timing
def test_runtime_parallel_destroys_the_groups_it_made():
    # Megatron-Core's destroy_model_parallel only drops references; every gloo group left alive holds
    # its own threads, and a release run grew to 2,700 threads per rank until collectives timed out.
    env = {k: v for k, v in os.environ.items() if k not in _DIST_ENV}
    out = subprocess.run(
        [sys.executable, "-c", GROUPS_SCRIPT], capture_output=True, text=True, timeout=CHILD_S, env=env
    )
    assert out.returncode == 0 and out.stdout.strip().startswith("OK"), out.stdout[-2000:] + out.stderr[-3000:]


def test_oracle_runtime_runs_megatrons_compiled_fusions_eagerly(patched_megatron_world):
    """megatron-core's jit_fuser (torch.compile) recompiles per grad mode and shape and falls back to eager past
    dynamo's cache limit: oracle processes run every compiled function eagerly, so passes stay bitwise equal."""
    import torch
    import torch._dynamo.utils as dynamo_utils

    @torch.compile(backend="eager")
    def fused(x):
        return torch.sin(x) * 2

    before = dynamo_utils.counters["frames"]["total"]
    x = torch.randn(5)
    assert torch.equal(fused(x), torch.sin(x) * 2)
    assert dynamo_utils.counters["frames"]["total"] == before  # no frame was handed to dynamo
