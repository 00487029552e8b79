"""A large gradient kept as a fingerprint instead of a copy: what lets a replay check run many passes of a
production-size model with one copy of the model in host memory.

Each pass of the replay oracle keeps its gradients to compare them bitwise with another pass's. A copy per pass is
a copy of the model per pass (fp32 grads: twice the bf16 model's bytes). A gradient of more than ``KEEP`` elements
is kept as a ``GradPrint``: its shape, dtype, a BLAKE2b digest of the raw bytes of every block of ``BLOCK``
elements, and its float64 sum and largest magnitude. Two prints are equal exactly when shape, dtype and every
block's bytes are (up to a 2**-128 digest collision per block); a mismatch names the first differing block's
element range, how many blocks differ, and both sums and maxima. Smaller gradients (routers, norms, biases: where
a replay bug shows first) stay tensors, compared and described element by element.
"""

from __future__ import annotations

import dataclasses
import hashlib

import torch

from moeverify.oracles.bits import bits

KEEP = 1 << 16  # elements: kept as a tensor up to this size
BLOCK = 1 << 20  # elements per digest block


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class GradPrint:
    shape: tuple[int, ...]
    dtype: torch.dtype
    blocks: tuple[bytes, ...]
    total: float
    absmax: float

    @classmethod
    def of(cls, t: torch.Tensor) -> GradPrint:
        flat = bits(t.detach().contiguous()).reshape(-1)
        raw = flat.cpu().numpy()  # a view when already on the host; one block-sized copy at a time otherwise
        blocks = tuple(hashlib.blake2b(raw[i:i + BLOCK].tobytes(), digest_size=16).digest()
                       for i in range(0, raw.shape[0], BLOCK))
        values = t.detach().double() if t.is_floating_point() else t.detach().long()
        return cls(shape=tuple(t.shape), dtype=t.dtype, blocks=blocks, total=float(values.sum()),
                   absmax=float(values.abs().max()) if t.numel() else 0.0)

    def same(self, other: GradPrint) -> bool:
        """Bitwise equal: shape, dtype and every block's bytes (sums and maxima are only for messages: NaN)."""
        return (self.shape, self.dtype, self.blocks) == (other.shape, other.dtype, other.blocks)

    def describe(self, other: GradPrint) -> str:
        """Why ``other`` (the run under test) is not bitwise this (expected)."""
        if self.shape != other.shape:
            return f"shape {self.shape} != {other.shape}"
        if self.dtype != other.dtype:
            return f"dtype {self.dtype} != {other.dtype}"
        differ = [i for i, (a, b) in enumerate(zip(self.blocks, other.blocks)) if a != b]
        if not differ:
            return "equal"
        n = 1
        for d in self.shape:
            n *= d
        first = differ[0] * BLOCK
        return (f"{len(differ)} of {len(self.blocks)} block(s) of {BLOCK} elements differ; first in flat "
                f"[{first}, {min(first + BLOCK, n)}); sum {self.total!r} != {other.total!r}, max |g| "
                f"{self.absmax!r} vs {other.absmax!r}")


def keep(t: torch.Tensor) -> torch.Tensor | GradPrint:
    """What a pass keeps of gradient ``t``: a host copy when small, else its print."""
    if t.numel() <= KEEP:
        return t.detach().to("cpu", copy=True)
    return GradPrint.of(t)
