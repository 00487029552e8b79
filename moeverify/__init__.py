"""moeverify: prove Mixture-of-Experts RL training on Megatron-Core correct.

Router replay (``moeverify.patches.router_replay``), differential oracles (``moeverify.oracles``)
and routing dumps (``moeverify.record``). See DESIGN.md for the public contract.
"""

__version__ = "0.1.0"
