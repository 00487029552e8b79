"""Token identity: one 128-bit key per token from its sequence's content up to and including it.

Legend of shape suffixes: B = sequences (rows), S = positions in a row, T = tokens in router order.

A token's key is a hash of its sequence prefix: two independent 64-bit mixes of (token id, position in its
sequence) summed with wrap-around over the positions ``0..s``, then finalised. Keys depend only on the
content and position of the prefix, so a token keeps its key whatever micro-batch, row, packing offset,
shuffling, epoch or right padding it comes in; two tokens with equal keys have the same prefix (up to a
2**-128 collision chance), which under causal attention means the same routing inputs. Plain tensor math.

Router order: Megatron's router sees hidden states ``[s, b]`` flattened as ``s * B + b`` (THD: the packed
token order, ``B = 1``); under sequence parallel each TP rank holds the ``t``-th contiguous ``1 / tp`` slice
of the sequence dimension.
"""

from __future__ import annotations

import dataclasses

import torch

from moeverify.errors import RouteError

_GOLDEN = -0x61C8864680B583EB  # 0x9E3779B97F4A7C15 as a signed int64
_MUL1 = -0x40A7B892E31B1A47    # 0xBF58476D1CE4E5B9
_MUL2 = -0x6B2FB644ECCEEE15    # 0x94D049BB133111EB
_SEEDS = ((0x243F6A8885A308D3, 0x13198A2E03707344), (0x0A4093822299F31D, 0x082EFA98EC4E6C89))


def _shr(x: torch.Tensor, bits: int) -> torch.Tensor:
    # Logical right shift of int64 (torch shifts signed values arithmetically).
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def _mix(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser on int64 with wrap-around arithmetic."""
    x = (x ^ _shr(x, 30)) * _MUL1
    x = (x ^ _shr(x, 27)) * _MUL2
    return x ^ _shr(x, 31)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class TokenKeys:
    """Keys of one forward's tokens in router order, and where each token sits (for error messages).

    ``key1_T``/``key2_T``: the two 64-bit halves; ``pad_T``: tokens the model was told are padding (they may
    route natively when not found); ``seq_T``/``pos_T``: batch row or packed sequence index, and position."""

    key1_T: torch.Tensor
    key2_T: torch.Tensor
    pad_T: torch.Tensor | None
    seq_T: torch.Tensor
    pos_T: torch.Tensor

    @property
    def tokens(self) -> int:
        return int(self.key1_T.shape[0])


def _prefix_keys(ids_N: torch.Tensor, pos_N: torch.Tensor, start_N: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Two prefix hashes per token of a flat token list; ``start_N``: flat index of each token's first token."""
    keys = []
    for seed_a, seed_b in _SEEDS:
        value_N = _mix(ids_N * _GOLDEN + pos_N * _MUL1 + seed_a)
        total_N = torch.cumsum(value_N, dim=0)
        before_N = torch.where(start_N > 0, total_N[(start_N - 1).clamp(min=0)], torch.zeros_like(total_N))
        keys.append(_mix(total_N - before_N + pos_N * _MUL2 + seed_b))
    return tuple(keys)


def row_keys(input_ids_BS: torch.Tensor, *, padding_mask_BS: torch.Tensor | None = None) -> TokenKeys:
    """Keys of a ``[B, S]`` batch, one sequence per row from position 0, in router order ``s * B + b``.

    Args:
        padding_mask_BS: Megatron's ``padding_mask`` (True = padding), or None.
    """
    if input_ids_BS.dim() != 2:
        raise RouteError(f"token keys need input_ids [B, S], got shape {tuple(input_ids_BS.shape)}")
    b, s = input_ids_BS.shape
    device = input_ids_BS.device
    pos_BS = torch.arange(s, device=device).expand(b, s)
    start_BS = (torch.arange(b, device=device) * s)[:, None].expand(b, s)
    key1, key2 = _prefix_keys(input_ids_BS.reshape(-1).long(), pos_BS.reshape(-1), start_BS.reshape(-1))

    def router_order(x_BS):  # [B, S] -> [S * B] in s * B + b order
        return x_BS.reshape(b, s).t().reshape(-1)

    pad = router_order(padding_mask_BS.bool()) if padding_mask_BS is not None else None
    seq_BS = torch.arange(b, device=device)[:, None].expand(b, s)
    return TokenKeys(key1_T=router_order(key1), key2_T=router_order(key2), pad_T=pad,
                     seq_T=router_order(seq_BS), pos_T=router_order(pos_BS))


def packed_keys(input_ids_N: torch.Tensor, *, cu_seqlens: torch.Tensor,
                cu_seqlens_padded: torch.Tensor | None = None) -> TokenKeys:
    """Keys of packed (THD) tokens ``[N]``: sequence ``i`` starts at ``cu_seqlens_padded[i]`` (or ``cu_seqlens[i]``)
    and holds ``cu_seqlens[i + 1] - cu_seqlens[i]`` real tokens; the rest of its slot, and anything past the last
    slot, is padding."""
    ids_N = input_ids_N.reshape(-1).long()
    n, device = ids_N.shape[0], ids_N.device
    real = cu_seqlens.to(device=device, dtype=torch.int64)
    slots = real if cu_seqlens_padded is None else cu_seqlens_padded.to(device=device, dtype=torch.int64)
    if real.dim() != 1 or slots.shape != real.shape or real.numel() < 2:
        raise RouteError(f"packed sequences: cu_seqlens {tuple(real.shape)} and cu_seqlens_padded "
                         f"{tuple(slots.shape)} must be equal 1-d [sequences + 1]")
    index_N = torch.arange(n, device=device)
    seq_N = (torch.searchsorted(slots[1:], index_N, right=True)).clamp(max=real.numel() - 2)
    start_N = slots[seq_N]
    pos_N = index_N - start_N
    length_N = (real[1:] - real[:-1])[seq_N]
    pad_N = (pos_N >= length_N) | (index_N >= slots[-1])
    key1, key2 = _prefix_keys(ids_N, pos_N, start_N)
    return TokenKeys(key1_T=key1, key2_T=key2, pad_T=pad_N, seq_T=seq_N, pos_T=pos_N)


def sequence_slice(keys: TokenKeys, *, rank: int, size: int) -> TokenKeys:
    """The ``rank``-th of ``size`` contiguous slices along the sequence dimension (sequence parallel).

    Router order is sequence-major, so a slice of ``S / size`` positions is a contiguous run of rows."""
    n = keys.tokens
    if n % size:
        raise RouteError(f"sequence parallel: {n} tokens are not divisible by tp {size}")
    part = n // size
    cut = slice(rank * part, (rank + 1) * part)
    return TokenKeys(key1_T=keys.key1_T[cut], key2_T=keys.key2_T[cut],
                     pad_T=None if keys.pad_T is None else keys.pad_T[cut], seq_T=keys.seq_T[cut],
                     pos_T=keys.pos_T[cut])
