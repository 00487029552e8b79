"""RL frameworks' own trainers under in-job router replay, turned on by the user with one step. Above ``patches`` in the
layers: an integration hands a framework's batch to ``patches.injob`` where the framework holds it.

- ``verl``: importing it (verl's ``actor_rollout_ref.model.external_lib=moeverify.integrations.verl``) hooks verl's
  Megatron engine; ``verl_engine``: the hooks, the version check and the batch read (``routed_experts``, versions,
  tokens the rollout engine never routed).
"""
