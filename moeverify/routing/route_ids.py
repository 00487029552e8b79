"""What a route tensor (top-k expert ids) may be: the integer dtypes routes hold, and the safe filler routes
given to tokens that have none (padding, a rollout's missing last row). A leaf under ``routes`` and the rollout
readers, so both use one table.

Legend of shape suffixes: T = tokens, K = top-k.
"""

from __future__ import annotations

import numpy as np
import torch

from moeverify.errors import RouteError

INT_DTYPES = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)


def safe_routes(tokens: int, *, topk: int, num_experts: int, start: int = 0) -> torch.Tensor:
    """``[tokens, topk]`` int64 filler routes: row ``t`` takes experts ``((start + t) * K + j) % E``."""
    if not 1 <= topk <= num_experts:
        raise RouteError(f"need 1 <= topk <= num_experts, got topk {topk}, num_experts {num_experts}")
    rows_T = torch.arange(start, start + tokens, dtype=torch.int64)
    return (rows_T[:, None] * topk + torch.arange(topk, dtype=torch.int64)[None, :]) % num_experts


def validate_topk_ids(
    topk_ids_TK: object,
    *,
    layer: int,
    microbatch: int,
    num_experts: int,
    topk: int,
    tokens: int | None = None,
    rank: int | None = None,
) -> torch.Tensor:
    """Check one route tensor before it is used; raise ``RouteError`` naming where and expected vs got."""
    where = f"layer {layer} mb {microbatch}" if rank is None else f"layer {layer} rank {rank} mb {microbatch}"
    if not isinstance(topk_ids_TK, torch.Tensor):
        raise RouteError(f"{where}: route must be a torch.Tensor, got {type(topk_ids_TK).__name__}")
    if topk_ids_TK.dtype not in INT_DTYPES:
        raise RouteError(f"{where}: route dtype {topk_ids_TK.dtype} is not an integer dtype")
    expected = f"(T={tokens if tokens is not None else 'any'}, K={topk})"
    if (
        topk_ids_TK.dim() != 2
        or topk_ids_TK.shape[1] != topk
        or (tokens is not None and topk_ids_TK.shape[0] != tokens)
    ):
        raise RouteError(f"{where}: route shape {tuple(topk_ids_TK.shape)} != expected {expected}")
    if topk_ids_TK.numel():
        if topk_ids_TK.dtype == torch.uint8:  # unsigned: one max is the whole range check
            lo, hi = 0, int(topk_ids_TK.max())
        else:
            lo, hi = (int(x) for x in torch.aminmax(topk_ids_TK))
        if lo < 0 or hi >= num_experts:
            bad = lo if lo < 0 else hi
            token = int((topk_ids_TK == bad).any(dim=1).nonzero()[0])
            raise RouteError(f"{where}: expert id {bad} out of range [0, {num_experts}) (token {token})")
        dup_T = _duplicate_rows(topk_ids_TK) if topk > 1 else None
        if dup_T is not None and bool(dup_T.any()):  # nonzero (a tenth of the check at 128k rows) only on failure
            dup_rows = dup_T.nonzero().flatten()
            row = int(dup_rows[0])
            raise RouteError(
                f"{where}: token {row} routes to expert(s) twice: {topk_ids_TK[row].tolist()}"
                f" ({dup_rows.numel()} such row(s))"
            )
    return topk_ids_TK


_COLUMNS_FROM = 1024  # rows from which comparing columns pairwise beats sorting every row (CPU, K 2 to 22)


def _duplicate_rows(ids_TK: torch.Tensor) -> torch.Tensor:
    """``[T]`` bool: rows naming an expert twice.

    Few rows, and any off the CPU, sort each row. From 1,024 rows on the CPU (micro-batches recorded, dumps
    read back) the K columns are compared pairwise, K(K-1)/2 vector compares on contiguous columns in NumPy,
    whose transpose and compares of narrow integers are several times faster than torch's: on one core 4x
    faster than the row sort at 4,096 rows of top-8, 2x at top-22, about 40x at 128k rows of top-8. The
    compares write into one buffer (no temporaries): at 128k rows of top-8 uint8 the transpose is 0.3 ms, the
    28 compares 0.17 ms.
    """
    if ids_TK.shape[0] < _COLUMNS_FROM or ids_TK.device.type != "cpu":
        ordered = ids_TK.to(torch.int64).sort(dim=1).values
        return (ordered[:, 1:] == ordered[:, :-1]).any(dim=1)
    cols_KT = np.ascontiguousarray(ids_TK.detach().numpy().T)
    dup_T, same_T = np.zeros(cols_KT.shape[1], dtype=bool), np.empty(cols_KT.shape[1], dtype=bool)
    for i in range(cols_KT.shape[0]):
        for j in range(i + 1, cols_KT.shape[0]):
            dup_T |= np.equal(cols_KT[i], cols_KT[j], out=same_T)
    return torch.from_numpy(dup_T)
