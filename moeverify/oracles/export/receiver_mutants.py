"""Receivers that are wrong in one known way, each with the receiver subcheck that must catch it.

``MUTANTS`` maps a name to ``(factory, subcheck)``; ``CONTROLS`` are receivers that must pass. Each mutant is
the fused receiver with one fault an engine's loader can have. ``SUBJECT_MUTANTS`` are subject mutants
(``mutants.py``) whose error the receiver, loading what the subject streamed, must show too, each with the
receiver subcheck that must fail."""

from __future__ import annotations

import torch

from moeverify.oracles.bits import bits
from moeverify.oracles.export.receiver import FusedReceiver
from moeverify.oracles.export.receiver_transformers import transformers_receiver


class _GateUpSwapped(FusedReceiver):
    """Fuses ``gate_up_proj`` / ``w13`` as cat(up, gate) while its mapping says cat(gate, up)."""

    def write(self, name: str, tensor: torch.Tensor) -> None:
        engine, part = self._where[name]
        if "gate_up_proj" in engine or engine.endswith("w13_weight"):
            siblings = [p for p in self.parts[engine] if p.index == part.index]
            if len(siblings) == 2:
                other = siblings[1 - siblings.index(part)]
                part = other if other.length == part.length else part
        part.view(self.tensors[engine]).copy_(tensor)


class _LoadDropped(FusedReceiver):
    """Buffers allocated for every tensor, but the copy of expert 0's ``down_proj`` never happens: its slot
    keeps its initial values (stale memory)."""

    def write(self, name: str, tensor: torch.Tensor) -> None:
        if not name.endswith(".experts.0.down_proj.weight"):
            super().write(name, tensor)


class _ReloadKeepsOld(FusedReceiver):
    """Loads the first export; a weight sync copies nothing into the buffers of the expert weights (w13/w2),
    which keep the old tensors."""

    def write(self, name: str, tensor: torch.Tensor) -> None:
        if getattr(self, "_loaded", False) and self._where[name][0].endswith(("w13_weight", "w2_weight")):
            return
        super().write(name, tensor)

    def load(self, stream):
        held = super().load(stream)
        self._loaded = True
        return held


class _OneUlpInOneExpert(FusedReceiver):
    """Loads every tensor, but the first element of the first expert-0 ``down_proj`` it loads is one ulp off (its
    lowest bit flipped): one element of one expert of one layer, as a fused copy kernel's rounding would leave."""

    def write(self, name: str, tensor: torch.Tensor) -> None:
        if name.endswith(".experts.0.down_proj.weight") and not getattr(self, "_flipped", False):
            self._flipped = True
            tensor = tensor.clone()
            bits(tensor.view(-1))[0] ^= 1
        super().write(name, tensor)


class _ReloadKeepsOneElement(FusedReceiver):
    """A weight sync that updates every element but one: the first element of the first expert-0 ``down_proj``
    keeps the previous weights' value (one element, one step stale)."""

    def write(self, name: str, tensor: torch.Tensor) -> None:
        if getattr(self, "_loaded", False) and name.endswith(".experts.0.down_proj.weight") \
                and not getattr(self, "_kept", False):
            self._kept = True
            engine, part = self._where[name]
            old = part.view(self.tensors[engine]).reshape(-1)[0].clone()
            tensor = tensor.clone()
            tensor.view(-1)[0] = old
        super().write(name, tensor)

    def load(self, stream):
        held = super().load(stream)
        self._loaded = True
        return held


MUTANTS = {
    "gate_up_swapped": (lambda **_: _GateUpSwapped(), "receiver"),
    "load_dropped": (lambda **_: _LoadDropped(), "receiver"),
    "reload_keeps_old": (lambda **_: _ReloadKeepsOld(), "receiver_reload"),
    "one_ulp_in_one_expert": (lambda **_: _OneUlpInOneExpert(), "receiver"),
    "reload_keeps_one_element": (lambda **_: _ReloadKeepsOneElement(), "receiver_reload"),
}
SUBJECT_MUTANTS = {"gate_up_swapped": "receiver", "stale_conversion_cache": "receiver_reload"}
CONTROLS = {"fused": lambda **_: FusedReceiver(),
            "transformers": lambda **kw: transformers_receiver(**kw)}

__all__ = ["CONTROLS", "MUTANTS", "SUBJECT_MUTANTS"]
