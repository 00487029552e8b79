"""Raw-bit comparison, the one definition every oracle uses: plain tensors, no Megatron.

Two tensors are *bitwise* equal when they have the same dtype, shape and raw bits: ``-0.0 != 0.0``,
NaN equals NaN only with the same payload, and nothing is ever compared "close". ``bits`` is the
reinterpretation every comparison goes through; ``hex_bits`` prints an element's pattern for messages.
"""

from __future__ import annotations

import torch

from moeverify.errors import SHOW

_BITS_DTYPE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits(t: torch.Tensor) -> torch.Tensor:
    """``t`` reinterpreted as an integer tensor of the same element width (no copy, no rounding)."""
    if t.dtype == torch.bool:
        return t.view(torch.uint8)
    if t.is_complex():
        raise TypeError(f"complex tensors are not supported (got {t.dtype})")
    return t.view(_BITS_DTYPE[t.element_size()])


def hex_bits(value: int, dtype: torch.dtype) -> str:
    """An element's bit pattern as fixed-width hex for messages."""
    width = torch.empty((), dtype=dtype).element_size() * 2
    return f"0x{value & ((1 << (4 * width)) - 1):0{width}x}"


def differ(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Flat bool mask of the elements whose raw bits differ (same dtype and element count assumed)."""
    return bits(a.contiguous()).reshape(-1) != bits(b.contiguous()).reshape(-1)


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """True when ``a`` and ``b`` have the same shape, dtype and raw bits."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return bool(torch.equal(bits(a.contiguous()), bits(b.contiguous())))


def compare_bits(name: str, expected: torch.Tensor, got: torch.Tensor) -> str | None:
    """``None`` if ``got`` equals ``expected`` bit for bit in dtype and shape, else a message naming ``name``."""
    if got.dtype != expected.dtype or tuple(got.shape) != tuple(expected.shape):
        return (
            f"{name}: dtype/shape {got.dtype} {tuple(got.shape)} != expected {expected.dtype} {tuple(expected.shape)}"
        )
    a, b = bits(expected.contiguous()).flatten(), bits(got.detach().cpu().contiguous()).flatten()
    diff = (a != b).nonzero().flatten()
    if not diff.numel():
        return None
    shown = ", ".join(
        f"[{int(i)}] expected {hex_bits(int(a[i]), expected.dtype)} got {hex_bits(int(b[i]), expected.dtype)}"
        for i in diff[:SHOW]
    )
    return f"{name}: {diff.numel()} of {a.numel()} elements differ: {shown}"
