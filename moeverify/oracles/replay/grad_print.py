"""A large gradient kept as a fingerprint instead of a copy: what lets a replay check run many passes of a
production-size model with one copy of the model in host memory.

Each pass of the replay oracle keeps its gradients to compare them bitwise with another pass's. A copy per pass is
a copy of the model per pass (fp32 grads: twice the bf16 model's bytes). A gradient of more than ``KEEP`` elements
is kept as a ``GradPrint``: its shape, dtype, a 128-bit digest of the raw bits of every block of ``BLOCK`` elements,
and its float64 sum and largest magnitude. Two prints are equal exactly when shape, dtype and every block's bits
are, up to a digest collision (about 2**-128 a block); a mismatch names the first differing block's element range,
how many blocks differ, and both sums and maxima. Smaller gradients (routers, norms, biases: where a replay bug
shows first) stay tensors, compared and described element by element.

The digest is made where the gradient is: a host gradient's blocks are hashed with BLAKE2b (``blake2b``); a GPU
gradient's never leave the GPU (``mix64``: two sums, each of splitmix64 of every element's bits xor a keyed hash of
its position in the block, in wrapping 64-bit arithmetic; a changed, moved or swapped element changes a sum but by
chance). Hashing on the host was most of the check's time at production width: a training pass of one Qwen3-30B-A3B
layer has 1.2 G gradient elements, 5 GB copied to the host and hashed at about 0.3 G elements a second.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
from concurrent.futures import ThreadPoolExecutor

import torch

from moeverify import hash64
from moeverify.oracles.bits import bits

KEEP = 1 << 16  # elements: kept as a tensor up to this size
_HASH_THREADS = min(8, os.cpu_count() or 1)  # host blocks hashed at once (1.9x on two cores)
BLOCK = 1 << 20  # elements per digest block
_ROWS = 16  # blocks hashed at once on the GPU: bounds the int64 temporaries (8 bytes an element, a few alive)
_LANES = (hash64.signed(0x6A09E667F3BCC908), hash64.signed(0xBB67AE8584CAA73B))  # the two sums' position keys


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class GradPrint:
    shape: tuple[int, ...]
    dtype: torch.dtype
    digest: str  # "blake2b" or "mix64" (``DIGESTS``)
    blocks: tuple[bytes, ...]
    total: float
    absmax: float

    @classmethod
    def of(cls, t: torch.Tensor, *, digest: str | None = None) -> GradPrint:
        """``t``'s print; ``digest`` defaults to the one made where ``t`` is (``mix64`` on a GPU)."""
        digest = digest or ("blake2b" if t.device.type == "cpu" else "mix64")
        flat = bits(t.detach().contiguous()).reshape(-1)
        t = t.detach()
        total = float(t.sum(dtype=torch.float64 if t.is_floating_point() else torch.int64))  # no full-size copy
        absmax = max(abs(float(v)) for v in torch.aminmax(t)) if t.numel() else 0.0
        return cls(shape=tuple(t.shape), dtype=t.dtype, digest=digest, blocks=DIGESTS[digest](flat), total=total,
                   absmax=absmax)

    def same(self, other: GradPrint) -> bool:
        """Bitwise equal: shape, dtype and every block's bytes (sums and maxima are only for messages: NaN). Prints
        of two digests are never the same (``compare_maps`` prints a tensor with the digest of the print it meets)."""
        return ((self.shape, self.dtype, self.digest, self.blocks)
                == (other.shape, other.dtype, other.digest, other.blocks))

    def describe(self, other: GradPrint) -> str:
        """Why ``other`` (the run under test) is not bitwise this (expected)."""
        if self.digest != other.digest:
            return f"digests of two kinds ({self.digest} vs {other.digest}) cannot be compared"
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


def _blake2b(flat: torch.Tensor) -> tuple[bytes, ...]:
    raw = flat.cpu().numpy()  # a view when already on the host

    def block(i: int) -> bytes:
        return hashlib.blake2b(raw[i:i + BLOCK], digest_size=16).digest()

    starts = range(0, raw.shape[0], BLOCK)
    if len(starts) < 2:
        return tuple(map(block, starts))
    with ThreadPoolExecutor(min(len(starts), _HASH_THREADS)) as pool:  # hashlib lets the GIL go on large buffers
        return tuple(pool.map(block, starts))


_POSITIONS: dict[tuple[torch.device, int, int], torch.Tensor] = {}


def _positions(device: torch.device, lane: int) -> torch.Tensor:
    """``[BLOCK]`` int64: the keyed hash of each position in a block, per lane (made once per device)."""
    if (device, lane, BLOCK) not in _POSITIONS:
        index = torch.arange(1, BLOCK + 1, dtype=torch.int64, device=device)
        _POSITIONS[device, lane, BLOCK] = hash64.mix(index * hash64.GOLDEN + _LANES[lane])
    return _POSITIONS[device, lane, BLOCK]


def _mix64(flat: torch.Tensor) -> tuple[bytes, ...]:
    n = flat.shape[0]
    if n == 0:
        return ()
    rows = -(-n // BLOCK)
    sums = torch.empty(len(_LANES), rows, dtype=torch.int64, device=flat.device)
    for start in range(0, rows, _ROWS):
        part = flat[start * BLOCK:(start + _ROWS) * BLOCK].to(torch.int64)
        if part.shape[0] % BLOCK:  # the last block padded with zero bits (the shape tells how many are real)
            part = torch.nn.functional.pad(part, (0, BLOCK - part.shape[0] % BLOCK))
        part = part.view(-1, BLOCK)
        for lane in range(len(_LANES)):
            sums[lane, start:start + part.shape[0]] = hash64.mix(part ^ _positions(flat.device, lane)).sum(dim=1)
    both = sums.t().contiguous().cpu().numpy()
    return tuple(row.tobytes() for row in both)


DIGESTS = {"blake2b": _blake2b, "mix64": _mix64}


def keep(t: torch.Tensor) -> torch.Tensor | GradPrint:
    """What a pass keeps of gradient ``t``: a host copy when small, else its print."""
    if t.numel() <= KEEP:
        return t.detach().to("cpu", copy=True)
    return GradPrint.of(t)
