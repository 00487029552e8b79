"""Per-tensor exporters the export oracle can test (docs/design.md, "The checks"; docs/export.md, "Subjects").

- ``bridge``: Megatron-Bridge's own ``export_hf_weights`` as a full-tensor subject (must always pass);
- ``sharded``: a reference sharded exporter: each rank yields only its local shard with flat HF
  positions (``shard_rows``, placed by ``placement``'s index arithmetic, yielding ``slots``' records);
- ``gather``: a naive full-tensor exporter that all-gathers every parameter (``gather_all``; the peer for
  benchmarks);
- ``verl``: verl 0.9.1's delta export as an adapter.

Factories are called with a ``moeverify.oracles.export.SubjectContext``; Megatron is imported only
when one runs.
"""


def bridge(ctx):
    """Megatron-Bridge's ``export_hf_weights`` streamed as ``(hf_name, tensor)`` pairs."""
    return iter(ctx.bridge.export_hf_weights(ctx.model_chunks, cpu=True, show_progress=False))


def sharded(ctx):
    """The reference sharded exporter (local shards only, flat HF positions)."""
    from moeverify.subjects.shard_rows import sharded_rows  # lazy: torch

    return sharded_rows(ctx)


def gather(ctx):
    """Every parameter all-gathered to full size on every rank, then converted (what most RL stacks do)."""
    from moeverify.subjects.gather_all import gather_tensors  # lazy: torch

    return gather_tensors(ctx)


__all__ = ["bridge", "sharded", "gather"]
