"""Real rollout engines, each run as its own process in its own environment (no torch on this side).

- ``job``: what every engine shares: a job run in its own process group with a timeout, its result and the
  routed-experts arrays read back (moeverify's pickle-free ``.npy`` reader), ``EngineError``;
- ``vllm_process``: vLLM's interpreter found, a job run by ``vllm_child.py``, or a serving engine (``Engine``) that
  takes one step at a time;
- ``vllm_child``: the engine side, run by vLLM's python and never imported by moeverify: loads the model, runs the
  job's steps (generate with route capture, reload or read weights, reset the prefix cache), writes the result;
  the one place the CPU Triton workaround of route capture is written.
"""
