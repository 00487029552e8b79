"""Receivers that are wrong in one known way, each with the receiver subcheck that must catch it.

``MUTANTS`` maps a name to ``(factory, subcheck)``; ``CONTROLS`` are receivers that must pass. Each mutant is
the fused receiver with one fault an engine's loader can have. ``SUBJECT_MUTANTS`` are subject mutants
(``mutants.py``) whose error the receiver, loading what the subject streamed, must show too, each with the
receiver subcheck that must fail."""

from __future__ import annotations

import torch

from moeverify.errors import UsageError
from moeverify.oracles.bits import bits
from moeverify.oracles.export.receiver import FusedReceiver, Held, copies_scope, fused
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
    """A weight sync that updates every element but one: the first sync that changes the first element of the first
    expert-0 ``down_proj`` leaves it at the previous weights' value (one element, one step stale); a load of the bits
    already held (a repeated update) changes nothing there either way."""

    def write(self, name: str, tensor: torch.Tensor) -> None:
        if (
            getattr(self, "_loaded", False)
            and name.endswith(".experts.0.down_proj.weight")
            and not getattr(self, "_kept", False)
        ):
            engine, part = self._where[name]
            old = part.view(self.tensors[engine]).reshape(-1)[:1].clone()
            if not torch.equal(bits(old), bits(tensor.reshape(-1)[:1].contiguous())):
                self._kept = True
                tensor = tensor.clone()
                tensor.view(-1)[:1] = old
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
CONTROLS = {"fused": lambda **_: FusedReceiver(), "transformers": lambda **kw: transformers_receiver(**kw)}

__all__ = ["CONTROLS", "MUTANTS", "SUBJECT_MUTANTS"]


# -- the weight-sync classes of 2026 (issue #37): every rank, repeated loads, sleep/wake, tied head, MTP draft -------
def _fused_kw(kw: dict) -> dict:
    """The ``fused`` receiver's own arguments from a factory's options (the tied head, as ``fused`` makes it)."""
    return {"tied": copies_scope(kw.get("hf_path")).tied}


class _SyncRankZeroOnly(FusedReceiver):
    """Every rank loads the first export, but a weight sync reaches only the engine's rank 0 (its driver worker):
    on every other rank the sync copies nothing and the buffers keep the first load."""

    def __init__(self, *, rank: int, **kw) -> None:
        super().__init__(**kw)
        self._rank = rank

    def write(self, name: str, tensor: torch.Tensor) -> None:
        if self._rank != 0 and getattr(self, "_loaded", False):
            return
        super().write(name, tensor)

    def load(self, stream):
        held = super().load(stream)
        self._loaded = True
        return held


class _ShuffleEveryLoad(FusedReceiver):
    """Permutes each received expert tensor in place into its kernel's row order (reusing the received buffer as
    scratch, as with a buffer shared with the sender) and copies it into its slot through the inverse permutation:
    right the first time; a bucket sent again (a retried or repeated update of the same tensors) arrives already
    permuted and is permuted a second time."""

    def write(self, name: str, tensor: torch.Tensor) -> None:
        if ".experts." in name and tensor.dim() >= 1:
            tensor.copy_(tensor.flip(0))  # the layout shuffle, in place, on every load
            tensor = tensor.flip(0)
        super().write(name, tensor)


class _WakeRestoresOldBackup(FusedReceiver):
    """Sleep mode that backs the weights up once, at the first load: ``sleep`` frees the buffers, ``wake_up``
    restores that first backup over whatever later syncs wrote."""

    def load(self, stream):
        held = super().load(stream)
        if getattr(self, "_first", None) is None:
            self._first = {e: t.clone() for e, t in self.tensors.items()}
        return held

    def sleep(self) -> None:
        for t in self.tensors.values():
            t.fill_(float("nan") if t.is_floating_point() else -1)

    def wake_up(self) -> Held:
        for e, t in self.tensors.items():
            t.copy_(self._first[e])
        return Held(tensors=self.tensors, parts=self.parts)


class _WakeBackupTakenOnce(FusedReceiver):
    """Sleep mode whose backup is taken at the first sleep only (verl #7904): the first cycle gives the weights back,
    every later wake restores the first sleep's backup over what the syncs since wrote."""

    def sleep(self) -> None:
        if getattr(self, "_backup", None) is None:
            self._backup = {e: t.clone() for e, t in self.tensors.items()}
        for t in self.tensors.values():
            t.fill_(float("nan") if t.is_floating_point() else -1)

    def wake_up(self) -> Held:
        backup = self._backup
        if backup is None:
            raise UsageError("receiver fused: wake_up() without sleep()")
        for e, t in self.tensors.items():
            t.copy_(backup[e])
        return Held(tensors=self.tensors, parts=self.parts)


class _RepeatCacheTakenOnce(FusedReceiver):
    """Answers a repeated update (every tensor sent already held, bit for bit) from a cache of its buffers filled at
    the first repeat and never refreshed by a sync: the repeat after the first load is right, a repeat after a sync
    puts the first load's weights back (a state captured once and reused)."""

    def load(self, stream):
        items = list(stream)
        if not self.tensors or not all(self._holds(name, tensor) for name, tensor in items):
            return super().load(iter(items))
        if getattr(self, "_cache", None) is None:
            self._cache = {e: t.clone() for e, t in self.tensors.items()}
        for e, t in self.tensors.items():
            t.copy_(self._cache[e])
        return Held(tensors=self.tensors, parts=self.parts)

    def _holds(self, name: str, tensor: torch.Tensor) -> bool:
        if name not in self._where:
            return False
        engine, part = self._where[name]
        held = part.view(self.tensors[engine])
        return held.shape == tensor.shape and torch.equal(bits(held.contiguous()), bits(tensor.contiguous()))


class _TiedHeadStale(FusedReceiver):
    """Keeps its own ``lm_head.weight`` for a tied model, copied from the embedding at the first load only: a weight
    sync updates the embedding, the head stays the first step's."""

    def copy_head(self, embedding: torch.Tensor) -> None:
        if not getattr(self, "_head_copied", False):
            super().copy_head(embedding)
            self._head_copied = True


class _MtpNotSynced(FusedReceiver):
    """Loads the MTP (draft) layers with the rest at start-up, but the weight sync updates the main model only: the
    draft's tensors keep the first load."""

    def __init__(self, *, scope, **kw) -> None:
        super().__init__(**kw)
        self._scope = scope

    def write(self, name: str, tensor: torch.Tensor) -> None:
        if getattr(self, "_loaded", False) and self._scope.is_draft(name):
            return
        super().write(name, tensor)

    def load(self, stream):
        held = super().load(stream)
        self._loaded = True
        return held


MUTANTS.update(
    {
        "sync_rank0_only": (lambda **kw: _SyncRankZeroOnly(rank=kw["rank"], **_fused_kw(kw)), "receiver_ranks"),
        "shuffle_every_load": (lambda **kw: _ShuffleEveryLoad(**_fused_kw(kw)), "receiver_repeat"),
        "wake_restores_old_backup": (lambda **kw: _WakeRestoresOldBackup(**_fused_kw(kw)), "receiver_wake"),
        "wake_backup_taken_once": (lambda **kw: _WakeBackupTakenOnce(**_fused_kw(kw)), "receiver_wake"),
        "repeat_cache_taken_once": (lambda **kw: _RepeatCacheTakenOnce(**_fused_kw(kw)), "receiver_repeat"),
        "tied_head_stale": (lambda **kw: _TiedHeadStale(**_fused_kw(kw)), "receiver_copies"),
        "mtp_not_synced": (
            lambda **kw: _MtpNotSynced(scope=copies_scope(kw.get("hf_path")), **_fused_kw(kw)),
            "receiver_copies",
        ),
    }
)
CONTROLS["fused"] = fused  # with the tied head where the model ties it
# where a receiver mutant's fault can show (model traits, ``moeverify.spec.models.traits``); the others apply everywhere
APPLIES = {
    "tied_head_stale": lambda traits: traits.tied_embeddings,
    "mtp_not_synced": lambda traits: traits.mtp_layers > 0,
}
# the receiver subchecks that need a weight sync (``refresh``) to run
NEEDS_SYNC = ("receiver_reload", "receiver_wake", "receiver_ranks", "receiver_copies")
# mutants of a subcheck that runs without a sync whose fault shows only in the cycle after one (state captured at
# the first cycle and reused): they run with ``refresh`` too
SHOWN_AFTER_A_SYNC = ("repeat_cache_taken_once",)
__all__ += ["APPLIES", "NEEDS_SYNC", "SHOWN_AFTER_A_SYNC"]


# -- minimal mutants of the subchecks above (``moeverify.spec.bug_classes``' ``minimal``): one element each
# ---------------
_ONE = ".experts.0.down_proj.weight"


def _first(held: torch.Tensor) -> tuple[int, ...]:
    return (0,) * held.dim()


class _OneRankOneElementStale(_ReloadKeepsOneElement):
    """``reload_keeps_one_element`` on every engine rank but 0: there a weight sync leaves one element (the first of
    the first expert-0 ``down_proj``) at the previous weights' value; rank 0's engine is right."""

    def __init__(self, *, rank: int, **kw) -> None:
        super().__init__(**kw)
        self._kept = rank == 0


class _RepeatNudgesOneElement(FusedReceiver):
    """A load of bits the buffer already holds moves one element one ulp: an in-place fix-up meant for a fresh copy
    runs again on the first expert-0 ``down_proj`` loaded unchanged and flips its first element's lowest bit."""

    def write(self, name: str, tensor: torch.Tensor) -> None:
        same = None
        if name.endswith(_ONE) and not getattr(self, "_nudged", False):
            engine, part = self._where[name]
            held = part.view(self.tensors[engine])
            same = held if torch.equal(bits(held.contiguous()), bits(tensor.contiguous())) else None
        super().write(name, tensor)
        if same is not None:
            self._nudged = True
            bits(same)[_first(same)] ^= 1


class _WakeRestoresOneElement(FusedReceiver):
    """A sleep/wake cycle that gives every element back from the backup ``sleep`` took, except one (the first of the
    first expert-0 ``down_proj``), restored from a copy taken at the first load."""

    def load(self, stream):
        held = super().load(stream)
        if getattr(self, "_old", None) is None:
            engine, part = next(where for name, where in self._where.items() if name.endswith(_ONE))
            view = part.view(self.tensors[engine])
            self._old = (engine, part, view[_first(view)].clone())
        return held

    def wake_up(self) -> Held:
        held = super().wake_up()
        engine, part, old = self._old
        view = part.view(self.tensors[engine])
        view[_first(view)] = old
        return held


class _TiedHeadOneElementStale(FusedReceiver):
    """Copies the tied embedding into its own ``lm_head`` on every load, but from the second copy on leaves the
    head's first element at the first copy's value."""

    def copy_head(self, embedding: torch.Tensor) -> None:
        old = self.tensors[self.HEAD].view(-1)[0].clone() if getattr(self, "_copied", False) else None
        super().copy_head(embedding)
        if old is not None:
            self.tensors[self.HEAD].view(-1)[0] = old
        self._copied = True


MUTANTS.update(
    {
        "one_rank_one_element_stale": (
            lambda **kw: _OneRankOneElementStale(rank=kw["rank"], **_fused_kw(kw)),
            "receiver_ranks",
        ),
        "repeat_nudges_one_element": (lambda **kw: _RepeatNudgesOneElement(**_fused_kw(kw)), "receiver_repeat"),
        "wake_restores_one_element": (lambda **kw: _WakeRestoresOneElement(**_fused_kw(kw)), "receiver_wake"),
        "tied_head_one_element_stale": (lambda **kw: _TiedHeadOneElementStale(**_fused_kw(kw)), "receiver_copies"),
    }
)
APPLIES["tied_head_one_element_stale"] = lambda traits: traits.tied_embeddings
