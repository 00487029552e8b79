"""Each CPU redirection of moeverify.runtime.cpu, and that uninstall() restores every original."""

import pytest
import torch
from waiting import CHILD_S

from moeverify.runtime import cpu


@pytest.fixture
def installed():
    was = cpu.installed()
    cpu.install()
    yield
    if not was:
        cpu.uninstall()


def test_cpu_current_device_is_a_cpu_device(installed):
    assert torch.empty(2, device=torch.cuda.current_device()).device.type == "cpu"


@pytest.mark.parametrize("device", ["cuda", "cuda:0", 0, torch.device("cuda", 0)])
def test_cpu_factories_rewrite_cuda_devices(installed, device):
    assert torch.zeros(3, device=device).device.type == "cpu"
    assert torch.arange(4, device=device).device.type == "cpu"


def test_cpu_tensor_cuda_and_to_stay_on_cpu(installed):
    t = torch.ones(2)
    assert t.cuda() is t
    assert t.to("cuda").device.type == "cpu"
    assert t.to(device="cuda:0", dtype=torch.float64).dtype == torch.float64
    assert t.to(torch.float16).dtype == torch.float16  # dtype-only .to untouched
    assert torch.empty(2, pin_memory=True).device.type == "cpu"


def test_cpu_streams_and_events_are_null_objects(installed):
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        torch.cuda.current_stream().wait_stream(stream)
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    event.synchronize()
    assert event.query() and stream.query()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.set_device(0)


def test_cpu_rng_state_maps_to_cpu_generator(installed):
    torch.cuda.manual_seed(123)
    state = torch.cuda.get_rng_state()
    a = torch.rand(4)
    torch.cuda.set_rng_state(state)
    assert torch.equal(torch.rand(4), a)
    torch.manual_seed(123)
    assert torch.equal(torch.rand(4), a)


def test_cpu_megatron_rng_tracker_forks_cpu_rng(installed):
    from megatron.core.tensor_parallel import random as mp_random

    tracker = mp_random.get_cuda_rng_tracker()
    tracker.reset()
    tracker.add("moeverify-test", 7)
    torch.manual_seed(0)
    outside = torch.rand(3)
    torch.manual_seed(0)
    with tracker.fork("moeverify-test"):
        inside = torch.rand(3)
    after = torch.rand(3)  # the default stream continues as if the fork never happened
    assert not torch.equal(inside, outside) and torch.equal(after, outside)
    tracker.reset()


def test_cpu_split_sizes_become_numpy(installed):
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    for fn in (moe_utils.maybe_move_tensor_to_cpu, token_dispatcher.maybe_move_tensor_to_cpu):
        out = fn(torch.tensor([1, 2]), as_numpy=True)
        assert out.tolist() == [1, 2] and type(out).__module__ == "numpy"
        t = torch.tensor([3])
        assert fn(t) is t


def test_cpu_uninstall_restores_every_original():
    from megatron.core.transformer.moe import moe_utils

    was = cpu.installed()
    if was:
        cpu.uninstall()
    originals = (
        torch.cuda.current_device,
        torch.cuda.Stream,
        torch.cuda.get_rng_state,
        moe_utils.maybe_move_tensor_to_cpu,
    )
    cpu.install()
    cpu.install()  # idempotent
    assert torch.cuda.current_device is not originals[0]
    cpu.uninstall()
    assert (
        torch.cuda.current_device,
        torch.cuda.Stream,
        torch.cuda.get_rng_state,
        moe_utils.maybe_move_tensor_to_cpu,
    ) == originals
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError):
            torch.zeros(1, device="cuda")
    if was:
        cpu.install()


UNEVEN_SCRIPT = r"""
import os, torch, torch.distributed as dist
from moeverify.runtime import cpu
cpu.install()
dist.init_process_group("gloo", rank=int(os.environ["RANK"]), world_size=2)
me = dist.get_rank()
mine = torch.full((2 + me, 3), float(me + 1))
out = [torch.empty(2, 3), torch.empty(3, 3)]
dist.all_gather(out, mine)  # gloo alone refuses blocks of different sizes
assert torch.equal(out[0], torch.full((2, 3), 1.0)) and torch.equal(out[1], torch.full((3, 3), 2.0))
blocks = [torch.full((2, 3), 10.0 * me + 1), torch.full((3, 3), 10.0 * me + 2)]
got = torch.empty(2 + me, 3)
dist.reduce_scatter(got, blocks)
assert torch.equal(got, blocks[me] * 0 + (10.0 * 0 + me + 1) + (10.0 * 1 + me + 1)), got
even = [torch.empty(2), torch.empty(2)]
dist.all_gather(even, torch.full((2,), float(me)))  # even lists take gloo's own path
assert torch.equal(even[1], torch.ones(2))
print("OK", me)
"""


@pytest.mark.timing
def test_cpu_uneven_all_gather_and_reduce_scatter_on_gloo(tmp_path):
    import os
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in range(2):
        env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
        env.update(RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        procs.append(
            subprocess.Popen(
                [sys.executable, "-c", UNEVEN_SCRIPT],
                env=env,
                text=True,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
            )
        )
    outs = [p.communicate(timeout=CHILD_S) for p in procs]
    for rank, (p, (out, err)) in enumerate(zip(procs, outs, strict=True)):
        assert p.returncode == 0 and f"OK {rank}" in out, f"rank {rank}: {err[-2000:]}"
