"""Models as values, torch-free: which model a scenario runs and what checks need to know about it.

- ``ref``: ``ModelRef``, a family name or a user model, as a value that travels in the plan;
- ``configs``: the tiny families' ``config.json`` content made in code, and their shapes and traits;
- ``traits``: what checks read from an HF config (never from a family name);
- ``user``: a user's HF model directory or ``config.json`` with ``--model-set`` overrides;
- ``kimi``: Kimi-K2's config data, and its classes made in code when the family is built.

Building a model into Megatron is ``moeverify.models`` (torch, Megatron-Bridge).
"""
