"""runtime.parallel() on a 1-rank gloo world: state set inside, destroyed after, outer layout restored."""

import os
import subprocess
import sys

_DIST_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")

SCRIPT = r"""
from megatron.core import parallel_state as ps
from moeverify import runtime
from moeverify.layout import Layout
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


def test_runtime_parallel_nests_and_restores_outer_layout():
    env = {k: v for k, v in os.environ.items() if k not in _DIST_ENV}  # a fresh 1-rank world, not the worker's
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0 and out.stdout.strip().endswith("OK"), out.stderr[-3000:]
