"""``model_intact``: the subject leaves the model it exports as it found it.

The reference (Megatron-Bridge's ``export_hf_weights``) reads the live model after the subject has run, so a subject
that writes into the model (an in-place norm offset, a cast or a scale applied to a parameter instead of to its
copy) exports values the reference then agrees with: every other subcheck passes. Each rank fingerprints its model
chunks' parameters and floating buffers before the subject runs and after it is drained, and names what changed.

A fingerprint is a wrapping sum of splitmix64 over each element's bits and flat position (``runtime.hash64``),
taken on the tensor's own device in slices of ``_SLICE`` elements (a few 16 MB temporaries), read
with one host read per device.
"""

from __future__ import annotations

import torch

from moeverify.runtime.hash64 import GOLDEN, mix

SUBCHECK = "model_intact"
_SLICE = 1 << 21  # 2M elements: a few 16 MB temporaries
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def named_state(model_chunks) -> list[tuple[str, torch.Tensor]]:
    """``(chunk-qualified name, tensor)`` of every parameter and floating buffer, each storage once."""
    out, seen = [], set()
    for i, chunk in enumerate(model_chunks):
        for name, t in [*chunk.named_parameters(), *chunk.named_buffers()]:
            if not isinstance(t, torch.Tensor) or t.numel() == 0 or id(t) in seen:
                continue
            seen.add(id(t))
            out.append((f"chunk{i}.{name}" if len(model_chunks) > 1 else name, t))
    return out


def _print(t: torch.Tensor) -> torch.Tensor:
    """A 0-d int64 fingerprint of ``t``'s bits (its element order included)."""
    flat = t.detach().reshape(-1)
    if flat.is_floating_point() or flat.is_complex() or flat.dtype == torch.bool:
        flat = flat.view(_BITS[flat.element_size()]) if flat.dtype != torch.bool else flat.to(torch.uint8)
    total = torch.zeros((), dtype=torch.int64, device=flat.device)
    for start in range(0, flat.numel(), _SLICE):
        part = flat[start : start + _SLICE].to(torch.int64)
        index = torch.arange(start, start + part.numel(), dtype=torch.int64, device=flat.device)
        total = total + mix(part ^ (index * GOLDEN)).sum()
    return total


def fingerprints(state: list[tuple[str, torch.Tensor]]) -> list[int]:
    """One fingerprint per tensor of ``named_state``'s list (one host read)."""
    prints = [_print(t) for _, t in state]
    out: list[int] = [0] * len(prints)
    for device in {p.device for p in prints}:  # one read per device, not one per tensor
        where = [i for i, p in enumerate(prints) if p.device == device]
        for i, value in zip(where, torch.stack([prints[i] for i in where]).tolist(), strict=True):
            out[i] = int(value)
    return out


def changed(state: list[tuple[str, torch.Tensor]], before: list[int]) -> list[str]:
    """The names of the tensors whose fingerprint is not ``before``'s."""
    return [name for (name, _), a, b in zip(state, before, fingerprints(state), strict=True) if a != b]
