"""Token identity: one 128-bit key per token from its sequence's content up to and including it.

Legend of shape suffixes: B = sequences (rows), S = positions in a row, T = tokens in router order.

A token's key is a hash of its sequence prefix: two independent 64-bit mixes of (token id, position in its
sequence), each summed with wrap-around over the positions ``0..s``. Keys depend only on the
content and position of the prefix, so a token keeps its key whatever micro-batch, row, packing offset,
shuffling, epoch or padding (right padding, or padding on either side that the padding mask marks) it comes in;
two tokens with equal keys have the same prefix (up to a 2**-128 collision chance), which under causal attention
means the same routing inputs. Plain tensor math.

Router order: Megatron's router sees hidden states ``[s, b]`` flattened as ``s * B + b`` (THD: the packed
token order, ``B = 1``); under sequence parallel each TP rank holds the ``t``-th contiguous ``1 / tp`` slice
of the sequence dimension.

Context parallel (megatron-core 0.19.2's ``get_batch_on_this_cp_rank``): BSHD rows are cut into ``2 * cp`` equal
chunks and CP rank ``r`` holds chunks ``r`` and ``2 * cp - 1 - r``, in that order (``zigzag_index``); THD cuts
each packed sequence's slot (``cu_seqlens_padded``, else ``cu_seqlens``, which stay global) the same way, slot
by slot (Transformer Engine's ``thd_get_partitioned_indices``: ``thd_zigzag_index``). A key needs the whole
prefix, so the CP ranks' input ids are put back together (``unshard``), the full keys computed, and this rank's
tokens taken (``take``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from moeverify.errors import RouteError
from moeverify.runtime import hash64

_GOLDEN, _MUL1, _MUL2 = hash64.GOLDEN, hash64.MIX1, hash64.MIX2  # splitmix64's constants, also position salts
_SEEDS = (0x243F6A8885A308D3, 0x13198A2E03707344)  # one per key half
_mix = hash64.mix
# the key of every padding token of a BSHD row: a real token's key equals it with chance 2**-128
PAD_KEY = torch.tensor([-0x5A5A5A5A5A5A5A5B, 0x3C3C3C3C3C3C3C3C], dtype=torch.int64)
_PAD_KEYS: dict = {}  # device -> PAD_KEY there: a blocking host-to-device copy per forward would sync the stream


def _pad_key(device) -> torch.Tensor:
    key = _PAD_KEYS.get(device)
    if key is None:
        key = _PAD_KEYS[device] = PAD_KEY.to(device)
    return key


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class TokenKeys:
    """Keys of one forward's tokens in router order, and where each token sits (for error messages).

    ``keys_2T``: the two 64-bit halves; ``pad_T``: tokens the model was told are padding (they route natively);
    ``locate(t)``: (batch row or packed sequence index, position) of token ``t``; ``last_2T``: the key of the last
    real token of token ``t``'s sequence (the whole sequence's identity, which picks the rollout version a sequence
    was generated under; None where it is not needed); ``seq_T``: the batch row or packed sequence index of each
    token (a per-sequence rollout version is looked up with it; None where unknown); ``sequences``: how many the
    forward holds."""

    keys_2T: torch.Tensor
    pad_T: torch.Tensor | None
    locate: Callable[[int], tuple[int, int]]
    last_2T: torch.Tensor | None = None
    seq_T: torch.Tensor | None = None
    sequences: int | None = None

    @property
    def tokens(self) -> int:
        return int(self.keys_2T.shape[1])


def _values(base: torch.Tensor) -> torch.Tensor:
    """Two independent mixes ``[2, *base.shape]`` of a token's (id, position) value ``base``."""
    return _mix(torch.stack([base + _SEEDS[0], base + _SEEDS[1]]))


def row_keys(input_ids_BS: torch.Tensor, *, padding_mask_BS: torch.Tensor | None = None) -> TokenKeys:
    """Keys of a ``[B, S]`` batch, one sequence per row, in router order ``s * B + b``.

    A row's sequence is its real tokens: with ``padding_mask_BS`` the padding is left out of every prefix and the
    real tokens are numbered from 0 where the first one sits, so a row padded on the left, on the right (or both)
    keys its tokens as the unpadded sequence does (what a rollout engine routed). Padding tokens get one constant
    key that no real token has (``PAD_KEY``); they route natively.

    Args:
        padding_mask_BS: Megatron's ``padding_mask`` (True = padding), or None.
    """
    if input_ids_BS.dim() != 2:
        raise RouteError(f"token keys need input_ids [B, S], got shape {tuple(input_ids_BS.shape)}")
    b, s = input_ids_BS.shape
    device = input_ids_BS.device
    if padding_mask_BS is None:
        pos_BS = torch.arange(s, device=device).expand(b, s)
        pad = None
    else:
        if tuple(padding_mask_BS.shape) != (b, s):
            raise RouteError(
                f"token keys: padding_mask {tuple(padding_mask_BS.shape)} does not match input_ids {(b, s)}"
            )
        pad_BS = padding_mask_BS.to(device=device, dtype=torch.bool)
        pos_BS = torch.cumsum(~pad_BS, dim=1) - 1  # real tokens numbered from the row's first real token
        pad = pad_BS.t().reshape(-1)
    base_BS = input_ids_BS.long() * _GOLDEN + pos_BS * _MUL1
    values_2BS = _values(base_BS)
    if pad is not None:
        values_2BS = values_2BS.masked_fill(pad_BS, 0)
    keys_2BS = torch.cumsum(values_2BS, dim=2)  # wrap-around sums of each row's (real) prefix
    keys_2T = keys_2BS.transpose(1, 2).reshape(2, s * b)
    if pad is not None:
        keys_2T = torch.where(pad, _pad_key(device)[:, None], keys_2T)
    last_2B = keys_2BS[:, :, -1]  # the row's prefix sum at its end: its last real token's key (padding adds 0)
    last_2T = last_2B[:, None, :].expand(2, s, b).reshape(2, s * b)
    return TokenKeys(
        keys_2T=keys_2T,
        pad_T=pad,
        locate=lambda t: (t % b, int(pos_BS[t % b, t // b])),
        last_2T=last_2T,
        seq_T=torch.arange(b, device=device).repeat(s),
        sequences=b,
    )


def packed_keys(
    input_ids_N: torch.Tensor, *, cu_seqlens: torch.Tensor, cu_seqlens_padded: torch.Tensor | None = None
) -> TokenKeys:
    """Keys of packed (THD) tokens ``[N]``: sequence ``i`` starts at ``cu_seqlens_padded[i]`` (or ``cu_seqlens[i]``)
    and holds ``cu_seqlens[i + 1] - cu_seqlens[i]`` real tokens; the rest of its slot, and anything past the last
    slot, is padding."""
    ids_N = input_ids_N.reshape(-1).long()
    n, device = ids_N.shape[0], ids_N.device
    real, slots = _packed_bounds(cu_seqlens, cu_seqlens_padded, device=device)
    index_N = torch.arange(n, device=device)
    seq_N = (torch.searchsorted(slots[1:], index_N, right=True)).clamp(max=real.numel() - 2)
    start_N = slots[seq_N]
    pos_N = index_N - start_N
    length_N = (real[1:] - real[:-1])[seq_N]
    pad_N = (pos_N >= length_N) | (index_N >= slots[-1])
    total_2N = torch.cumsum(_values(ids_N * _GOLDEN + pos_N * _MUL1), dim=1)
    before_2N = torch.where(start_N > 0, total_2N[:, (start_N - 1).clamp(min=0)], 0)
    keys_2N = total_2N - before_2N
    last_N = (slots[:-1] + (real[1:] - real[:-1]) - 1).clamp(min=0, max=max(n - 1, 0))[seq_N]  # last real token
    return TokenKeys(
        keys_2T=keys_2N,
        pad_T=pad_N,
        locate=lambda t: (int(seq_N[t]), int(pos_N[t])),
        last_2T=keys_2N[:, last_N] if n else keys_2N,
        seq_T=seq_N,
        sequences=real.numel() - 1,
    )


def _packed_bounds(cu_seqlens, cu_seqlens_padded, *, device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(real, slots)`` int64 boundaries of packed sequences, checked: equal 1-d ``[sequences + 1]`` from 0, never
    decreasing, and every sequence's real length within its slot (a real length past its slot would read the next
    slot's first tokens as its own, and its own last tokens as padding). One host read of the small boundaries."""
    real = cu_seqlens.to(device=device, dtype=torch.int64)
    slots = real if cu_seqlens_padded is None else cu_seqlens_padded.to(device=device, dtype=torch.int64)
    if real.dim() != 1 or slots.shape != real.shape or real.numel() < 2:
        raise RouteError(
            f"packed sequences: cu_seqlens {tuple(real.shape)} and cu_seqlens_padded "
            f"{tuple(slots.shape)} must be equal 1-d [sequences + 1]"
        )
    length, room = real[1:] - real[:-1], slots[1:] - slots[:-1]
    bad = (length < 0) | (room < 0) | (length > room)
    if bool(bad.any()) or int(real[0]) != 0 or int(slots[0]) != 0:
        first = int(bad.nonzero()[0, 0]) if bool(bad.any()) else 0
        raise RouteError(
            f"packed sequences: sequence {first} holds {int(length[first])} real tokens (cu_seqlens "
            f"{real[first : first + 2].tolist()}) in a slot of {int(room[first])} (cu_seqlens_padded "
            f"{slots[first : first + 2].tolist()}): cu_seqlens must start at 0 and never decrease, and each real "
            "length fit its padded slot (cu_seqlens_q: real lengths; cu_seqlens_q_padded: the slots)"
        )
    return real, slots


_VERSION_SEEDS = (0x7C5A3B1E9D2F4068, 0x1F83D9ABFB41BD6B)  # one per key half


def version_salt(versions: list[int], *, device) -> torch.Tensor:
    """``[2, V]`` int64: what each key half of a route recorded under rollout version ``versions[v]`` is shifted by,
    so that one table holds several versions' routes of the same tokens apart."""
    v_V = torch.tensor(list(versions), dtype=torch.int64, device=device) * _GOLDEN
    return _mix(torch.stack([v_V + _VERSION_SEEDS[0], v_V + _VERSION_SEEDS[1]]))


def salted(keys: TokenKeys, salt_2: torch.Tensor) -> TokenKeys:
    """``keys`` shifted by one version's salt ``[2]`` (or per token, ``[2, T]``)."""
    salt = salt_2 if salt_2.dim() == 2 else salt_2[:, None]
    return dataclasses.replace(
        keys, keys_2T=keys.keys_2T + salt, last_2T=None if keys.last_2T is None else keys.last_2T + salt
    )


def sequence_slice(keys: TokenKeys, *, rank: int, size: int) -> TokenKeys:
    """The ``rank``-th of ``size`` contiguous slices along the sequence dimension (sequence parallel).

    Router order is sequence-major, so a slice of ``S / size`` positions is a contiguous run of rows."""
    n = keys.tokens
    if n % size:
        raise RouteError(f"sequence parallel: {n} tokens are not divisible by tp {size}")
    part = n // size
    first = rank * part
    return TokenKeys(
        keys_2T=keys.keys_2T[:, first : first + part],
        pad_T=None if keys.pad_T is None else keys.pad_T[first : first + part],
        locate=lambda t: keys.locate(first + t),
        last_2T=None if keys.last_2T is None else keys.last_2T[:, first : first + part],
        seq_T=None if keys.seq_T is None else keys.seq_T[first : first + part],
        sequences=keys.sequences,
    )


def zigzag_index(length: int, *, rank: int, size: int) -> torch.Tensor:
    """Positions ``[length / size]`` of a ``length``-token row that CP rank ``rank`` of ``size`` holds, in its order:
    chunks ``rank`` and ``2 * size - 1 - rank`` of ``2 * size`` equal chunks."""
    if length % (2 * size):
        raise RouteError(f"context parallel: a row of {length} tokens is not divisible by 2 * cp = {2 * size}")
    part = length // (2 * size)
    return torch.cat([torch.arange(c * part, (c + 1) * part) for c in (rank, 2 * size - 1 - rank)])


def thd_zigzag_index(slots: torch.Tensor, *, rank: int, size: int) -> torch.Tensor:
    """Packed positions ``[slots[-1] / size]`` CP rank ``rank`` holds: each sequence slot
    ``[slots[i], slots[i + 1])`` zigzag-split on its own, slot after slot."""
    bounds = [int(x) for x in slots.reshape(-1).tolist()]
    parts = []
    for i, (start, end) in enumerate(zip(bounds[:-1], bounds[1:], strict=True)):
        if (end - start) % (2 * size):
            raise RouteError(
                f"context parallel, packed sequences: slot {i} holds {end - start} tokens, not a multiple "
                f"of 2 * cp = {2 * size}; Megatron's per-document split (Transformer Engine's "
                "thd_get_partitioned_indices) pads every slot to one (cu_seqlens_padded)"
            )
        parts.append(start + zigzag_index(end - start, rank=rank, size=size))
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)


def unshard(parts: list[torch.Tensor], indices: list[torch.Tensor], *, length: int) -> torch.Tensor:
    """The full ``[..., length]`` tensor whose positions ``indices[r]`` (last dim) CP rank ``r`` holds as
    ``parts[r]``."""
    full = parts[0].new_zeros(*parts[0].shape[:-1], length)
    seen = torch.zeros(length, dtype=torch.int64)
    for part, index in zip(parts, indices, strict=True):
        if part.shape[-1] != index.numel():
            raise RouteError(f"context parallel: a rank holds {part.shape[-1]} tokens, its split gives {index.numel()}")
        full[..., index.to(full.device)] = part
        seen[index] += 1
    if not bool((seen == 1).all()):
        raise RouteError("context parallel: the CP ranks' positions do not cover every token exactly once")
    return full


def take(keys: TokenKeys, full_T: torch.Tensor, *, pad_T: torch.Tensor | None = None) -> TokenKeys:
    """The keys of the tokens ``full_T`` (indices in ``keys``' router order), in that order.

    Args:
        pad_T: padding of the taken tokens; default: ``keys.pad_T`` at ``full_T``."""
    full_T = full_T.to(keys.keys_2T.device)
    if pad_T is None and keys.pad_T is not None:
        pad_T = keys.pad_T[full_T]
    return TokenKeys(
        keys_2T=keys.keys_2T[:, full_T],
        pad_T=pad_T,
        locate=lambda t: keys.locate(int(full_T[t])),
        last_2T=None if keys.last_2T is None else keys.last_2T[:, full_T],
        seq_T=None if keys.seq_T is None else keys.seq_T[full_T],
        sequences=keys.sequences,
    )


def row_zigzag_tokens(index_S: torch.Tensor, *, batch: int) -> torch.Tensor:
    """Router-order indices ``s * B + b`` in a full ``[B, S]`` batch of a CP rank's local tokens
    (``s_local * B + b``) whose positions are ``index_S``."""
    return (index_S[:, None] * batch + torch.arange(batch)[None, :]).reshape(-1)


_LENGTH_SEED = 0x452821E638D01377  # the length term of a sequence fingerprint
_SLOT_SEED = 0x0BE5466CF34E90C6  # the packed slot term


def row_fingerprints(input_ids_BS: torch.Tensor, *, padding_mask_BS: torch.Tensor | None = None) -> torch.Tensor:
    """``[B]`` int64: one 64-bit fingerprint per row of a ``[B, S]`` batch, of its content and length.

    A row's fingerprint mixes the wrap-around sum of its real tokens' (id, position) values (the first half of
    ``row_keys``) with its length (``S``, or the count of tokens ``padding_mask`` does not mark as padding)."""
    if input_ids_BS.dim() != 2:
        raise RouteError(f"token fingerprints need input_ids [B, S], got shape {tuple(input_ids_BS.shape)}")
    s = input_ids_BS.shape[1]
    base_BS = input_ids_BS.long() * _GOLDEN + torch.arange(s, device=input_ids_BS.device) * _MUL1
    values_BS = _mix(base_BS + _SEEDS[0])
    real_BS = torch.ones_like(values_BS, dtype=torch.bool) if padding_mask_BS is None else ~padding_mask_BS.bool()
    total_B = values_BS.masked_fill(~real_BS, 0).sum(dim=1)
    length_B = real_BS.sum(dim=1)
    return _mix(total_B ^ _mix(length_B * _GOLDEN + _LENGTH_SEED)).cpu()


def packed_fingerprints(
    input_ids_N: torch.Tensor, *, cu_seqlens: torch.Tensor, cu_seqlens_padded: torch.Tensor | None = None
) -> torch.Tensor:
    """``[sequences]`` int64: the fingerprint of each packed (THD) sequence: its content, length and slot index
    in the pack (see ``packed_keys`` for the slots)."""
    ids_N = input_ids_N.reshape(-1).long()
    real, slots = _packed_bounds(cu_seqlens, cu_seqlens_padded, device=ids_N.device)
    count = real.numel() - 1
    index_N = torch.arange(ids_N.shape[0], device=ids_N.device)
    seq_N = torch.searchsorted(slots[1:], index_N, right=True).clamp(max=count - 1)
    pos_N = index_N - slots[seq_N]
    length = real[1:] - real[:-1]
    pad_N = (pos_N >= length[seq_N]) | (index_N >= slots[-1])  # as packed_keys: slot padding, past the last slot
    values_N = _mix(ids_N * _GOLDEN + pos_N * _MUL1 + _SEEDS[0]).masked_fill(pad_N, 0)
    total = torch.zeros(count, dtype=torch.int64, device=ids_N.device).index_add_(0, seq_N, values_N)
    slot = torch.arange(count, device=ids_N.device)
    return _mix(total ^ _mix(length * _GOLDEN + _LENGTH_SEED) ^ _mix(slot * _MUL2 + _SLOT_SEED)).cpu()


def fingerprint_hex(value: int) -> str:
    """A fingerprint (int64 bit pattern) as 16 hex digits."""
    return f"{value & 0xFFFFFFFFFFFFFFFF:016x}"
