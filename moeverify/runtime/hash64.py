"""splitmix64 in torch int64 arithmetic (wrapping), the one integer mixer the project uses: seeded weights
(``models.seeded``) are made with it, token identities are keyed with it (``patches.token_keys``) and large
gradients are fingerprinted with it on the GPU (``oracles.replay.grad_print``). Integer operations only, so a CPU and a
GPU compute the same bits.
"""

from __future__ import annotations

import torch


def signed(value: int) -> int:
    """An unsigned 64-bit constant as the int64 with the same bits."""
    return value - (1 << 64) if value >= 1 << 63 else value


GOLDEN = signed(0x9E3779B97F4A7C15)  # splitmix64's increment and multipliers
MIX1, MIX2 = signed(0xBF58476D1CE4E5B9), signed(0x94D049BB133111EB)


def shr(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's ``>>`` is arithmetic)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def mix(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finalizer of int64 ``x``: a bijection of 64-bit patterns that spreads every input bit."""
    x = (x ^ shr(x, 30)) * MIX1
    x = (x ^ shr(x, 27)) * MIX2
    return x ^ shr(x, 31)
