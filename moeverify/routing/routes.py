"""``Routes``: top-k expert ids per MoE layer and micro-batch, plain tensors only.

Legend of shape suffixes: T = tokens (in a router's own order), K = top-k, L = MoE layers,
M = micro-batches. ``topk_ids_TK`` is one layer's routing of one micro-batch.

Layer numbers are 0-based global decoder layer indices, as in HF names (``model.layers.N``); a
multi-token-prediction layer ``i`` is numbered ``num_layers + i``. They are never construction order.
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping, Sequence
from typing import TypeGuard

import numpy as np
import torch

from moeverify.errors import RouteError
from moeverify.routing import rollout_arrays as ra
from moeverify.routing import views
from moeverify.routing.route_ids import (
    safe_routes as safe_routes,  # public here too (``moeverify.routing.routes.safe_routes``)
)
from moeverify.routing.route_ids import validate_topk_ids as validate_topk_ids  # public here too

PROVENANCES = (None, "rollout", "dump")  # ``Routes.provenance``: who chose the routes, where another process did


def _validate_unlike(ids_TK: torch.Tensor, valid_TK: torch.Tensor, **where) -> None:
    """``validate_topk_ids`` of the rows of ``ids_TK`` that are not byte-identical to ``valid_TK``'s (validated,
    same dtype and shape); on a failure, of the whole tensor, so that the message names the same token and
    count (every bad row is among the rows checked: the others equal valid rows)."""
    # NumPy: 7x faster nonzero on one core
    words_TW, valid_TW = views.word_rows(ids_TK).numpy(), views.word_rows(valid_TK).numpy()
    differ_T = words_TW[:, 0] != valid_TW[:, 0] if words_TW.shape[1] == 1 else (words_TW != valid_TW).any(axis=1)
    try:
        validate_topk_ids(ids_TK.index_select(0, torch.from_numpy(np.flatnonzero(differ_T))), **where)
    except RouteError:
        validate_topk_ids(ids_TK, **where)
        raise


def _versions(data: Mapping[int, Sequence]) -> dict:
    return {(layer, mb): getattr(t, "_version", None) for layer, mbs in data.items() for mb, t in enumerate(mbs)}


def _is_int(value: object) -> TypeGuard[int]:  # an Integral (numpy's too) that compares as an int
    return type(value) is int or (isinstance(value, numbers.Integral) and not isinstance(value, bool))


def _check_shape_args(*, num_experts: object, topk: object) -> None:
    if not _is_int(num_experts) or not _is_int(topk):
        raise RouteError(f"num_experts and topk must be integers, got num_experts {num_experts!r}, topk {topk!r}")
    if num_experts < 1 or topk < 1 or topk > num_experts:
        raise RouteError(f"need 1 <= topk <= num_experts, got topk {topk}, num_experts {num_experts}")


def _check_per_layer(per_layer: object) -> None:
    """The container itself: ``{int layer >= 0: list or tuple of tensors}``, nothing else."""
    if not isinstance(per_layer, Mapping):
        raise RouteError(
            f"routes must be a mapping {{layer: [topk_ids_TK per micro-batch]}}, got {type(per_layer).__name__}"
        )
    for layer, mbs in per_layer.items():
        if not _is_int(layer) or layer < 0:
            raise RouteError(f"layer key {layer!r} must be a global layer number (an integer >= 0)")
        if not isinstance(mbs, list | tuple):
            raise RouteError(
                f"layer {layer}: expected a list of [T, K] tensors (one per micro-batch), got {type(mbs).__name__}"
            )


class Routes:
    """Routing decisions: ``{layer: [topk_ids_TK per micro-batch]}``, immutable (inputs are copied).

    Args:
        per_layer: global layer number -> sequence of int ``[T, K]`` tensors, one per micro-batch.
        num_experts: experts per MoE layer (ids live in ``[0, num_experts)``).
        topk: experts per token.
    """

    __slots__ = (
        "_data",
        "num_experts",
        "topk",
        "validated",
        "_replay_ids",
        "_versions",
        "order",
        "_seq_lens",
        "view_of",
        "taken_from",
        "provenance",
    )

    def __init__(self, per_layer: Mapping[int, Sequence[torch.Tensor]], *, num_experts: int, topk: int):
        # Own the data: a copy is validated and kept, so a caller reusing its buffer (a rollout engine's output
        # array) cannot change routes that were already checked.
        self._build(per_layer, num_experts=num_experts, topk=topk, copy=True)

    @classmethod
    def adopt(
        cls, per_layer: Mapping[int, Sequence[torch.Tensor]], *, num_experts: int, topk: int, like: Routes | None = None
    ) -> Routes:
        """``Routes(per_layer, ...)`` of tensors the caller has just made and hands over, keeping no other
        reference to them (a dump reader's fresh reads): validated the same way, not copied again.

        ``like``: validated routes (the other side of a diff, just read): a row byte-identical to the same row
        of ``like``'s tensor of the same layer and micro-batch (same experts, top-k, dtype and shape) is valid,
        so only the other rows are checked; a failure is then reported as checking the whole tensor reports it.
        """
        routes = cls.__new__(cls)
        routes._build(per_layer, num_experts=num_experts, topk=topk, copy=False, like=like)
        return routes

    def _build(
        self,
        per_layer: Mapping[int, Sequence[torch.Tensor]],
        *,
        num_experts: int,
        topk: int,
        copy: bool,
        like: Routes | None = None,
    ) -> None:
        _check_shape_args(num_experts=num_experts, topk=topk)
        _check_per_layer(per_layer)
        counts = {layer: len(mbs) for layer, mbs in per_layer.items()}
        if len(set(counts.values())) > 1:
            raise RouteError(f"micro-batch count differs between layers: {counts}")
        data = {}
        for layer in sorted(per_layer):
            mbs = tuple(t.detach().clone() if copy and isinstance(t, torch.Tensor) else t for t in per_layer[layer])
            for mb, t in enumerate(mbs):
                ref = None if like is None else like._voucher(layer, mb, t, num_experts=num_experts, topk=topk)
                if ref is None:
                    validate_topk_ids(t, layer=layer, microbatch=mb, num_experts=num_experts, topk=topk)
                else:
                    _validate_unlike(t, ref, layer=layer, microbatch=mb, num_experts=num_experts, topk=topk)
            data[int(layer)] = mbs
        self._data = data
        self.num_experts = int(num_experts)
        self.topk = int(topk)
        self.validated = True  # every tensor checked when built (``unchecked`` leaves it False)
        # (device, layer, mb, ascending) -> the private int64 copy replay routes with (``replay_ids``)
        self._replay_ids: dict = {}
        self._versions = _versions(data)  # torch's in-place write counters when validated
        # Token order of the rows, where a producer knows it: "router" (s * B + b, what a rank's routers see:
        # session.routes(), Routes.to_local) or "sequence" (b * S + s: Dump.routes, Routes.to_global,
        # from_rollout). None: unknown, or one sequence (both orders agree).
        self.order: str | None = None
        # Per micro-batch, the length of its sequences where the producer knows it (from_rollout with lengths=,
        # to_global): to_local refuses another seq_len. None: unknown.
        self._seq_lens: tuple[int | None, ...] | None = None
        # ``take``'s ``(routes taken from, micro-batch order)``: replay checks the recorded inputs of the routes taken
        # from, in that order (``patches.replay_inputs``). None: not taken.
        self.taken_from: tuple[Routes, tuple[int, ...]] | None = None
        # What ``to_local`` made this view for: ``(coords, data-parallel batches it read the global rows as)``;
        # a replay compares them with the rank it runs on. None: not a to_local view.
        self.view_of: tuple | None = None
        # Who chose these routes where another process did: "rollout" (``from_rollout``: an engine's) or "dump"
        # (a dump's reader); carried through views and selections. A session's ``replay()`` of such routes runs
        # the agreement guard's numbering check and chance floor by default. None: made here.
        self.provenance: str | None = None

    def _voucher(
        self, layer: int, microbatch: int, ids_TK: object, *, num_experts: int, topk: int
    ) -> torch.Tensor | None:
        """This route of (layer, micro-batch) where it vouches for the rows of ``ids_TK`` equal to its own:
        validated under the same experts and top-k, not written into since (torch's counter), same dtype and
        shape, both on the CPU. None otherwise."""
        mbs = self._data.get(layer, ())
        if not self.validated or (self.num_experts, self.topk) != (num_experts, topk) or not 0 <= microbatch < len(mbs):
            return None
        ref = mbs[microbatch]
        written = getattr(ref, "_version", None) != self._versions.get((layer, microbatch))
        if (
            written
            or not isinstance(ids_TK, torch.Tensor)
            or ids_TK.device.type != "cpu"
            or (ref.dtype, ref.shape, ref.device.type) != (ids_TK.dtype, ids_TK.shape, "cpu")
        ):
            return None
        return ref

    @classmethod
    def unchecked(cls, per_layer: Mapping[int, Sequence[torch.Tensor]], *, num_experts: int, topk: int) -> Routes:
        """A ``Routes`` built WITHOUT validation: for oracles that hand implementations bad routes on purpose."""
        routes = cls.__new__(cls)
        routes._data = {int(layer): tuple(per_layer[layer]) for layer in sorted(per_layer)}
        routes.num_experts, routes.topk, routes.validated = num_experts, topk, False
        routes._replay_ids, routes._versions, routes.order = {}, _versions(routes._data), None
        routes._seq_lens, routes.view_of, routes.taken_from, routes.provenance = None, None, None, None
        return routes

    def in_order(self, order: str | None) -> Routes:
        """This ``Routes`` marked as holding rows in ``order`` (``"router"``, ``"sequence"`` or None); returns it."""
        if order not in (None, "router", "sequence"):
            raise RouteError(f"order must be 'router', 'sequence' or None, got {order!r}")
        self.order = order
        return self

    def _as_view_of(self, view_of: tuple | None) -> Routes:
        """This ``Routes`` marked as ``to_local``'s view ``(coords, data-parallel batches)``; returns it."""
        self.view_of = view_of
        return self

    def chosen_by(self, provenance: str | None) -> Routes:
        """This ``Routes`` marked as chosen by another process: ``"rollout"`` (an engine), ``"dump"`` (a dump's run)
        or None; returns it."""
        if provenance not in PROVENANCES:
            raise RouteError(f"provenance must be one of {PROVENANCES}, got {provenance!r}")
        self.provenance = provenance
        return self

    def __reduce__(self):
        # A copy (pickle, torch.save, copy.deepcopy) is built anew, validated like any Routes: torch's write counters
        # and the private device copies belong to the original tensors. It carries no recorded inputs (the
        # identity check keys on the original's tensors), like any Routes built otherwise.
        return (
            _rebuilt,
            (
                dict(self._data),
                self.num_experts,
                self.topk,
                self.validated,
                self.order,
                self._seq_lens,
                self.view_of,
                self.provenance,
            ),
        )

    def _with_seq_lens(self, seq_lens: Sequence[int | None] | None) -> Routes:
        """This ``Routes`` marked as holding, per micro-batch, sequences of ``seq_lens[mb]`` tokens; returns it."""
        self._seq_lens = None if seq_lens is None else tuple(seq_lens)
        return self

    @property
    def layers(self) -> tuple[int, ...]:
        """Sorted global layer numbers of the MoE layers held."""
        return tuple(self._data)

    @property
    def microbatches(self) -> int:
        return len(next(iter(self._data.values()))) if self._data else 0

    def get(self, layer: int, microbatch: int) -> torch.Tensor:
        """The ``[T, K]`` route of ``layer`` in ``microbatch``."""
        if layer not in self._data:
            raise RouteError(f"layer {layer}: no routes held; layers held: {list(self.layers)}")
        mbs = self._data[layer]
        if not 0 <= microbatch < len(mbs):
            raise RouteError(f"layer {layer} mb {microbatch}: only {len(mbs)} micro-batch(es) held")
        return mbs[microbatch]

    def replay_ids(self, layer: int, microbatch: int, device, *, ascending: bool = False) -> torch.Tensor:
        """A private int64 copy of one route on ``device``, made once per device and never handed out elsewhere.

        Replay routes with this copy: a caller that writes into the tensor ``get`` returned changes nothing
        that replay uses once the copy exists, and repeated replays of one ``Routes`` cost no copy.
        ``ascending``: each row's ids sorted ascending (the route as a set; also made once)."""
        key = (torch.device(device), layer, microbatch, ascending)
        ids_TK = self._replay_ids.get(key)
        if ids_TK is None and ascending:
            ids_TK = self._replay_ids[key] = self.replay_ids(layer, microbatch, device).sort(dim=1).values
        if ids_TK is None:
            source = self.get(layer, microbatch)
            if self.validated:
                self._check_unwritten(layer, microbatch, source)
                if source.device.type == "cpu" and ("seen", layer, microbatch) not in self._replay_ids:
                    # what a later write through a NumPy view (no version counter) is told apart from: the
                    # route's memory as a NumPy view and a copy of it, compared by NumPy (no torch dispatch)
                    view = source.detach().numpy()
                    self._replay_ids[("seen", layer, microbatch)] = (view, view.copy())
            ids_TK = self._replay_ids[key] = source.to(device=device, dtype=torch.int64, copy=True)
        return ids_TK

    def check_unwritten(self) -> None:
        """Refuse, at every replay of a validated ``Routes``, a route written into since it was validated: replay
        routes with private copies made at the first replay, so a later write would otherwise change what ``get``
        shows and not what is replayed. Torch's in-place counter shows a write through torch (one read per route);
        a CPU route is also compared with what its first replay copied (a write through a NumPy view)."""
        if not self.validated:
            return
        # outside any torch function mode (CPU ranks' runtime: a tensor attribute read goes through it, microseconds
        # each); these are host reads that name no device
        with torch._C.DisableTorchFunction():
            self._check_unwritten_all()

    def _check_unwritten_all(self) -> None:
        versions, copies = self._versions, self._replay_ids
        for layer, mbs in self._data.items():
            for mb, source in enumerate(mbs):
                if source._version != versions.get((layer, mb)):
                    self._check_unwritten(layer, mb, source)  # raises
                seen = copies.get(("seen", layer, mb))
                if seen is not None and not (seen[0] == seen[1]).all():
                    raise RouteError(
                        f"layer {layer} mb {mb}: the route was written into after it was replayed (through a "
                        f"NumPy view of the tensor Routes.get returned); build a new Routes (or use replace()) "
                        f"so the new ids are checked"
                    )

    def replay_table(
        self, device
    ) -> tuple[dict[int, tuple[torch.Tensor, ...]], dict[int, tuple[torch.Tensor, ...]], dict[int, tuple[int, ...]]]:
        """Per layer, every route's private copy on ``device`` in the order given (``replay_ids``) and ascending
        (``replay_ids(..., ascending=True)``), and its token counts: made once per device, so a replay entered every
        step looks nothing up per route."""
        key = ("table", torch.device(device))
        table = self._replay_ids.get(key)
        if table is None:
            mbs = range(self.microbatches)
            given = {layer: tuple(self.replay_ids(layer, mb, device) for mb in mbs) for layer in self.layers}
            ascending = {
                layer: tuple(self.replay_ids(layer, mb, device, ascending=True) for mb in mbs) for layer in self.layers
            }
            tokens = {layer: tuple(int(t.shape[0]) for t in ids) for layer, ids in given.items()}
            table = self._replay_ids[key] = (given, ascending, tokens)
        return table

    def _check_unwritten(self, layer: int, microbatch: int, source: torch.Tensor) -> None:
        """Refuse a route written into after it was validated (through the tensor ``get`` returned): torch's
        in-place counter (``Tensor._version``, torch 2.x) shows it; a CPU route is also checked again, which
        catches writes through a NumPy view as well (no host sync: the check runs on the host)."""
        if getattr(source, "_version", None) != self._versions.get((layer, microbatch)):
            raise RouteError(
                f"layer {layer} mb {microbatch}: the route was written into after it was validated "
                f"(through the tensor Routes.get returned); build a new Routes (or use replace()) "
                f"so the new ids are checked"
            )
        if source.device.type == "cpu":
            validate_topk_ids(source, layer=layer, microbatch=microbatch, num_experts=self.num_experts, topk=self.topk)

    def replace(self, layer: int, microbatch: int, topk_ids_TK: torch.Tensor) -> Routes:
        """A new ``Routes`` with one tensor replaced (validated like every other)."""
        self.get(layer, microbatch)
        data = {k: list(v) for k, v in self._data.items()}
        data[layer][microbatch] = topk_ids_TK
        return (
            Routes(data, num_experts=self.num_experts, topk=self.topk).in_order(self.order).chosen_by(self.provenance)
        )

    def stacked(self, microbatch: int) -> torch.Tensor:
        """``[T, L, K]`` int64 view of one micro-batch over all held layers."""
        return torch.stack([self.get(layer, microbatch).to(torch.int64) for layer in self.layers], dim=1)

    @classmethod
    def from_stacked(cls, topk_ids_MTLK: Sequence[torch.Tensor], *, layers: Sequence[int], num_experts: int) -> Routes:
        """Inverse of ``stacked``: one ``[T, L, K]`` tensor per micro-batch."""
        if not topk_ids_MTLK:
            raise RouteError("from_stacked needs at least one micro-batch")
        first = topk_ids_MTLK[0]
        if first.dim() != 3 or first.shape[1] != len(layers):
            raise RouteError(f"stacked routes shape {tuple(first.shape)} != expected (T, L={len(layers)}, K)")
        per_layer = {int(layer): [t[:, i, :] for t in topk_ids_MTLK] for i, layer in enumerate(layers)}
        return cls(per_layer, num_experts=num_experts, topk=first.shape[2])

    def take(self, microbatches: Sequence[int]) -> Routes:
        """Micro-batches ``microbatches`` of these routes, in that order (one may repeat, some may be left out):
        the routes of a PPO loop's shuffled micro-batches. Routes from ``session.routes()`` keep their recorded
        inputs through it: forward ``i`` of the replay must have micro-batch ``microbatches[i]``'s token ids."""
        if hasattr(microbatches, "tolist"):  # a NumPy array or a tensor of indices (a permutation)
            microbatches = microbatches.tolist()
        if isinstance(microbatches, (str, bytes)) or not isinstance(microbatches, Sequence) or not microbatches:
            raise RouteError(f"take: expected a non-empty list of micro-batch indices, got {microbatches!r}")
        order = []
        for mb in microbatches:
            if isinstance(mb, bool) or not isinstance(mb, int) or not 0 <= mb < self.microbatches:
                raise RouteError(
                    f"take: micro-batch {mb!r} is not an index of the {self.microbatches} micro-batch(es) held"
                )
            order.append(int(mb))
        taken = (
            Routes(
                {layer: [self._data[layer][mb] for mb in order] for layer in self.layers},
                num_experts=self.num_experts,
                topk=self.topk,
            )
            .in_order(self.order)
            ._with_seq_lens(None if self._seq_lens is None else [self._seq_lens[mb] for mb in order])
            ._as_view_of(self.view_of)
            .chosen_by(self.provenance)
        )
        taken.taken_from = (self, tuple(order))
        return taken

    def select(self, layers: Sequence[int]) -> Routes:
        """A ``Routes`` holding only ``layers`` (e.g. the MoE layers of one pipeline stage)."""
        missing = sorted(set(layers) - set(self.layers))
        if missing:
            raise RouteError(f"select: layer(s) {missing} not held; layers held: {list(self.layers)}")
        return (
            Routes({layer: self._data[layer] for layer in layers}, num_experts=self.num_experts, topk=self.topk)
            .in_order(self.order)
            ._with_seq_lens(self._seq_lens)
            ._as_view_of(self.view_of)
            .chosen_by(self.provenance)
        )

    def map_experts(self, emap, *, where: str, token_label=None) -> Routes:
        """Every layer's physical expert slots as logical ids through ``emap`` (an ``expert_map.ExpertMap``),
        as this class; a token whose slots map to one expert twice raises naming ``where``."""
        per_layer = {
            layer: [
                emap.apply(layer, self.get(layer, mb), where=where, microbatch=mb, token_label=token_label)
                for mb in range(self.microbatches)
            ]
            for layer in self.layers
        }
        return type(self)(per_layer, num_experts=emap.logical, topk=self.topk).chosen_by(self.provenance)

    def to_local(self, layout, *, coords, seq_len, batch: int, num_layers: int, zigzag: bool = True) -> Routes:
        """This global view as one rank's routers see it: its MoE layers, its tokens in local router order.

        ``seq_len`` may be one length or one per micro-batch.
        """
        return _to_local(
            self, layout, coords=coords, seq_len=seq_len, batch=batch, num_layers=num_layers, zigzag=zigzag
        )

    @staticmethod
    def to_global(
        local_by_rank,
        layout,
        *,
        world_size: int,
        seq_len,
        batch: int,
        num_layers: int,
        moe_layers: Sequence[int],
        zigzag: bool = True,
    ) -> Routes:
        """Merge ranks' local routes into the global view; replicas must agree.

        Every (pp, dp, cp) group, and under SP every TP rank of it, must be present. TP ranks without SP
        see the same tokens and are checked equal; a disagreement raises ``RouteError`` naming both ranks.
        """
        return _to_global(
            local_by_rank,
            layout,
            world_size=world_size,
            seq_len=seq_len,
            batch=batch,
            num_layers=num_layers,
            moe_layers=moe_layers,
            zigzag=zigzag,
        )

    @classmethod
    def from_rollout(
        cls,
        topk_ids,
        *,
        layers: Sequence[int],
        num_experts: int,
        tokens: int | None = None,
        pad_T=None,
        split: Sequence[int] | None = None,
        lengths: Sequence[int] | None = None,
        seq_len: int | None = None,
        num_layers: int | None = None,
        numbering: str | None = None,
        rows: Sequence[int] | None = None,
        expert_map=None,
    ) -> Routes:
        """Routes from a rollout engine's per-token routes (numpy or torch), global view.

        Args:
            topk_ids: one sequence ``[T, L, K]``; or one array per request ``[S_i - 1 or S_i, L, K]`` (what
                vLLM's ``routed_experts`` and SGLang's ``return_routed_experts`` give); or a padded
                ``[B, S, L, K]`` batch. With several requests ``lengths`` is required.
            layers: global layer numbers of the MoE layers, ascending, each once (MTP layers numbered
                ``num_layers + i``).
            num_experts: experts per MoE layer (logical experts).
            tokens: (one sequence) the token count training will route; default ``T``.
            pad_T: (one sequence) bool ``[tokens]``, True where the token is padding.
            split: token counts of consecutive micro-batches (sum == all tokens); default one.
            lengths: (several requests) tokens training feeds per request (prompt + response, multi-turn
                concatenated). A request's array may hold ``lengths[i]`` or ``lengths[i] - 1`` rows.
            seq_len: (several requests) the padded length of each request in training; default
                ``max(lengths)``. The result is sequence-major: token ``s`` of request ``b`` is row ``b * seq_len + s``.
            num_layers: decoder layers of the model (MTP layers not counted).
            numbering: what the layer axis holds: ``"routers"`` (one column per entry of ``layers``, in that
                order) or ``"decoder"`` (one column per decoder layer, dense ones included; the MoE columns taken by
                layer number). Default: inferred when one reading fits; when both fit (as many dense layers as
                MTP layers, or ``num_layers`` not given for a model with dense layers) ``RouteError``.
            rows: (padded batch) rows the engine returned for each request (``lengths[i] - 1`` or
                ``lengths[i]``; e.g. the rollout attention mask's row sums): the rest is padding, exactly as the
                list form. Default: request ``i``'s ``lengths[i]`` rows, less the last when it is uncaptured in
                every column (the missing last row, padded).
            expert_map: the engine records physical expert slots (an expert placement, EPLB): ``slot -> logical
                id`` map, a ``.json``/``.npy`` path or its parsed form (or ``moeverify.routing.expert_map.ExpertMap``),
                the same format and checks as ``dump diff --expert-map-b``; ids are mapped before use.

        Engines return routes for prompt + response minus the final token (it is sampled, never fed
        back): that row, and padding, get a safe route ``(t * K + j) % E``, distinct within the row and
        spread over all experts. A capture gap (a row of -1, or with K > 1 a row of zeros, on a real
        token) raises ``RouteError`` naming request, token and layer: it is never replayed as expert 0.
        """
        spec = ra.RolloutSpec.of(
            layers=layers, num_experts=num_experts, num_layers=num_layers, numbering=numbering, expert_map=expert_map
        )
        if lengths is None and (isinstance(topk_ids, (list, tuple)) or ra.ndim(topk_ids) == 4):
            raise RouteError("several rollout requests need lengths= (tokens training feeds per request)")
        if rows is not None and (lengths is None or isinstance(topk_ids, (list, tuple))):
            raise RouteError(
                "rows= gives the rows of each request of a padded [B, S, L, K] batch (with lengths=); "
                "drop it for other forms"
            )
        if lengths is not None:
            ids_TLK, pad_T = ra.batch_of_requests(topk_ids, spec, lengths=lengths, rows=rows, seq_len=seq_len)
        else:
            ids_TLK, pad_T = ra.one_sequence(topk_ids, spec, tokens=tokens, pad_T=pad_T)
        tokens = int(ids_TLK.shape[0])
        if pad_T is not None:
            ids_TLK = ra.fill_pads(ids_TLK, pad_T, num_experts=num_experts)
        if split is not None and not isinstance(split, Sequence | torch.Tensor | np.ndarray):
            raise RouteError(
                f"split= takes the token count of each micro-batch (a list, e.g. [{split!r}] * micro_batches), "
                f"got {type(split).__name__} {split!r}"
            )
        sizes = [tokens] if split is None else [int(n) for n in split]
        if sum(sizes) != tokens or any(n < 0 for n in sizes):
            raise RouteError(f"split {sizes} does not partition {tokens} tokens")
        chunks = torch.split(ids_TLK, sizes)
        # Several requests are padded to one length: a micro-batch of whole requests holds sequences of that length
        # (to_local refuses another seq_len); one array's sequence length is not known.
        per_request = tokens // len(lengths) if lengths is not None and len(lengths) and tokens else None
        seq_lens = None if per_request is None else [per_request if n % per_request == 0 else None for n in sizes]
        # The engine's order: request by request, token by token (sequence-major), never what a rank's routers
        # see (``to_local`` gives that), even for one array whose ``tokens`` span several sequences.
        return (
            cls(
                {layer: [c[:, i, :] for c in chunks] for i, layer in enumerate(spec.layers)},
                num_experts=num_experts,
                topk=int(ids_TLK.shape[2]),
            )
            .in_order("sequence")
            ._with_seq_lens(seq_lens)
            .chosen_by("rollout")
        )

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Routes):
            return NotImplemented
        if (self.layers, self.microbatches, self.num_experts, self.topk) != (
            other.layers,
            other.microbatches,
            other.num_experts,
            other.topk,
        ):
            return False
        return all(
            torch.equal(a.to(torch.int64), b.to(torch.int64))
            for layer in self.layers
            for a, b in zip(self._data[layer], other._data[layer], strict=True)
        )

    def __repr__(self) -> str:
        tokens = [int(t.shape[0]) for t in self._data[self.layers[0]]] if self._data else []
        return (
            f"Routes(layers={list(self.layers)}, microbatches={self.microbatches}, tokens={tokens}, "
            f"num_experts={self.num_experts}, topk={self.topk})"
        )


# Between views: the global view (engine order) and what one rank's routers see (``views`` has the math).


def _to_local(
    global_routes: Routes,
    layout,
    *,
    coords: views.RankCoords,
    seq_len: int | Sequence[int],
    batch: int,
    num_layers: int,
    zigzag: bool = True,
) -> Routes:
    """The routes a rank's routers see: its MoE layers, its tokens in local router order.

    ``seq_len`` may be one length or one per micro-batch.
    """
    if global_routes.order == "router":
        raise RouteError(
            "to_local: these routes are already one rank's view, in router order (session.routes(), or what "
            "to_local returned); to_local takes the global view in sequence order (Routes.from_rollout, "
            "Dump.routes, Routes.to_global): replay these as they are"
        )
    lens = _per_microbatch(seq_len, global_routes.microbatches)
    known = global_routes._seq_lens or (None,) * len(lens)
    batches: set[int] = set()  # data-parallel batches the global rows are read as, per micro-batch
    for mb, (length, held) in enumerate(zip(lens, known, strict=True)):
        rows = global_routes.get(global_routes.layers[0], mb).shape[0] if global_routes.layers else 0
        if held is not None and held != length:
            raise RouteError(
                f"to_local mb {mb}: these routes hold sequences of {held} tokens (as built), to_local was given "
                f"seq_len {length}; give the seq_len the routes were built with"
            )
        if global_routes.layers and batch * length > 0 and rows % (batch * length):
            raise RouteError(
                f"to_local mb {mb}: the global routes hold {rows} tokens, not a whole number of data-parallel "
                f"batches of {batch} x {length} tokens (batch {batch}, seq_len {length}): a global view holds "
                f"data-parallel ranks x batch x seq_len rows; check seq_len and batch"
            )
        if global_routes.layers and batch * length > 0:
            batches.add(rows // (batch * length))
    layers = views.layers_of(layout, pp_rank=coords.pp, num_layers=num_layers, moe_layers=global_routes.layers)
    per_layer: dict[int, list[torch.Tensor]] = {layer: [] for layer in layers}
    for mb, length in enumerate(lens):
        idx_T = views.token_index(
            layout, tp_rank=coords.tp, cp_rank=coords.cp, seq_len=length, batch=batch, dp_rank=coords.dp, zigzag=zigzag
        )
        for layer in layers:
            global_TK = global_routes.get(layer, mb)
            if idx_T.numel() and int(idx_T.max()) >= global_TK.shape[0]:
                raise RouteError(
                    f"layer {layer} mb {mb}: global routes hold {global_TK.shape[0]} tokens, "
                    f"{coords.label()} needs token {int(idx_T.max())} (seq_len {length}, batch {batch})"
                )
            per_layer[layer].append(global_TK[idx_T])
    dp_batches = batches.pop() if len(batches) == 1 else None
    return (
        type(global_routes)(per_layer, num_experts=global_routes.num_experts, topk=global_routes.topk)
        .in_order("router")
        ._as_view_of((coords, dp_batches))
        .chosen_by(global_routes.provenance)
    )


def _to_global(
    local_by_rank: Mapping[views.RankCoords, Routes],
    layout,
    *,
    world_size: int,
    seq_len: int | Sequence[int],
    batch: int,
    num_layers: int,
    moe_layers: Sequence[int],
    zigzag: bool = True,
) -> Routes:
    """Merge ranks' local routes into the global view; replicas must agree.

    Every (pp, dp, cp) group, and under SP every TP rank of it, must be present. TP ranks without SP
    see the same tokens and are checked equal; a disagreement raises ``RouteError`` naming both ranks.
    """
    if not local_by_rank:
        raise RouteError("to_global needs at least one rank's routes")
    keys = [c for c in local_by_rank if not isinstance(c, views.RankCoords)]
    if keys:
        raise RouteError(
            f"to_global keys each rank's routes by its RankCoords (views.rank_coords(layout, rank=, "
            f"world_size=)), got {type(keys[0]).__name__} {keys[0]!r}"
        )
    layout.validate(world_size=world_size)
    holding = [r for r in local_by_rank.values() if r.layers] or list(local_by_rank.values())
    first = holding[0]
    experts, topk, mbs = first.num_experts, first.topk, first.microbatches
    _check_holders(local_by_rank, layout, world_size=world_size)
    lens = _per_microbatch(seq_len, mbs)
    moe = tuple(sorted(set(moe_layers)))
    dtype = first.get(first.layers[0], 0).dtype if first.layers and mbs else torch.int64
    for coords, routes in local_by_rank.items():
        if routes.order == "sequence":
            raise RouteError(
                f"{coords.label()}: to_global takes each rank's view in router order (session.routes(), "
                f"to_local); these routes are in sequence order (from_rollout, Dump.routes, to_global): "
                f"they are a global view already"
            )
        expect = views.layers_of(layout, pp_rank=coords.pp, num_layers=num_layers, moe_layers=moe)
        got = (routes.num_experts, routes.topk, routes.layers, routes.microbatches if routes.layers else mbs)
        if got != (experts, topk, expect, mbs):
            raise RouteError(
                f"{coords.label()}: (num_experts, topk, layers, microbatches) {got} != expected "
                f"{(experts, topk, expect, mbs)}"
            )
        for layer in routes.layers:
            dtype = torch.promote_types(dtype, routes.get(layer, 0).dtype)
    dp = layout.dp(world_size)
    per_layer: dict[int, list[torch.Tensor]] = {layer: [] for layer in moe}
    for mb, length in enumerate(lens):
        tokens = dp * batch * length
        for layer in moe:
            per_layer[layer].append(
                _merge_one(
                    local_by_rank,
                    layout,
                    layer=layer,
                    mb=mb,
                    seq_len=length,
                    batch=batch,
                    tokens=tokens,
                    topk=topk,
                    dtype=dtype,
                    zigzag=zigzag,
                )
            )
    return (
        type(first)(per_layer, num_experts=experts, topk=topk)
        .in_order("sequence" if dp * batch > 1 else None)
        ._with_seq_lens(lens)
    )


def _merge_one(
    local_by_rank: Mapping[views.RankCoords, Routes],
    layout,
    *,
    layer: int,
    mb: int,
    seq_len: int,
    batch: int,
    tokens: int,
    topk: int,
    dtype: torch.dtype,
    zigzag: bool,
) -> torch.Tensor:
    holders = []
    for coords in sorted(local_by_rank, key=lambda c: c.rank):
        routes = local_by_rank[coords]
        if layer not in routes.layers:
            continue
        idx_T = views.token_index(
            layout, tp_rank=coords.tp, cp_rank=coords.cp, seq_len=seq_len, batch=batch, dp_rank=coords.dp, zigzag=zigzag
        )
        local_TK = routes.get(layer, mb)
        if local_TK.shape[0] != idx_T.numel():
            raise RouteError(
                f"layer {layer} {coords.label()} mb {mb}: local routes hold {local_TK.shape[0]} tokens"
                f" != expected T={idx_T.numel()} (seq_len {seq_len}, batch {batch})"
            )
        holders.append((coords, idx_T, local_TK.to(dtype)))
    out_TK = torch.empty(tokens, topk, dtype=dtype)  # every row is written or named missing below
    if len(holders) == 1 and holders[0][1].numel() == tokens:  # one rank holds every token (token_index
        _, idx_T, local_TK = holders[0]  # never repeats one): nothing to compare
        views.word_rows(out_TK).index_copy_(0, idx_T, views.word_rows(local_TK))
        return out_TK
    owner_T = torch.full((tokens,), -1, dtype=torch.int64)
    for n, (coords, idx_T, local_TK) in enumerate(holders):
        seen_T = owner_T[idx_T] >= 0 if n else None  # the first holder meets no replica
        if seen_T is not None and bool(seen_T.any()):
            differ_T = (out_TK[idx_T[seen_T]] != local_TK[seen_T]).any(dim=1)
            if bool(differ_T.any()):
                i = int(differ_T.nonzero()[0])
                token = int(idx_T[seen_T][i])
                other = _find(local_by_rank, int(owner_T[token]))
                raise RouteError(
                    f"layer {layer} mb {mb}: replicas disagree on {int(differ_T.sum())} token(s); first global token"
                    f" {token}: {coords.label()} has {local_TK[seen_T][i].tolist()}, {other.label()} has "
                    f"{out_TK[token].tolist()}"
                )
            fresh_T = ~seen_T
            out_TK[idx_T[fresh_T]] = local_TK[fresh_T]
            owner_T[idx_T[fresh_T]] = coords.rank
        else:
            views.word_rows(out_TK).index_copy_(0, idx_T, views.word_rows(local_TK))
            owner_T[idx_T] = coords.rank
    if bool((owner_T < 0).any()):
        missing = int((owner_T < 0).sum())
        raise RouteError(
            f"layer {layer} mb {mb}: {missing} of {tokens} global tokens held by no rank "
            f"(first: token {int((owner_T < 0).nonzero()[0])})"
        )
    return out_TK


def _check_holders(local_by_rank: Mapping[views.RankCoords, Routes], layout, *, world_size: int) -> None:
    """Every distinct token holder (pp, dp, cp and, under SP, tp) needs at least one rank present."""
    dp = layout.dp(world_size)
    tps = range(layout.tp) if layout.sp else (None,)
    present = {(c.pp, c.dp, c.cp, c.tp if layout.sp else None) for c in local_by_rank}
    for c in local_by_rank:
        for name, value, size in (
            ("tp", c.tp, layout.tp),
            ("pp", c.pp, layout.pp),
            ("cp", c.cp, layout.cp),
            ("dp", c.dp, dp),
        ):
            if not 0 <= value < size:
                raise RouteError(
                    f"{c.label()}: {name} rank {value} outside [0, {size}) for layout {layout.name(world_size)}"
                )
    for pp in range(layout.pp):
        for d in range(dp):
            for cp in range(layout.cp):
                for tp in tps:
                    if (pp, d, cp, tp) not in present:
                        who = f"pp{pp} dp{d} cp{cp}" + ("" if tp is None else f" tp{tp}")
                        raise RouteError(
                            f"no routes from any rank with {who}: the global view would have a hole "
                            f"(layout {layout.name(world_size)}, {len(local_by_rank)} rank(s) given)"
                        )


def _find(local_by_rank: Mapping[views.RankCoords, Routes], rank: int) -> views.RankCoords:
    return next(c for c in local_by_rank if c.rank == rank)


def _per_microbatch(seq_len: int | Sequence[int], microbatches: int) -> tuple[int, ...]:
    if isinstance(seq_len, int):
        return (seq_len,) * microbatches
    lens = tuple(int(s) for s in seq_len)
    if len(lens) != microbatches:
        raise RouteError(f"seq_len gives {len(lens)} length(s) but routes hold {microbatches} micro-batch(es)")
    return lens


def _rebuilt(data, num_experts, topk, validated, order, seq_lens, view_of, provenance=None) -> Routes:
    """``Routes.__reduce__``'s rebuild: validated again (``Routes.unchecked`` stays unchecked)."""
    made = (Routes if validated else Routes.unchecked)(data, num_experts=num_experts, topk=topk)
    return made.in_order(order)._with_seq_lens(seq_lens)._as_view_of(view_of).chosen_by(provenance)
