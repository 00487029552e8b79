"""verl's Megatron actor under in-job R3 with the rollout engine's routes (``moeverify.integrations.verl_engine``).

One step turns it on, in verl's own config: ``actor_rollout_ref.model.external_lib=moeverify.integrations.verl``
(verl's ``HFModelConfig`` imports it in every worker before the model is built), with the rollout returning its routes
(``actor_rollout_ref.rollout.enable_rollout_routing_replay=True``) and verl's own replay off
(``router_replay.mode=disabled``). Importing this module installs the hooks; ``verl_engine.uninstall()`` removes them.
"""

from __future__ import annotations

from moeverify.integrations import verl_engine

verl_engine.install()
