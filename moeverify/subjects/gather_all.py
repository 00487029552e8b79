"""A naive full-tensor exporter: every parameter all-gathered to full size on every rank, then converted.

This is how most RL stacks stream weights to a rollout engine (TP all-gather, PP broadcast, EP
all-gather per parameter, then the HF conversion). It is built on Megatron-Bridge's conversion
tasks and each mapping's ``megatron_to_hf`` (which do exactly those collectives), with the tied
output name added where the source checkpoint has it. It is the peer the sharded exporter is
benchmarked against: correct, but every rank holds each full tensor.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from moeverify.models.checkpoint import checkpoint_shapes


def gather_tensors(ctx) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, full tensor)`` per converted parameter, in conversion-task order."""
    names = set(checkpoint_shapes(ctx.hf_path))
    config = ctx.model_chunks[0]
    while hasattr(config, "module"):
        config = config.module
    tied = bool(getattr(config.config, "share_embeddings_and_output_weights", False))
    for task in ctx.bridge.get_conversion_tasks(ctx.model_chunks):
        if task is None:
            continue
        converted = task.mapping.megatron_to_hf(task.param_weight, task.megatron_module)
        for name, tensor in converted.items():
            tensor = tensor.detach().cpu()
            yield name, tensor
            if (
                tied
                and task.global_param_name.endswith("embedding.word_embeddings.weight")
                and name.startswith("model.")
                and "lm_head.weight" in names
            ):
                yield "lm_head.weight", tensor.clone()
