"""Differential oracles: the checks ``moeverify run`` runs on every rank.

- ``export``: a subject's per-tensor export vs Megatron-Bridge's ``export_hf_weights``, bit for bit;
- ``replay``: router replay vs native routing and Megatron-Core's own ``RouterReplay``;
- ``engine``: a real rollout engine's captured routes and synced weights against the trainer's;
- ``roundtrip``: HF -> Megatron -> HF through the bridge, bitwise; ``hf_parity``: Megatron vs HF forward;
- ``context``: what a check receives; ``results``: the records every check returns;
- ``bits``: raw-bit comparison, the one definition every oracle uses.
"""
