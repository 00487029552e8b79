"""The one dtype table the project uses: safetensors' header codes with their torch dtypes, and the names HF configs,
the dump format and seeded-weight markers write (``torch.bfloat16`` is ``bfloat16``). Checkpoint reads
(``models.checkpoint``), dump reads (``record.reader``, ``record.format``), seeded weights (``models.seeded``) and
checkpoint making (``models.families``) derive what they need from it.
"""

from __future__ import annotations

import torch

SAFETENSORS: dict[str, torch.dtype] = {  # safetensors' header code -> torch dtype
    "BOOL": torch.bool,
    "U8": torch.uint8,
    "I8": torch.int8,
    "I16": torch.int16,
    "I32": torch.int32,
    "I64": torch.int64,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F32": torch.float32,
    "F64": torch.float64,
}


def name(dtype: torch.dtype) -> str:
    """``dtype``'s name as HF configs and our formats write it: ``bfloat16``."""
    return str(dtype).removeprefix("torch.")


BY_NAME: dict[str, torch.dtype] = {name(d): d for d in SAFETENSORS.values()}  # "bfloat16" -> torch.bfloat16
