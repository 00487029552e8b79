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

A pass's GPU prints are made in one ``Batch``: gradients of one size are digested together (a 48-layer model has
12,500 gradients in a few hundred sizes), every digest, sum and extrema is queued on the device and read back with
one copy at the end (a host sync a gradient was seconds a pass, a digest a gradient a second more).
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
from collections.abc import Hashable, Mapping
from concurrent.futures import ThreadPoolExecutor

import torch

from moeverify.oracles.bits import bits
from moeverify.runtime import hash64

KEEP = 1 << 16  # elements: kept as a tensor up to this size
_HASH_THREADS = min(8, os.cpu_count() or 1)  # host blocks hashed at once (1.9x on two cores)
BLOCK = 1 << 20  # elements per digest block
_ROWS = 32  # blocks hashed at once on the GPU: bounds the int64 temporaries (24 bytes an element: 768 MB)
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
        return (self.shape, self.dtype, self.digest, self.blocks) == (
            other.shape,
            other.dtype,
            other.digest,
            other.blocks,
        )

    def describe(self, other: GradPrint) -> str:
        """Why ``other`` (the run under test) is not bitwise this (expected)."""
        if self.digest != other.digest:
            return f"digests of two kinds ({self.digest} vs {other.digest}) cannot be compared"
        if self.shape != other.shape:
            return f"shape {self.shape} != {other.shape}"
        if self.dtype != other.dtype:
            return f"dtype {self.dtype} != {other.dtype}"
        differ = [i for i, (a, b) in enumerate(zip(self.blocks, other.blocks, strict=True)) if a != b]
        if not differ:
            return "equal"
        n = 1
        for d in self.shape:
            n *= d
        first = differ[0] * BLOCK
        return (
            f"{len(differ)} of {len(self.blocks)} block(s) of {BLOCK} elements differ; first in flat "
            f"[{first}, {min(first + BLOCK, n)}); sum {self.total!r} != {other.total!r}, max |g| "
            f"{self.absmax!r} vs {other.absmax!r}"
        )


def _blake2b(flat: torch.Tensor) -> tuple[bytes, ...]:
    raw = flat.cpu().numpy()  # a view when already on the host

    def block(i: int) -> bytes:
        return hashlib.blake2b(raw[i : i + BLOCK], digest_size=16).digest()

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


def _lin64(flat_GN: torch.Tensor) -> torch.Tensor:
    """``[g, rows, lanes]`` int64 on the device of ``flat_GN`` (``[g, n]`` raw bits, one tensor a row): each row's
    blocks' keyed sums (a row's last block padded with zero bits: the shape tells how many are real). At most
    ``_ROWS`` blocks are widened to int64 at once."""
    g, n = flat_GN.shape
    rows = -(-n // BLOCK)
    keys = _keys(flat_GN.device)
    sums = torch.empty(g, rows, len(_LANES), dtype=torch.int64, device=flat_GN.device)
    step = max(1, _ROWS // max(g, 1))  # blocks of every row at once
    for start in range(0, rows, step):
        part = flat_GN[:, start * BLOCK : (start + step) * BLOCK].to(torch.int64)
        if part.shape[1] % BLOCK:
            part = torch.nn.functional.pad(part, (0, BLOCK - part.shape[1] % BLOCK))
        part = part.view(g, -1, 1, BLOCK)
        sums[:, start : start + part.shape[1]] = (part * keys).sum(dim=3)
    return sums


def _stats(vals_GN: torch.Tensor) -> torch.Tensor:
    """``[g, 3]`` float64: each row's sum, least and largest element (zeros for empty rows)."""
    g, n = vals_GN.shape
    if n == 0:
        return torch.zeros(g, 3, dtype=torch.float64, device=vals_GN.device)
    lo, hi = torch.aminmax(vals_GN, dim=1)
    total = vals_GN.sum(dim=1, dtype=torch.float64 if vals_GN.is_floating_point() else torch.int64)
    return torch.stack([total.double(), lo.double(), hi.double()], dim=1)


class Batch:
    """Prints of many tensors with one host sync: ``add`` takes a tensor, ``finish`` digests the GPU ones where they
    are, tensors of one device, dtype and size together (a 48-layer model's 12,500 gradients are a few hundred
    shapes: 128 experts a layer share two), reads every digest back at once and returns ``{key: GradPrint}``. A
    digest does not depend on the tensors it was made with (each row is summed on its own, in wrapping integer
    arithmetic); sums and extrema, for messages only, may differ in the last bits of the float64 sum."""

    def __init__(self) -> None:
        self._done: dict = {}  # key -> GradPrint (host digests, made at once)
        self._pending: dict = {}  # (device, dtype, numel) -> [(key, shape, tensor)], digested in ``finish``

    def add(self, key, t: torch.Tensor, *, digest: str | None = None) -> None:
        digest = digest or ("blake2b" if t.device.type == "cpu" else "lin64")
        if digest not in DIGESTS:
            raise ValueError(f"unknown digest {digest!r}; expected one of {sorted(DIGESTS)}")
        t = t.detach()
        if digest == "blake2b":
            what = (tuple(t.shape), t.dtype, t.numel())
            self._done[key] = _print(
                what, digest, _blake2b(bits(t.contiguous()).reshape(-1)), _stats(t.reshape(1, -1))[0]
            )
        else:
            self._pending.setdefault((t.device, t.dtype, t.numel()), []).append((key, tuple(t.shape), t))

    def finish(self) -> dict:
        out = dict(self._done)
        queued: dict = {}  # device -> [(keys and shapes, dtype, numel, sums [g, rows, lanes], stats [g, 3])]
        for (device, dtype, numel), items in self._pending.items():
            per = max(1, _ROWS // max(1, -(-numel // BLOCK)))  # tensors digested at once
            for i in range(0, len(items), per):
                part = items[i : i + per]
                vals = part[0][2].reshape(1, -1) if len(part) == 1 else torch.stack([t.reshape(-1) for _, _, t in part])
                queued.setdefault(device, []).append(
                    ([(k, s) for k, s, _ in part], dtype, numel, _lin64(bits(vals)), _stats(vals))
                )
        for items in queued.values():  # one copy to the host per device
            sums = torch.cat([s.reshape(-1, len(_LANES)) for *_, s, _ in items]).cpu().numpy()
            stats = torch.cat([st for *_, st in items]).cpu()
            row = srow = 0
            for names, dtype, numel, s, _ in items:
                rows = s.shape[1]
                for key, shape in names:
                    blocks = tuple(sums[r].tobytes() for r in range(row, row + rows))
                    row += rows
                    out[key] = _print((shape, dtype, numel), "lin64", blocks, stats[srow])
                    srow += 1
        self._done, self._pending = {}, {}
        return out


def _print(what: tuple, digest: str, blocks: tuple[bytes, ...], stats: torch.Tensor) -> GradPrint:
    (shape, dtype, numel), (total, lo, hi) = what, (float(v) for v in stats.cpu())
    return GradPrint(
        shape=shape,
        dtype=dtype,
        digest=digest,
        blocks=blocks,
        total=total,
        absmax=max(abs(lo), abs(hi)) if numel else 0.0,
    )


DIGESTS = ("blake2b", "lin64")


def keep(t: torch.Tensor) -> torch.Tensor | GradPrint:
    """What a pass keeps of gradient ``t``: a host copy when small, else its print (``keep_all`` for many)."""
    return keep_all({None: t})[None]


def keep_all[K: Hashable](grads: Mapping[K, torch.Tensor]) -> dict[K, torch.Tensor | GradPrint]:
    """``keep`` of every ``{key: gradient}``: the small ones copied to the host together (one copy per device and
    dtype), the GPU prints read back with one host sync."""
    out: dict[K, torch.Tensor | GradPrint] = {}
    batch = Batch()
    small: dict[tuple[torch.device, torch.dtype], list[tuple[K, torch.Tensor]]] = {}
    for key, t in grads.items():
        if t.numel() <= KEEP:
            small.setdefault((t.device, t.dtype), []).append((key, t.detach()))
        else:
            batch.add(key, t)
    for items in small.values():
        flat = torch.cat([t.reshape(-1) for _, t in items]).to("cpu", copy=True)
        for (key, t), host in zip(items, flat.split([t.numel() for _, t in items]), strict=True):
            out[key] = host.view(t.shape)
    out.update(batch.finish())
    return out
