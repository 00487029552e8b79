"""How code runs: the device backend, process groups with timeouts, model-parallel state per Layout.

``init(backend="auto")`` picks cuda+nccl where GPUs are visible, else cpu+gloo with megatron-core's
CUDA touch points redirected (``cpu``). ``parallel(layout)`` initialises Megatron's model-parallel state for
one scenario and destroys it afterwards, so one torchrun can run many. Also here:

- ``bridge_import``: megatron.bridge imported where Transformer Engine's torch extension does not exist;
- ``outcome``: ranks agreeing on how a step ended, without a collective a failed rank may never join;
- ``hash64``: splitmix64 in torch int64 arithmetic, the one integer mixer the project uses;
- ``dtypes``: the one dtype table (safetensors' codes, torch dtypes and their names).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import os
import socket

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d

from moeverify.errors import UsageError
from moeverify.runtime import cpu
from moeverify.runtime.bridge_import import import_bridge, real_te_available
from moeverify.spec import timeouts

__all__ = ["Runtime", "init", "parallel", "import_bridge", "current", "DEFAULT_TIMEOUT_S"]


def __getattr__(name: str) -> float:
    """``DEFAULT_TIMEOUT_S``: the public name of ``timeouts.COLLECTIVE_S``, read when used (never at import)."""
    if name == "DEFAULT_TIMEOUT_S":
        return timeouts.COLLECTIVE_S
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Runtime:
    backend: str  # "cpu" | "cuda"
    device: torch.device
    dist_backend: str  # "gloo" | "nccl"
    rank: int
    world_size: int
    te_real: bool


_runtime: Runtime | None = None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _resolve_backend(backend: str) -> str:
    if backend not in ("auto", "cpu", "cuda"):
        raise UsageError(f"backend must be auto, cpu or cuda, got {backend!r}")
    if backend == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if backend == "cuda" and not torch.cuda.is_available():
        raise UsageError("backend cuda requested but torch sees no GPU; use --backend cpu")
    return backend


def init(backend: str = "auto", *, timeout_s: float | None = None) -> Runtime:
    """Pick the backend, install CPU redirections if needed, and initialise torch.distributed (idempotent).

    Under torchrun the world comes from the environment; otherwise a 1-rank world is created. ``timeout_s``:
    the process group's collective timeout, ``timeouts.COLLECTIVE_S`` by default.
    """
    global _runtime
    resolved = _resolve_backend(backend)
    timeout_s = timeouts.COLLECTIVE_S if timeout_s is None else timeout_s
    if _runtime is not None and not torch.distributed.is_initialized():
        _runtime = None  # someone destroyed the process group since: make a new one rather than hand out a dead world
    if _runtime is not None:
        if backend != "auto" and resolved != _runtime.backend:
            raise UsageError(f"runtime already initialised with backend {_runtime.backend}, asked for {resolved}")
        return _runtime
    if "RANK" not in os.environ:
        os.environ.update(
            RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port())
        )
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    _eager_fusions()
    if resolved == "cuda":
        _deterministic_cuda()
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
        device, dist_backend = torch.device("cuda", torch.cuda.current_device()), "nccl"
    else:
        cpu.install()
        device, dist_backend = torch.device("cpu"), "gloo"
    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group(dist_backend, timeout=datetime.timedelta(seconds=timeout_s))
    _runtime = Runtime(
        backend=resolved,
        device=device,
        dist_backend=dist_backend,
        rank=torch.distributed.get_rank(),
        world_size=torch.distributed.get_world_size(),
        te_real=real_te_available(),
    )
    return _runtime


def _eager_fusions() -> None:
    """megatron-core's ``jit_fuser`` is ``torch.compile`` (torch >= 2.2). A compiled function is compiled again for
    another grad mode or shape, and past dynamo's cache limit it runs eagerly: in a torchrun that has run many
    scenarios, two passes over the same tokens then differ in the last bits (seen: Qwen3-Next's CP2
    backward_order after the group's other layouts). Oracles compare passes bit for bit, so every compiled
    function runs eagerly, as the first pass and the last alike (the same math, unfused)."""
    import torch._dynamo  # lazy: torch._dynamo (not loaded by import torch)

    torch._dynamo.config.disable = True


def _deterministic_cuda() -> None:
    """Bit-for-bit oracles need run-to-run identical kernels: the MoE backward scatters with atomics
    (index_add/scatter_add) unless deterministic algorithms are on, which makes two identical passes
    differ in the last bits (measured on one H200: input-norm grads of DeepSeek-V3 off by ~5e-9).
    cuBLAS needs its workspace pinned before the first handle is made for the same reason."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cudnn.benchmark = False


def current() -> Runtime:
    if _runtime is None:
        raise UsageError("moeverify.runtime.init() has not been called")
    return _runtime


_layouts: list[tuple] = []  # the stack of (layout, seed, timeout_s) entered through parallel()
_kept_groups: set = set()  # groups that outlive parallel(): made once per process (keep_group)
_groups_before: set | None = None  # the process groups that existed when parallel state was initialised


def keep_group(group) -> None:
    """Exempt ``group`` from the clean-up at the end of ``parallel()`` (a group the caller caches)."""
    _kept_groups.add(group)


@contextlib.contextmanager
def parallel(layout, *, seed: int = 0, timeout_s: float | None = None):
    """Initialise megatron parallel_state for ``layout`` (plus model-parallel RNG seeds).

    Nests: on exit the state is destroyed and, if an enclosing ``parallel()`` is active, its layout is
    initialised again, so a check may run a reference under another layout (e.g. 1 rank) and hand the
    scenario's layout back to the checks after it. Every rank must enter and leave together: making
    groups is collective. ``timeout_s``: the groups' collective timeout, ``timeouts.COLLECTIVE_S`` by default.
    """
    rt = current()
    layout.validate(world_size=rt.world_size)
    timeout_s = timeouts.COLLECTIVE_S if timeout_s is None else timeout_s
    _initialise(layout, seed=seed, timeout_s=timeout_s)
    _layouts.append((layout, seed, timeout_s))
    try:
        yield
    finally:
        _layouts.pop()
        _destroy()
        if _layouts:
            outer, outer_seed, outer_timeout = _layouts[-1]
            _initialise(outer, seed=outer_seed, timeout_s=outer_timeout)


def _initialise(layout, *, seed: int, timeout_s: float) -> None:
    from megatron.core import parallel_state  # lazy: megatron
    from megatron.core.tensor_parallel import random as mp_random  # lazy: megatron

    global _groups_before
    if parallel_state.model_parallel_is_initialized():
        _destroy()
    if _groups_before is None:
        _groups_before = _live_groups()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        virtual_pipeline_model_parallel_size=layout.vpp if layout.pp > 1 else None,
        context_parallel_size=layout.cp,
        expert_model_parallel_size=layout.ep,
        expert_tensor_parallel_size=layout.expert_tp,
        distributed_timeout_minutes=max(1, -(-timeout_s // 60)),
    )
    torch.manual_seed(seed)
    mp_random.model_parallel_cuda_manual_seed(seed)


def _destroy() -> None:
    from megatron.core import parallel_state  # lazy: megatron

    parallel_state.destroy_model_parallel()
    _reset_megatron_globals()
    if not _layouts:
        _destroy_new_groups()


def _live_groups() -> set:
    return set(distributed_c10d._world.pg_map)


def _destroy_new_groups() -> None:
    """Destroy every process group made since the outermost ``parallel()`` began (Megatron's and the checks').

    Groups of an outer layout stay alive while a nested ``parallel()`` runs, so models built before it
    keep working after it.

    Megatron-Core's ``destroy_model_parallel`` (0.19) only drops its references; torch keeps each group
    alive in its registry, and every gloo group holds its own loop threads. Without this a run of many
    scenarios ends with thousands of threads per rank (measured: 2,700 after 30 scenarios), which slows a
    2-core machine 10-100x until collectives time out. Collective: every rank destroys the same groups.
    """
    global _groups_before
    if _groups_before is None:
        return
    for group in _live_groups() - _groups_before - _kept_groups:
        dist.destroy_process_group(group)
    _groups_before = None


def _reset_megatron_globals() -> None:
    """Clear process-wide megatron state that would leak from one scenario into the next."""
    from megatron.core.tensor_parallel import random as mp_random  # lazy: megatron

    tracker = mp_random.get_cuda_rng_tracker()
    tracker.reset()
