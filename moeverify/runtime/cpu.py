"""Run megatron-core on CPU ranks: redirect its CUDA touch points, reversibly.

megatron-core 0.19.2 assumes CUDA in a bounded set of places (measured; docs/design.md, "Version assumptions"):
- ``torch.cuda.current_device()`` used as a device argument: it returns the CPU device (the mode below
  is not active inside autograd's backward, where megatron allocates with this device too);
- hard-coded ``device="cuda"`` / ``Tensor.cuda()``: a ``TorchFunctionMode`` rewrites cuda devices to cpu;
- streams, events, ``synchronize``, ``empty_cache``, ``set_device``: null objects;
- the CUDA RNG used by ``tensor_parallel.random`` (model-parallel seeds, the RNG tracker): mapped to
  the CPU generator, so forks of the tracker fork the CPU RNG exactly as they would fork CUDA's;
- ``moe_utils.maybe_move_tensor_to_cpu``, which converts only CUDA tensors to numpy: the alltoall
  dispatcher needs numpy split sizes, so on CPU the conversion must still happen;
- uneven list collectives: with EP > 1 and expert TP > 1 the alltoall dispatcher all-gathers (and in
  backward reduce-scatters) token blocks of different sizes across the expert TP group
  (``tensor_parallel.mappings``); NCCL accepts that, gloo refuses ("ProcessGroupGloo::allgather: invalid
  tensor size"). Uneven lists are padded to the largest block and trimmed (all_gather) or reduced block by
  block (reduce_scatter); even lists take the original path.
Every redirection is recorded with its original and undone by ``uninstall()``. Installed only on the
CPU backend; on GPUs nothing here runs.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Callable
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from moeverify.errors import EnvironmentProblem

_CPU = torch.device("cpu")
_saved: list[tuple[Any, str, Any]] = []  # (owner, attribute, original) in install order
_mode: TorchFunctionMode | None = None


def _is_cuda_device(device: Any) -> bool:
    if isinstance(device, bool):
        return False
    if isinstance(device, int):
        return True  # a bare ordinal means a CUDA device to torch
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, torch.device) and device.type == "cuda"


def to_cpu_device(device: Any) -> Any:
    """``device`` with any CUDA device replaced by ``"cpu"``; everything else unchanged."""
    return torch.device("cpu") if _is_cuda_device(device) else device


class CudaToCpuMode(TorchFunctionMode):
    """Rewrites CUDA devices in tensor factories, ``.to(...)``, ``.cuda()`` and ``pin_memory`` to CPU."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda or func is torch.Tensor.pin_memory:
            return args[0]
        if "device" in kwargs:
            kwargs["device"] = to_cpu_device(kwargs["device"])
        if kwargs.get("pin_memory"):
            kwargs["pin_memory"] = False
        if func is torch.Tensor.to and len(args) > 1 and not isinstance(args[1], (torch.dtype, torch.Tensor)):
            args = (args[0], to_cpu_device(args[1]), *args[2:])
        return func(*args, **kwargs)


class _NullStream:
    """Stands in for ``torch.cuda.Stream`` on CPU: work is synchronous, so every wait is a no-op."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, stream) -> None:
        pass

    def wait_event(self, event) -> None:
        pass

    def record_event(self, event=None):
        return event if event is not None else _NullEvent()

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        pass


class _NullEvent:
    """Stands in for ``torch.cuda.Event`` on CPU."""

    def __init__(self, *args, **kwargs):
        pass

    def record(self, stream=None) -> None:
        pass

    def wait(self, stream=None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def elapsed_time(self, end) -> float:
        return 0.0


def _noop(*args, **kwargs) -> None:
    return None


def _cpu_get_rng_state(device: Any = "cuda") -> torch.Tensor:
    return torch.get_rng_state()


def _cpu_set_rng_state(new_state: torch.Tensor, device: Any = -1, graph_safe: bool = False) -> None:
    torch.set_rng_state(new_state)


def _cpu_manual_seed(seed: int) -> None:
    torch.default_generator.manual_seed(int(seed))


def _cpu_maybe_move_tensor_to_cpu(tensor, as_numpy: bool = False, record_stream: bool = False):
    """CPU twin of ``moe_utils.maybe_move_tensor_to_cpu``: numpy conversion happens for CPU tensors too."""
    if torch.is_tensor(tensor) and as_numpy:
        return tensor.detach().cpu().numpy()
    return tensor


def _uneven(tensors) -> bool:
    return len({tuple(t.shape) for t in tensors}) > 1


def _make_all_gather(original):
    def all_gather(tensor_list, tensor, group=None, async_op=False):
        if async_op or not _uneven(tensor_list):
            return original(tensor_list, tensor, group=group, async_op=async_op)
        rows = max(t.shape[0] for t in tensor_list)
        padded_in = torch.zeros((rows, *tensor.shape[1:]), dtype=tensor.dtype, device=tensor.device)
        padded_in[: tensor.shape[0]] = tensor
        padded_out = [torch.empty_like(padded_in) for _ in tensor_list]
        original(padded_out, padded_in, group=group)
        for out, full in zip(tensor_list, padded_out, strict=True):
            out.copy_(full[: out.shape[0]])
        return None

    return all_gather


def _make_reduce_scatter(original):
    def reduce_scatter(output, input_list, op=torch.distributed.ReduceOp.SUM, group=None, async_op=False):
        if async_op or not _uneven(input_list):
            return original(output, input_list, op=op, group=group, async_op=async_op)
        me = torch.distributed.get_rank(group)
        for index, block in enumerate(input_list):  # one all_reduce per block: tiny models only
            block = block.clone()
            torch.distributed.all_reduce(block, op=op, group=group)
            if index == me:
                output.copy_(block)
        return None

    return reduce_scatter


def _torch_cuda_redirections() -> list[tuple[Any, str, Callable | type]]:
    null_stream = _NullStream()
    return [
        (torch.cuda, "current_device", lambda: _CPU),
        (torch.cuda, "current_stream", lambda device=None: null_stream),
        (torch.cuda, "default_stream", lambda device=None: null_stream),
        (torch.cuda, "Stream", _NullStream),
        (torch.cuda, "ExternalStream", _NullStream),
        (torch.cuda, "Event", _NullEvent),
        (torch.cuda, "stream", lambda stream=None: contextlib.nullcontext()),
        (torch.cuda, "synchronize", _noop),
        (torch.cuda, "is_current_stream_capturing", lambda: False),  # nothing captures on CPU (RouterTracer asks)
        (torch.cuda, "empty_cache", _noop),
        (torch.cuda, "set_device", _noop),
        (torch.cuda, "get_rng_state", _cpu_get_rng_state),
        (torch.cuda, "set_rng_state", _cpu_set_rng_state),
        (torch.cuda, "manual_seed", _cpu_manual_seed),
        (torch.cuda.random, "get_rng_state", _cpu_get_rng_state),
        (torch.cuda.random, "set_rng_state", _cpu_set_rng_state),
        (torch.cuda.random, "manual_seed", _cpu_manual_seed),
    ]


# megatron-core modules that bind the redirected helpers by name (checked at install time).
_MEGATRON_REDIRECTIONS = (
    ("megatron.core.tensor_parallel.random", "_set_cuda_rng_state", _cpu_set_rng_state),
    ("megatron.core.transformer.moe.moe_utils", "maybe_move_tensor_to_cpu", _cpu_maybe_move_tensor_to_cpu),
    ("megatron.core.transformer.moe.token_dispatcher", "maybe_move_tensor_to_cpu", _cpu_maybe_move_tensor_to_cpu),
)


def _replace(owner: Any, name: str, value: Any) -> None:
    _saved.append((owner, name, getattr(owner, name)))
    if callable(value) and not isinstance(value, type):
        value = _distinct(value, name)
    setattr(owner, name, value)


def _distinct(fn: Callable, name: str) -> Callable:
    """A fresh function object per patched name: torch._dynamo maps torch functions by identity and
    refuses one object standing for two torch names."""

    def redirected(*args, **kwargs):
        return fn(*args, **kwargs)

    redirected.__name__ = redirected.__qualname__ = name
    return redirected


def installed() -> bool:
    return _mode is not None


def install() -> None:
    """Install every redirection (idempotent). Fails loudly if megatron-core moved a patched name."""
    global _mode
    if _mode is not None:
        return

    targets = []
    for module_name, attr, value in _MEGATRON_REDIRECTIONS:
        module = importlib.import_module(module_name)
        if not hasattr(module, attr):
            raise EnvironmentProblem(
                f"{module_name}.{attr} not found: the CPU backend was written against megatron-core 0.19.2, "
                "where it exists; this megatron-core changed where CUDA is touched"
            )
        targets.append((module, attr, value))
    for owner, name, value in _torch_cuda_redirections():
        _replace(owner, name, value)
    _replace(torch.distributed, "all_gather", _make_all_gather(torch.distributed.all_gather))
    _replace(torch.distributed, "reduce_scatter", _make_reduce_scatter(torch.distributed.reduce_scatter))
    for owner, name, value in targets:
        _replace(owner, name, value)
    _mode = CudaToCpuMode()
    _mode.__enter__()


def uninstall() -> None:
    """Undo ``install()``: every original restored, the device mode popped."""
    global _mode
    if _mode is None:
        return
    _mode.__exit__(None, None, None)
    _mode = None
    while _saved:
        owner, name, original = _saved.pop()
        setattr(owner, name, original)


@contextlib.contextmanager
def ordinal_current_device():
    """Inside the block ``torch.cuda.current_device()`` returns ``0``, an int as on CUDA (outside it, the CPU
    device): for code that builds ``torch.device("cuda", torch.cuda.current_device())``, which a device
    object cannot be passed to. The device mode rewrites the ``cuda:0`` it then uses to CPU. Only for code
    that runs outside autograd's backward (where the mode is not active); a no-op unless installed."""
    if _mode is None:
        yield
        return
    current = torch.cuda.current_device
    torch.cuda.current_device = _distinct(lambda: 0, "current_device")
    try:
        yield
    finally:
        torch.cuda.current_device = current
