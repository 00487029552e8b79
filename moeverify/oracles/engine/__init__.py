"""Checks against a real rollout engine, run as its own process (``moeverify.engines``).

- ``conformance``: an engine's captured routes against the trainer's native routing of the same tokens and weights,
  per layer and position, near ties told apart from wrong routes; what a vLLM keeps against the HF tensors, bitwise
  where kept and by outputs where packed;
- ``megatron_engine``: Megatron-Core's own inference engine (``DynamicInferenceEngine`` recording routes) as its own
  process on a job, for the same comparisons.
"""
