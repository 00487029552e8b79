"""Patches of Megatron-Core: the TopKRouter router-replay patch (``router_replay``) and its env-var
entry point (``autopatch``). Importing this package imports nothing from Megatron."""
