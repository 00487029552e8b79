"""Real rollout engines, each run as its own process in its own environment (no torch on this side).

- ``vllm_process``: writes a job, runs ``vllm_child.py`` under vLLM's venv with a timeout, reads back each step's
  record and the routed-experts arrays (moeverify's pickle-free ``.npy`` reader);
- ``vllm_child``: the engine side, run by vLLM's python and never imported by moeverify: loads the model, runs the
  job's steps (generate with route capture, reload or read weights, reset the prefix cache), writes the result;
  the one place the CPU Triton workaround of route capture is written.
"""
