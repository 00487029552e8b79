"""Transformer Engine's THD context-parallel split written out (a reference for moeverify's own, no TE needed)."""


def te_thd_indices(cu_seqlens: list[int], *, cp: int, rank: int) -> list[int]:
    """Transformer Engine's ``thd_partition_indices_kernel``, one local token at a time: the packed positions CP rank
    ``rank`` holds, every slot of ``cu_seqlens`` (padded) zigzag-split on its own."""
    local = [c // cp for c in cu_seqlens]
    out = []
    for token in range(cu_seqlens[-1] // cp):
        seq = max(i for i in range(len(local) - 1) if local[i] <= token)
        seq_len = local[seq + 1] - local[seq]
        index = token - local[seq]
        offset = rank if index < seq_len // 2 else (cp - 1) * 2 - rank
        out.append(index + local[seq] * cp + seq_len // 2 * offset)
    return out
