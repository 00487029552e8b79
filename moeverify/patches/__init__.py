"""Patches of Megatron-Core's routing, in three groups. Importing this package imports nothing from Megatron.

The replay engine:

- ``router_replay``: record and replay ``TopKRouter`` routes, forward and recompute (the public patch);
- ``replay_state``: a session's per-call state on Megatron's top-k calls; ``regions``: which checkpointed
  forward a recomputed call belongs to; ``replay_inputs``: which inputs and model a recording belongs to;
- ``semantics``: router settings replay supports, and a reference; ``compat``: which routing code layout is
  installed; ``routers``: the one router finder; ``token_counts``: expert-bias token counts under replay;
- ``agreement``: the live guard on how often replayed routes agree with native ones;
- ``model_hooks``: forward hooks on every ``GPTModel`` built while installed.

Token identity:

- ``token_keys``: a 128-bit key per token from its sequence up to it; ``identity``: token identity of a
  whole-job recording; ``route_table``: one chunk's routes of one RL step, found again by token identity.

Front ends:

- ``autopatch`` (``autopatch_dump``): replay for jobs you cannot edit, by environment variable;
- ``injob``: in-job R2 and R3 (``MOEVERIFY_ROUTER_REPLAY=r2|r3``); ``rollout_source``: R3 routes from rollout
  files; ``batch_routes``: R3 routes handed over with the batch;
- ``recorder``: dump any Megatron model's routing during ordinary training.
"""
