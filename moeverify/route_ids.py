"""What a route tensor (top-k expert ids) may be: the integer dtypes routes hold, and the safe filler routes
given to tokens that have none (padding, a rollout's missing last row). A leaf under ``routes`` and the rollout
readers, so both use one table.

Legend of shape suffixes: T = tokens, K = top-k.
"""

from __future__ import annotations

import torch

from moeverify.errors import RouteError

INT_DTYPES = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)


def safe_routes(tokens: int, *, topk: int, num_experts: int, start: int = 0) -> torch.Tensor:
    """``[tokens, topk]`` int64 filler routes: row ``t`` takes experts ``((start + t) * K + j) % E``."""
    if not 1 <= topk <= num_experts:
        raise RouteError(f"need 1 <= topk <= num_experts, got topk {topk}, num_experts {num_experts}")
    rows_T = torch.arange(start, start + tokens, dtype=torch.int64)
    return (rows_T[:, None] * topk + torch.arange(topk, dtype=torch.int64)[None, :]) % num_experts
