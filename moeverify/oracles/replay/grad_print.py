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
gradient's never leave the GPU (``lin64``: per block, two keyed sums of every element's bits, sign-extended, times
an odd 64-bit key drawn (splitmix64) for its position, in wrapping 64-bit arithmetic: a multilinear hash, so two
blocks whose bits differ anywhere (one ulp, a moved or swapped element) give the same sum with probability at most
2**-49 a lane (a difference of 16-bit patterns has at most 15 trailing zero bits), the two lanes' keys being
independent). Three int64 operations an element and lane, against eleven for splitmix64 of every element.
Hashing on the host was most of the check's time at production width: a training pass of one Qwen3-30B-A3B
layer has 1.2 G gradient elements, 5 GB copied to the host and hashed at about 0.3 G elements a second.

A pass's GPU prints are made in one ``Batch``: every gradient's digest, sum and extrema are queued on the device and
read back with one copy at the end (a 48-layer model has 12,500 gradients; a host sync each was seconds a pass).
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
    digest: str  # "blake2b" or "lin64" (``DIGESTS``)
    blocks: tuple[bytes, ...]
    total: float
    absmax: float

    @classmethod
    def of(cls, t: torch.Tensor, *, digest: str | None = None) -> GradPrint:
        """``t``'s print; ``digest`` defaults to the one made where ``t`` is (``lin64`` on a GPU)."""
        batch = Batch()
        batch.add(None, t, digest=digest)
        return batch.finish()[None]

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


_KEYS: dict[tuple[torch.device, int], torch.Tensor] = {}


def _keys(device: torch.device) -> torch.Tensor:
    """``[lanes, BLOCK]`` int64: each position's odd key, per lane (made once per device and block size)."""
    if (device, BLOCK) not in _KEYS:
        index = torch.arange(1, BLOCK + 1, dtype=torch.int64, device=device)
        _KEYS[device, BLOCK] = torch.stack([hash64.mix(index * hash64.GOLDEN + lane) | 1 for lane in _LANES])
    return _KEYS[device, BLOCK]


def _lin64(flat: torch.Tensor) -> torch.Tensor:
    """``[rows, lanes]`` int64 on ``flat``'s device: each block's keyed sums (the last block padded with zero
    bits: the shape tells how many are real); no rows for no elements."""
    rows = -(-flat.shape[0] // BLOCK)
    keys = _keys(flat.device)
    sums = torch.empty(rows, len(_LANES), dtype=torch.int64, device=flat.device)
    for start in range(0, rows, _ROWS):
        part = flat[start * BLOCK:(start + _ROWS) * BLOCK].to(torch.int64)
        if part.shape[0] % BLOCK:
            part = torch.nn.functional.pad(part, (0, BLOCK - part.shape[0] % BLOCK))
        part = part.view(-1, 1, BLOCK)
        sums[start:start + part.shape[0]] = (part * keys).sum(dim=2)
    return sums


class Batch:
    """Prints of many tensors with one host sync: ``add`` queues a tensor's digest, sum and extrema where it is,
    ``finish`` reads them all back at once and returns ``{key: GradPrint}``."""

    def __init__(self):
        self._done: dict = {}  # key -> GradPrint (host digests, made at once)
        self._queued: list = []  # (key, (shape, dtype, numel), sums [rows, lanes] int64, stats [3] float64), on a GPU

    def add(self, key, t: torch.Tensor, *, digest: str | None = None) -> None:
        digest = digest or ("blake2b" if t.device.type == "cpu" else "lin64")
        t = t.detach()
        flat = bits(t.contiguous()).reshape(-1)
        if t.numel():
            lo, hi = torch.aminmax(t)
            stats = torch.stack([t.sum(dtype=torch.float64 if t.is_floating_point() else torch.int64).double(),
                                 lo.double(), hi.double()])
        else:
            stats = torch.zeros(3, dtype=torch.float64, device=t.device)
        what = (tuple(t.shape), t.dtype, t.numel())
        if digest == "blake2b":
            self._done[key] = _print(what, digest, _blake2b(flat), stats)
        elif digest == "lin64":
            self._queued.append((key, what, _lin64(flat), stats))
        else:
            raise ValueError(f"unknown digest {digest!r}; expected one of {sorted(DIGESTS)}")

    def finish(self) -> dict:
        out = dict(self._done)
        by_device: dict = {}
        for item in self._queued:
            by_device.setdefault(item[2].device, []).append(item)
        for items in by_device.values():  # one copy to the host per device
            sums = torch.cat([s for _, _, s, _ in items]).cpu().numpy()
            stats = torch.stack([st for _, _, _, st in items]).cpu()
            row = 0
            for i, (key, what, s, _) in enumerate(items):
                blocks = tuple(sums[r].tobytes() for r in range(row, row + s.shape[0]))
                row += s.shape[0]
                out[key] = _print(what, "lin64", blocks, stats[i])
        self._done, self._queued = {}, []
        return out


def _print(what: tuple, digest: str, blocks: tuple[bytes, ...], stats: torch.Tensor) -> GradPrint:
    (shape, dtype, numel), (total, lo, hi) = what, (float(v) for v in stats.cpu())
    return GradPrint(shape=shape, dtype=dtype, digest=digest, blocks=blocks, total=total,
                     absmax=max(abs(lo), abs(hi)) if numel else 0.0)


DIGESTS = ("blake2b", "lin64")


def keep(t: torch.Tensor) -> torch.Tensor | GradPrint:
    """What a pass keeps of gradient ``t``: a host copy when small, else its print (``keep_all`` for many)."""
    return keep_all({None: t})[None]


def keep_all(grads: dict) -> dict:
    """``keep`` of every ``{key: gradient}``, the GPU prints read back with one host sync."""
    out, batch = {}, Batch()
    for key, t in grads.items():
        if t.numel() <= KEEP:
            out[key] = t.detach().to("cpu", copy=True)
        else:
            batch.add(key, t)
    out.update(batch.finish())
    return out
