"""Routes and where they come from: top-k expert ids per layer, their views, and rollout-engine formats.

- ``routes``: ``Routes`` (per layer and micro-batch), ``from_rollout``, ``to_local``/``to_global``, ``map_experts``;
- ``views``: which tokens and layers a rank's routers see under a layout (plain math, no ``Routes``);
- ``route_ids``: what a route tensor may be (dtypes, validation, safe filler routes);
- ``layer_numbering``: which layer a rollout array's layer column holds;
- ``expert_map``: physical expert slots (EPLB) to logical ids;
- ``rollout_arrays``: an engine's per-token arrays as the ``[tokens, L, K]`` array ``from_rollout`` builds from;
- ``rollout_writer``: the rollout directory format of in-job R3 (numpy only, no torch);
- ``engine_routes``: payloads as SGLang, vLLM, TensorRT-LLM and transformers return them (numpy only);
- ``npy_file``: a user's ``.npy``/``.npz`` read without unpickling.

A new rollout-engine format is a decoder in ``engine_routes`` returning ``EngineRoutes``; everything
downstream (``RolloutWriter.add``, ``injob.add_routes``) takes that. This package's ``__init__`` imports
nothing, so ``rollout_writer`` stays torch-free.
"""
