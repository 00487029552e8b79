"""Differential oracles: export vs Megatron-Bridge, router replay vs native routing, HF round trip."""
