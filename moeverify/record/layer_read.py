"""Reading one indexed tensor of a rank file, and putting a sole holder's rows in global token order.

``read`` copies one tensor's bytes out of its safetensors file with one positioned read: a whole v1 tensor,
or one layer of a v2 packed ``[L, T, K]`` tensor (its bytes are contiguous). Where the bytes lie comes from
the file's header (``data_offsets``), which safetensors checked when the dump was loaded; the index checks
that each entry's span is the size its dtype and shape say. A read copies into memory the caller owns: a
memory-mapped view would show a later overwrite of the file, and touching a fresh mapping costs a page
fault per page (a positioned read of 1 MiB takes a third of the time of copying it out of a new mapping).
With ``order_T`` the rows are then gathered into that order, as whole machine words.

``sequence_order`` is that order for a rank that alone holds its layers' tokens (tp = cp = dp = 1; pipeline
stages each hold their own layers): ``views.token_index`` is then a permutation of the micro-batch's tokens,
and the merge is one gather, with no replica or coverage bookkeeping. Legend: T = tokens, K = top-k,
W = machine words per row.
"""

from __future__ import annotations

import dataclasses
import json
import os
import stat
import struct
from pathlib import Path

import torch

from moeverify.errors import DumpError
from moeverify.routing import views
from moeverify.spec.layout import Layout


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Entry:
    file: Path
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]  # of this layer's tensor: [T, K] (ids, probs) or [T]
    offset: int  # of its first byte in the file
    index: int | None = None  # position of the layer in a v2 packed [L, T, K] tensor
    label: str = ""  # how messages name it (``format.layer_label``)

    @property
    def nbytes(self) -> int:
        return self.dtype.itemsize * int(torch.Size(self.shape).numel())


def data_spans(path: Path) -> dict[str, tuple[int, int]]:
    """``{tensor name: (first byte, end byte)}`` in the file, from its safetensors header (8-byte length, JSON)."""
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    start = 8 + length
    return {
        name: (start + info["data_offsets"][0], start + info["data_offsets"][1])
        for name, info in header.items()
        if name != "__metadata__"
    }


def checked_offset(
    path: Path, name: str, span: tuple[int, int], *, index: int | None, layers: int, layer_bytes: int
) -> int:
    """The first byte of layer ``index`` (or the whole tensor) of ``name``, whose span must hold ``layers`` x
    ``layer_bytes`` bytes."""
    if span[1] - span[0] != layers * layer_bytes:
        raise DumpError(
            f"{path}: tensor {name}: spans {span[1] - span[0]} bytes in the file, its dtype and shape "
            f"say {layers * layer_bytes}"
        )
    return span[0] + (index or 0) * layer_bytes


def read(entry: Entry, *, order_T: torch.Tensor | None = None) -> torch.Tensor:
    """The tensor of ``entry``, copied out of the file; with ``order_T``, its rows in that order (a gather)."""
    raw = torch.empty(entry.nbytes, dtype=torch.uint8)
    try:
        fd = os.open(entry.file, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0))
    except OSError as exc:
        raise DumpError(f"{entry.file}: tensor {entry.label}: unreadable: {exc}") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise DumpError(f"{entry.file}: tensor {entry.label}: unreadable: no longer a regular file")
        view, done = memoryview(raw.numpy()), 0
        while done < entry.nbytes:
            got = os.preadv(fd, [view[done:]], entry.offset + done)
            if got <= 0:
                raise DumpError(
                    f"{entry.file}: tensor {entry.label}: unreadable: the file ends {entry.nbytes - done} "
                    f"byte(s) short of the tensor (truncated since it was loaded)"
                )
            done += got
    except OSError as exc:
        raise DumpError(f"{entry.file}: tensor {entry.label}: unreadable: {exc}") from None
    finally:
        os.close(fd)
    out = raw.view(entry.dtype).view(entry.shape)
    return out if order_T is None else gather_rows(out, order_T)


def gather_rows(ids_TK: torch.Tensor, order_T: torch.Tensor) -> torch.Tensor:
    """``ids_TK[order_T]`` moved as machine words (top-8 uint8 ids: one int64 per row), into a new tensor."""
    words_TW = views.word_rows(ids_TK)
    # one word per row: a 1-D gather, 5x faster than torch's [T, 1] row gather on one core
    words_TW = (
        words_TW.view(-1).index_select(0, order_T) if words_TW.shape[1] == 1 else words_TW.index_select(0, order_T)
    )
    row_bytes = ids_TK.shape[1] * ids_TK.element_size()
    return words_TW.view(torch.uint8).view(order_T.numel(), row_bytes).view(ids_TK.dtype)


def sequence_order(
    layout: Layout, coords: views.RankCoords, *, seq_len: int, batch: int, tokens: int, zigzag: bool
) -> tuple[torch.Tensor | None, torch.Tensor | None] | None:
    """For a rank that holds all ``tokens`` global tokens of a micro-batch: ``(gather_T, token_T)``, the local
    row of each global token (a gather index) and the global token of each local row (``views.token_index``);
    ``(None, None)`` when the rows are already in global order. None when the rank's ``token_index`` is not a
    permutation of the tokens (the general merge then names what is wrong)."""
    token_T = views.token_index(
        layout, tp_rank=coords.tp, cp_rank=coords.cp, dp_rank=coords.dp, seq_len=seq_len, batch=batch, zigzag=zigzag
    )
    if token_T.numel() != tokens or (tokens and (int(token_T.min()) < 0 or int(token_T.max()) >= tokens)):
        return None
    if not bool((torch.bincount(token_T, minlength=tokens) == 1).all()):
        return None
    if torch.equal(token_T, torch.arange(tokens)):
        return None, None
    return torch.empty_like(token_T).index_copy_(0, token_T, torch.arange(tokens)), token_T
