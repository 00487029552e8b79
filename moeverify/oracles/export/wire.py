"""The export oracle's collectives: one dedicated gloo group with a timeout, small byte gathers to
rank 0, one-int broadcasts, and pieces moved point to point in bounded chunks.

Everything the oracle moves between ranks is its own data (JSON headers and raw tensor bytes);
nothing is pickled. Pieces travel rank by rank and chunk by chunk so that rank 0 never holds more
than one chunk of another rank's piece at a time.

Legend: ``C`` = elements in one chunk.
"""

from __future__ import annotations

import datetime
import json

import torch
import torch.distributed as dist

from moeverify import runtime

CHUNK = 1 << 20  # elements per point-to-point chunk

_groups: dict[tuple[int, int], tuple[object, object]] = {}  # key -> (the world it was made in, group)


def control_group(timeout_s: float):
    """A gloo group over all ranks with its own timeout (made once per timeout; collective on first use)."""
    key = (dist.get_world_size(), int(timeout_s))
    world, group = _groups.get(key, (None, None))
    if world is not dist.group.WORLD:  # none yet, or made in a world since destroyed (a re-initialised process)
        group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=int(timeout_s)))
        runtime.keep_group(group)
        _groups[key] = (dist.group.WORLD, group)
    return group


def gather_json(obj, *, group, rank: int, world_size: int) -> list | None:
    """Gather one JSON-able object per rank to rank 0 (None elsewhere)."""
    payload = torch.frombuffer(bytearray(json.dumps(obj).encode()), dtype=torch.uint8)
    size = torch.tensor([payload.numel()], dtype=torch.int64)
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(world_size)]
    dist.all_gather(sizes, size, group=group)
    longest = max(int(s) for s in sizes)
    padded = torch.zeros(longest, dtype=torch.uint8)
    padded[: payload.numel()] = payload
    bufs = [torch.zeros(longest, dtype=torch.uint8) for _ in range(world_size)] if rank == 0 else None
    dist.gather(padded, gather_list=bufs, dst=0, group=group)
    if bufs is None:  # not rank 0
        return None
    return [json.loads(bytes(b[: int(s)].numpy()).decode()) for b, s in zip(bufs, sizes, strict=True)]


def broadcast_int(value: int, *, group) -> int:
    """Rank 0's ``value`` on every rank."""
    t = torch.tensor([value], dtype=torch.int64)
    dist.broadcast(t, src=0, group=group)
    return int(t)


def broadcast_ints(values: list[int], *, group) -> list[int]:
    """Rank 0's ``values`` on every rank (every rank passes a list of the same length)."""
    t = torch.tensor(values, dtype=torch.int64)
    dist.broadcast(t, src=0, group=group)
    return t.tolist()


def all_gather_ints(values: list[int], *, group, world_size: int) -> list[list[int]]:
    """A fixed-size int64 vector from every rank, on every rank."""
    t = torch.tensor(values, dtype=torch.int64)
    out = [torch.zeros_like(t) for _ in range(world_size)]
    dist.all_gather(out, t, group=group)
    return [o.tolist() for o in out]


def send_piece(positions_P: torch.Tensor | None, values_P: torch.Tensor, *, start: int | None, dst: int, group) -> None:
    """Send a piece in chunks: positions (int64; skipped for a contiguous range) then the values' raw bytes."""
    n = values_P.numel()
    raw = values_P.contiguous()
    for a in range(0, n, CHUNK):
        b = min(a + CHUNK, n)
        if start is None:
            assert positions_P is not None, "a piece that is not one range carries its positions"
            dist.send(positions_P[a:b].contiguous(), dst=dst, group=group)
        dist.send(raw[a:b].view(torch.uint8), dst=dst, group=group)


def recv_piece_chunks(*, n: int, dtype: torch.dtype, start: int | None, src: int, group):
    """Yield ``(positions_C or slice, values_C)`` for a piece sent by ``send_piece``."""
    width = torch.empty((), dtype=dtype).element_size()
    for a in range(0, n, CHUNK):
        b = min(a + CHUNK, n)
        positions_C: slice | torch.Tensor
        if start is not None:
            positions_C = slice(start + a, start + b)
        else:
            received_C = torch.empty(b - a, dtype=torch.int64)
            dist.recv(received_C, src=src, group=group)
            positions_C = received_C
        raw = torch.empty((b - a) * width, dtype=torch.uint8)
        dist.recv(raw, src=src, group=group)
        yield positions_C, raw.view(dtype)


def local_piece_chunks(positions_P: torch.Tensor | None, values_P: torch.Tensor, *, start: int | None):
    """The same chunking for rank 0's own piece (no copies)."""
    n = values_P.numel()
    for a in range(0, n, CHUNK):
        b = min(a + CHUNK, n)
        pos: slice | torch.Tensor
        if start is not None:
            pos = slice(start + a, start + b)
        else:
            assert positions_P is not None, "a piece that is not one range carries its positions"
            pos = positions_P[a:b]
        yield pos, values_P[a:b]


def broadcast_json(obj, *, group, rank: int):
    """Rank 0's JSON-able ``obj`` on every rank (the others pass anything)."""
    payload = json.dumps(obj).encode() if rank == 0 else b""
    size = torch.tensor([len(payload)], dtype=torch.int64)
    dist.broadcast(size, src=0, group=group)
    buf = (
        torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        if rank == 0
        else torch.empty(int(size), dtype=torch.uint8)
    )
    if int(size):
        dist.broadcast(buf, src=0, group=group)
    return json.loads(bytes(buf.numpy()).decode())


def broadcast_tensor(
    tensor: torch.Tensor | None, *, shape: tuple[int, ...], dtype: torch.dtype, group, rank: int
) -> torch.Tensor:
    """Rank 0's ``tensor`` (of ``shape`` and ``dtype``, which every rank passes) on every rank, as raw bytes."""
    width = torch.empty((), dtype=dtype).element_size()
    n = 1
    for d in shape:
        n *= d
    if rank == 0:
        assert tensor is not None, "rank 0 passes the tensor it broadcasts"
        raw = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
    else:
        raw = torch.empty(n * width, dtype=torch.uint8)
    if raw.numel():
        dist.broadcast(raw, src=0, group=group)
    return tensor if tensor is not None and rank == 0 else raw.view(dtype).reshape(shape)
