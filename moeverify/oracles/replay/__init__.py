"""The router-replay oracles (docs/replay_matrix.md), one concept per module.

- ``oracle``: ``run``, the ``replay`` check on every rank, and rank 0's report;
- ``setup``: options, the exact fp32 builds and what every subcheck of one router variant shares;
- ``subchecks``: the seven subchecks (equivalence, drift, recompute, cross_layout, native_parity,
  backward_order, validation);
- ``drive``: passes through Megatron's pipeline schedule and hand-written loops, router probes;
- ``checks``: pass-vs-pass comparisons that fill the tallies; ``compare``: bitwise helpers on plain tensors;
- ``impls``: the implementations under test behind one adapter; ``faulty``: broken ones, each caught;
- ``variants``: router configurations.

Nothing is imported here, so ``moeverify.options`` can read ``variants`` without importing torch.
"""
