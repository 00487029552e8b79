"""The router-replay oracles (docs/replay_matrix.md), one concept per module.

- ``oracle``: ``run``, the ``replay`` check on every rank, and rank 0's report;
- ``setup``: the exact fp32 builds and what every subcheck of one router variant shares (the options are
  ``moeverify.spec.checks.ReplayOptions``, the router variants ``moeverify.spec.router_variants``);
- ``subchecks``: the subchecks (``moeverify.spec.checks`` names them); ``token_counts``: the expert-bias
  token counts subcheck; ``mtp_views``: routes of MTP layers as a rank sees them; ``slot_order``: the canonical
  order of a token's top-k slots; ``toggles``: replay switched on and off within one model;
  ``grad_print``: gradient prints compared across passes; ``handover``: a later build's weights from the build
  before it, on the GPU, where they are still the loaded ones;
- ``drive``: passes through Megatron's pipeline schedule and hand-written loops, router probes;
- ``pass_checks``: pass-vs-pass comparisons that fill the tallies; ``compare``: bitwise helpers on plain tensors;
  ``moved_weights``: the weights a replayed pass gives on a moved router against its scoring function;
- ``impls``: the implementations under test behind one adapter; ``faulty``: broken ones, each caught.
"""
