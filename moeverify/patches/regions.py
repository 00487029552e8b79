"""Which checkpointed forward a recomputed routing call belongs to: identity, never queue order.

A recompute re-runs one checkpointed region (one call of a checkpoint function) inside the backward
pass. Backward passes may run in any order (reverse, one backward over summed losses, 1F1B,
interleaved), so the region, not a counter, says which forward a recompute repeats. Two kinds of
region are known, and each has an object that lives exactly as long as the region's graph:

- **reentrant checkpoints**: a custom ``torch.autograd.Function`` whose forward runs the region
  (Megatron-Core's ``tensor_parallel.checkpoint``, ``torch.utils.checkpoint(use_reentrant=True)``,
  Transformer Engine's ``checkpoint``). The region is the Function's ``ctx``: found in the forward
  as the first argument of the innermost ``forward(ctx, ...)`` frame on the stack, and in the
  recompute as ``torch._C._current_autograd_node()`` (autograd runs that node's backward, which
  re-runs the region; for a Python Function the node *is* the ``ctx``);
- **non-reentrant checkpoints** (``torch.utils.checkpoint(use_reentrant=False)``): the region is
  torch's ``_CheckpointFrame``, held by the saved-tensor hooks on top of the hooks stack: the
  checkpoint's pack hook in the forward (closure cell ``frame``), the recomputation hook's pack
  hook in the recompute (closure cell ``target_frame_ref``).

Version assumptions (torch 2.14.1, read from its ``torch/utils/checkpoint.py``): the two closure
cell names above and ``torch._C._autograd._top_saved_tensors_default_hooks``; ``probe()`` checks them
and ``moeverify.patches.compat`` refuses the patch when they are gone. A recompute by any other
mechanism has no known region: callers refuse it rather than guess.
"""

from __future__ import annotations

import sys
import types
import weakref
from typing import Any

import torch
from torch.autograd.function import BackwardCFunction
from torch.utils.checkpoint import checkpoint

_FORWARD_CELL = "frame"  # _checkpoint_hook.__init__.<locals>.pack_hook closes over the _CheckpointFrame
_RECOMPUTE_CELL = "target_frame_ref"  # _recomputation_hook.__init__.<locals>.pack_hook: a weakref to it
_MAX_DEPTH = 256  # frames searched for a reentrant checkpoint's forward


def in_backward() -> bool:
    """True while autograd's engine runs a backward pass (where checkpointed forwards are recomputed)."""
    return torch._C._current_graph_task_id() != -1


def _hook_cells() -> dict[str, Any]:
    hooks = torch._C._autograd._top_saved_tensors_default_hooks(False)
    if hooks is None:
        return {}
    pack = hooks[0]
    while hasattr(pack, "__wrapped__"):  # the recomputation hook's pack is wrapped by dynamo.disable
        pack = pack.__wrapped__
    code, closure = getattr(pack, "__code__", None), getattr(pack, "__closure__", None)
    if code is None or not closure:
        return {}
    return dict(zip(code.co_freevars, (cell.cell_contents for cell in closure), strict=True))


def _reentrant_ctx() -> BackwardCFunction | None:
    frame: types.FrameType | None = sys._getframe(1)
    for _ in range(_MAX_DEPTH):
        if frame is None:
            return None
        code = frame.f_code
        if code.co_name == "forward" and code.co_argcount and code.co_varnames[0] != "self":
            candidate = frame.f_locals.get(code.co_varnames[0])
            if isinstance(candidate, BackwardCFunction):
                return candidate
        frame = frame.f_back
    return None


def forward_region() -> object | None:
    """The checkpointed region the current (forward) routing call runs in, or None outside any."""
    if torch.is_grad_enabled():  # a reentrant checkpoint's forward runs with grad off
        return _hook_cells().get(_FORWARD_CELL)
    return _reentrant_ctx()


def recompute_regions() -> tuple[object, ...]:
    """Inside a backward pass: the candidate regions the current routing call may be recomputing."""
    found = []
    node = torch._C._current_autograd_node()
    if isinstance(node, BackwardCFunction):
        found.append(node)
    ref = _hook_cells().get(_RECOMPUTE_CELL)
    if isinstance(ref, weakref.ReferenceType) and ref() is not None:
        found.append(ref())
    return tuple(found)


def probe() -> str | None:
    """None when both kinds of region are found as assumed; else what differs (run once, at apply)."""
    if not callable(getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)):
        return "torch._C._autograd._top_saved_tensors_default_hooks is missing"
    if not callable(getattr(torch._C, "_current_autograd_node", None)):
        return "torch._C._current_autograd_node is missing"
    seen: dict[str, list] = {"forward": [], "recompute": []}

    def region_fn(x):
        if in_backward():
            seen["recompute"].append(recompute_regions())
        else:
            seen["forward"].append(forward_region())
        return (x * 2.0).sin()  # saves a tensor, so the non-reentrant checkpoint recomputes

    for reentrant in (True, False):
        x = torch.ones(2, requires_grad=True)
        checkpoint(region_fn, x, use_reentrant=reentrant).sum().backward()
    forwards, recomputes = seen["forward"], seen["recompute"]
    if len(forwards) != 2 or len(recomputes) != 2 or any(r is None for r in forwards):
        return f"checkpoint regions not found (forward {forwards}, recompute {recomputes})"
    for kind, fwd, rec in zip(("reentrant", "non-reentrant"), forwards, recomputes, strict=True):
        if not any(candidate is fwd for candidate in rec):
            return f"the {kind} checkpoint's recompute does not name its forward's region"
    return None
