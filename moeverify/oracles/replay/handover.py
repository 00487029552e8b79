"""A later build's weights taken from the build before it, on the GPU, where they are still the loaded ones.

At production depth a replay check keeps its ``WeightCopy`` in host memory (the model, its gradients and a copy would
not fit one GPU together), and each later build copied every tensor in from there: 61 GB over PCIe, 7.3 s a build at
48 Qwen3-30B-A3B layers on an H200 (65 s of a 222 s check). The build before holds the same values on the device
unless something wrote into them: the drift subcheck perturbs the routers, and an implementation under test may write
anywhere. So the last build's tensors are kept (detached: its gradients go with it) until the next build under that
layout, and a kept tensor is copied device to device only where its print (``grad_print``: ``lin64`` on the GPU, a
digest of every element's bits) equals the print taken when the weights were first loaded; small tensors and changed
ones come from the host copy, as before. Only where the device has room for a second model's weights beside the kept
ones (the new build is made while they live); else the kept tensors are dropped first and the host copy serves alone.
"""

from __future__ import annotations

import dataclasses

import torch

from moeverify.oracles.replay import grad_print

# a kept tensor is handed over when it has more elements than this (smaller ones cost less to copy from the host
# than to print); the same threshold as a pass's gradients (``grad_print.KEEP``)
LARGE = grad_print.KEEP
# free device memory needed beside the kept tensors, as a multiple of the weights' bytes (the new build's own)
ROOM = 1.05
# tests switch the handover on for CPU models (a CPU build's copy is in host memory already: nothing to gain there)
ON_CPU = False


@dataclasses.dataclass(slots=True)
class Kept:
    """The last build's tensors under ``layout``, by (chunk, name), detached (no gradients kept alive)."""

    layout: object
    tensors: dict


def applies(tensors: dict, copy_device: str) -> bool:
    """Whether a build of these tensors hands its weights over: a GPU model whose copy is in host memory."""
    first = next(iter(tensors.values()), None)
    if first is None or copy_device != "cpu":
        return False
    return first.is_cuda or ON_CPU


def prints(tensors: dict) -> dict:
    """The print of every large tensor of ``tensors``, made where each one is (one host sync per device)."""
    batch = grad_print.Batch()
    for key, t in tensors.items():
        if t.numel() > LARGE:
            batch.add(key, t)
    return batch.finish()


def keep(tensors: dict, layout) -> Kept:
    return Kept(layout=layout, tensors={key: t.detach() for key, t in tensors.items()})


def room_for(kept: Kept, nbytes: int) -> bool:
    """Whether a new build of ``nbytes`` fits beside ``kept`` (its device's free memory, the allocator's cached
    free blocks counted)."""
    first = next(iter(kept.tensors.values()), None)
    if first is None or not first.is_cuda:
        return True
    free = torch.cuda.mem_get_info(first.device)[0]
    cached = torch.cuda.memory_reserved(first.device) - torch.cuda.memory_allocated(first.device)
    return free + cached >= ROOM * nbytes


def intact(kept: Kept, loaded: dict) -> set:
    """Keys of the kept tensors whose print is the one taken at load (``loaded``: ``prints`` of the first build)."""
    mine = prints({key: t for key, t in kept.tensors.items() if key in loaded})
    return {key for key, p in mine.items() if p.same(loaded[key])}
