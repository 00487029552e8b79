"""moeverify: prove Mixture-of-Experts RL training on Megatron-Core correct.

Packages by layer (imports flow down this list; ``pyproject.toml``'s import contract enforces it):

- ``__main__``, ``cli``: the ``moeverify`` command's entry point and dispatch;
- ``commands``: one module per command (``run``, ``dump``, ``doctor``, ``bench``);
- ``runner``: the torchrun launcher and per-rank worker behind ``moeverify run``;
- ``oracles``: the checks (export, replay, roundtrip, hf_parity);
- ``subjects``: built-in export subjects (the exporters the export check tests);
- ``integrations``: RL frameworks' own trainers under in-job router replay, turned on with one step (verl);
- ``patches``: the router-replay patch of Megatron-Core and its in-job front ends;
- ``record``: routing dumps; ``models``: tiny families built into Megatron through Megatron-Bridge; ``engines``:
  real rollout engines (vLLM) run as their own processes, driven by jobs and read back from files;
- ``runtime``: backends, process groups, CPU ranks;
- ``routing``: ``Routes`` and their views, layer numbering, expert maps, rollout-engine formats;
- ``spec``: what to run, torch-free: checks and options, scenario files, layouts, bug classes, timeouts, models;
- ``files``: atomic writes; ``errors``: the exception classes.

Public faces kept for scripts (each *is* the module it names): ``routes``, ``views``, ``layout``,
``rollout_writer``, ``engine_routes``. See docs/design.md for where a new check, family, subject, engine
format or command goes.
"""

__version__ = "0.1.0"
