"""A replay plugin that records routes by sequence, with no batch size of its own (docs/replay_plugins.md).

Run the replay check with it: ``moeverify run --check replay --replay-impl
examples/recording_replay_plugin.py:factory``. It is moeverify's own adapter, plus, after every log-prob pass, what
that pass recorded laid out by sequence: ``by_sequence[mb]`` is ``[B, S_local, layers, K]``. The routes a plugin
records and replays are ``[T, K]`` per (layer, micro-batch) in Megatron's router order; ``begin_pass`` hands it the
pass's ``PassGeometry`` (sequences per micro-batch, sequence length, the positions this rank's routers see), so
nothing here is hard-coded to a scenario's ``replay_batch``.
"""

from __future__ import annotations

import torch

from moeverify.oracles.replay.impls import MoeverifyReplay, PassGeometry


# [doc:recording-plugin]
class SequenceRecorder(MoeverifyReplay):
    """moeverify's replay, keeping each log-prob pass's routes by sequence: ``by_sequence[mb][b, s, l]`` is the
    top-k of sequence ``b`` at position ``geometry.positions[s]`` in MoE layer ``layers[l]``."""

    name = "sequence_recorder"

    def __init__(self) -> None:
        super().__init__()
        self.geometry: PassGeometry | None = None
        self.layers: list[int] = []
        self.by_sequence: list[torch.Tensor] = []

    def begin_pass(self, geometry: PassGeometry) -> None:
        self.geometry = geometry  # every pass, inside record() or replay(), before its first forward

    def routes(self):
        routes = super().routes()  # the pass just recorded: [T, K] per (layer, mb), token i = (i // B, i % B)
        self.layers = list(routes.layers)
        self.by_sequence = [
            torch.stack([self.geometry.by_sequence(routes.get(layer, mb)) for layer in self.layers], dim=2)
            for mb in range(routes.microbatches)
        ]
        return routes


def factory() -> SequenceRecorder:
    return SequenceRecorder()


# [/doc:recording-plugin]
