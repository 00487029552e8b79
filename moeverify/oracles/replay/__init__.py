"""The router-replay oracles (docs/replay_matrix.md), one concept per module.

- ``oracle``: ``run``, the ``replay`` check on every rank, and rank 0's report;
- ``setup``: the exact fp32 builds and what every subcheck of one router variant shares (the options are
  ``moeverify.spec.checks.ReplayOptions``, the router variants ``moeverify.spec.router_variants``);
- ``subchecks``: the seven subchecks (equivalence, drift, recompute, cross_layout, native_parity,
  backward_order, validation);
- ``drive``: passes through Megatron's pipeline schedule and hand-written loops, router probes;
- ``checks``: pass-vs-pass comparisons that fill the tallies; ``compare``: bitwise helpers on plain tensors;
- ``impls``: the implementations under test behind one adapter; ``faulty``: broken ones, each caught.
"""
