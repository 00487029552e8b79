"""In-job router replay (R2) without code changes: ``MOEVERIFY_ROUTER_REPLAY=r2``.

Legend of shape suffixes: T = tokens of one router call (router order), K = top-k.

Each forward of the bound model is a pass of one of two kinds, decided once per model-chunk forward by a
forward pre-hook on Megatron's ``GPTModel`` (grad mode as the chunk's ``forward`` is entered):
- **log-prob pass** (grad disabled: ``torch.no_grad()``/``inference_mode``): routes natively and records the
  routes per token;
- **training pass** (grad enabled): every token replays the route its log-prob pass recorded, looked up by
  token identity (``token_keys``: content and position from the sequence start), whatever the micro-batch,
  order, shuffling, epoch, dynamic batching, right padding or packing. Recomputes inside backward take their
  forward's routes (checkpoint regions, as everywhere in the patch).

``with injob.pass_kind("log_prob" | "training"):`` overrides the grad-mode rule for the forwards inside.
``with injob.padding_from_attention_mask(marks="tokens" | "padding"):`` takes a BSHD forward's padding from its
``attention_mask`` ``[B, S]`` where it gets no ``padding_mask`` (frameworks differ on what True means there, so it is
never guessed: a forward with an attention mask and no padding mask is refused naming the ways out).
``with injob.packed_lengths(real_lengths):`` names the real tokens of a THD forward's packed sequences where its
``packed_seq_params`` give only the slots (verl passes the padded lengths as ``cu_seqlens_q``).

The first log-prob forward after a training forward starts a new table (the previous step's routes are
dropped); the table serves every PPO mini-batch and epoch of the step. A training token that its step's
log-prob passes did not route raises ``RouteError`` (layer, rank, sequence, position); padding the model is
told about (``padding_mask=``, THD slots past ``cu_seqlens``) routes natively.

Layouts: under sequence parallel the router sees a TP rank's slice of the keys; under context parallel the chunk's
``input_ids`` are this rank's zigzag halves, so the CP ranks' ids are all-gathered (bounded wait), the full
sequences keyed and this rank's tokens taken; the ranks that split sequences (TP under SP, CP) pool their tables
when a step's first training forward freezes them. Every pipeline stage (and VPP chunk) keys the ``input_ids`` its
forward gets; a stage fed only hidden states raises ``RouteError`` naming the stage and the remedy.
"""

from __future__ import annotations

import contextlib
import os
import weakref
from collections.abc import Iterator
from typing import Literal

import torch
import torch.distributed as dist

from moeverify.errors import RouteError, UsageError
from moeverify.patches import agreement, batch_routes, regions, replay_state
from moeverify.patches import router_replay as rr
from moeverify.patches import token_keys as tk
from moeverify.patches.model_hooks import ModelInitHooks
from moeverify.patches.rollout_source import RolloutSource
from moeverify.patches.route_table import DUPLICATES, DUPLICATES_ENV, MAX_TOKENS_ENV, Lookup, RouteTable
from moeverify.patches.routers import global_layer

DEFAULT_MAX_TOKENS = 1 << 22  # per model chunk, rank and RL step
# a bound forward: records (R2) or replays, and what the guard counts; "native": routed natively, recorded nothing
PassKind = Literal["log_prob", "training", "native"]
KINDS: tuple[PassKind, ...] = ("log_prob", "training", "native")

add_routes = batch_routes.add_routes  # r3 with the routes handed over with the batch (batch_routes)
drop_routes = batch_routes.drop_routes

MASK_MARKS = ("tokens", "padding")  # what True (or 1) in a [B, S] attention mask marks
_OVERRIDE: list[PassKind] = []  # pass_kind() stack
_MASK_RULE: list[str] = []  # padding_from_attention_mask() stack
_LENGTHS: list[torch.Tensor] = []  # packed_lengths() stack
_VERSION: list[int | torch.Tensor] = []  # rollout_version() stack
_CURRENT: list = []  # the model-chunk forward running now (chunk forwards do not nest)


@contextlib.contextmanager
def pass_kind(kind: PassKind) -> Iterator[None]:
    """Treat the bound model's forwards inside as ``"log_prob"`` (record) or ``"training"`` (replay) passes, or as
    ``"native"``: routed natively, recorded nothing (a reference model's log-probs computed by loading its weights
    into the training model, as Megatron-LM's RL loop does, would otherwise record routes of other weights)."""
    if kind not in KINDS:
        raise UsageError(f"pass_kind({kind!r}): expected one of {KINDS}")
    _OVERRIDE.append(kind)
    try:
        yield
    finally:
        _OVERRIDE.pop()


@contextlib.contextmanager
def padding_from_attention_mask(*, marks: str) -> Iterator[None]:
    """Take the padding of the bound model's BSHD forwards inside from their ``attention_mask`` argument when they
    get no ``padding_mask``: a ``[B, S]`` mask of ``input_ids``' shape whose True (or 1) ``marks`` ``"tokens"``
    (verl's BSHD engine path: ``preprocess_bshd_engine``) or ``"padding"`` (Megatron's ``padding_mask`` reading)."""
    if marks not in MASK_MARKS:
        raise UsageError(f"padding_from_attention_mask(marks={marks!r}): expected one of {MASK_MARKS}")
    _MASK_RULE.append(marks)
    try:
        yield
    finally:
        _MASK_RULE.pop()


@contextlib.contextmanager
def packed_lengths(lengths) -> Iterator[None]:
    """The real token count of each packed sequence of the bound model's THD forwards inside, in packing order, where
    their ``packed_seq_params`` hold only the slots (``cu_seqlens_q`` = the padded lengths, as verl's
    ``preprocess_thd_engine`` passes them): a slot's tokens past its real length are padding and route natively."""
    lengths_Q = torch.as_tensor(lengths)
    if lengths_Q.dim() != 1 or not lengths_Q.numel() or lengths_Q.is_floating_point() or int(lengths_Q.min()) < 1:
        raise UsageError(
            f"packed_lengths: expected one real length (an integer >= 1) per packed sequence, got "
            f"{tuple(lengths_Q.shape)} {lengths_Q.dtype}"
        )
    _LENGTHS.append(lengths_Q.long())
    try:
        yield
    finally:
        _LENGTHS.pop()


@contextlib.contextmanager
def rollout_version(version) -> Iterator[None]:
    """Serve the bound model's forwards inside from the routes of rollout ``version`` (the step or policy version
    the batch was generated under) only: a token that version did not route is refused, never served another
    version's route. ``version`` is one integer for the whole forward, or one per sequence of each forward inside
    (a per-row list or 1-d tensor: batch rows ``[B]`` of a padded batch, packed sequences of a THD one), so a
    micro-batch mixing versions takes each sample's own routes. Without it, each sequence takes the one served
    version that holds it whole."""
    _VERSION.append(_version_arg(version))
    try:
        yield
    finally:
        _VERSION.pop()


def _version_arg(version) -> int | torch.Tensor:
    if (
        isinstance(version, bool)
        or not isinstance(version, (int, list, tuple, torch.Tensor))
        and not hasattr(version, "__array__")
    ):
        raise UsageError(
            f"rollout_version({version!r}): expected a step or policy version (an integer >= 0) or one per sequence"
        )
    if isinstance(version, int):
        if version < 0:
            raise UsageError(f"rollout_version({version!r}): expected a step or policy version, an integer >= 0")
        return version
    try:
        per_seq = torch.as_tensor(version)
    except (TypeError, ValueError) as exc:
        raise UsageError(f"rollout_version: per-sequence versions must be integers ({exc})") from exc
    if per_seq.dim() != 1 or not per_seq.numel() or per_seq.is_floating_point() or per_seq.dtype == torch.bool:
        raise UsageError(
            f"rollout_version: per-sequence versions must be a non-empty 1-d integer list or tensor, got "
            f"{tuple(per_seq.shape)} {per_seq.dtype}"
        )
    if int(per_seq.min()) < 0:
        raise UsageError(f"rollout_version: version {int(per_seq.min())} < 0; versions are integers >= 0")
    return per_seq.long()


class ChunkForward:
    """One model-chunk forward: its inputs, its pass kind, and (lazily) its token keys and table lookup."""

    def __init__(self, chunk, args, kwargs):
        self.chunk = chunk
        self.kind = _OVERRIDE[-1] if _OVERRIDE else ("training" if torch.is_grad_enabled() else "log_prob")
        self.version: int | torch.Tensor | None = _VERSION[-1] if _VERSION else None
        self.input_ids = args[0] if args else kwargs.get("input_ids")
        self.packed = args[6] if len(args) > 6 else kwargs.get("packed_seq_params")
        self.padding_mask = kwargs.get("padding_mask")
        # an inference engine's own forward (Megatron-Core's engine hands its context): routed natively, never
        # recorded or replayed (the engine's routes are the rollout's, not a pass of training)
        context = args[5] if len(args) > 5 else kwargs.get("inference_context")
        self.inference = context is not None or kwargs.get("inference_params") is not None
        self.attention_mask = args[2] if len(args) > 2 else kwargs.get("attention_mask")
        self.mask_rule = _MASK_RULE[-1] if _MASK_RULE and self.padding_mask is None and self.packed is None else None
        self.real_lengths = _LENGTHS[-1] if _LENGTHS and self.packed is not None else None
        self.recorded_as: int | None = None  # forward index in the table (log-prob pass)
        self.found: Lookup | None = None  # the table lookup (training pass)
        self.table: RouteTable | None = None  # the table looked up
        self.check = None  # refuses the lookup's bad tokens; run when the forward ends
        self._keys: tk.TokenKeys | None = None

    def keys(self, router, layer: int, tokens: int, *, rank: int) -> tk.TokenKeys:
        if self._keys is None:
            self._keys = self._full_keys(layer, rank=rank)
        keys = self._keys
        config = router.config
        if keys.tokens != tokens and getattr(config, "sequence_parallel", False):
            from megatron.core import parallel_state  # lazy: megatron

            keys = tk.sequence_slice(
                keys,
                rank=parallel_state.get_tensor_model_parallel_rank(),
                size=parallel_state.get_tensor_model_parallel_world_size(),
            )
        if keys.tokens != tokens:
            raise RouteError(
                f"layer {layer} rank {rank}: the router sees {tokens} tokens but the chunk's input_ids "
                f"give {self._keys.tokens}; in-job replay keys tokens from the GPTModel's input_ids "
                "(BSHD [B, S], or THD [1, N] with packed_seq_params)"
            )
        return keys

    def _full_keys(self, layer: int, *, rank: int) -> tk.TokenKeys:
        """Keys of the tokens this chunk's forward holds (all of them; under CP this rank's zigzag halves)."""
        from megatron.core import parallel_state  # lazy: megatron

        ids = self.input_ids
        if not isinstance(ids, torch.Tensor) or ids.is_floating_point():
            raise RouteError(
                f"layer {layer} rank {rank}: this model chunk's forward got no input_ids "
                f"({_stage_of(self.chunk)}); in-job replay finds routes by token identity and a stage "
                "past the first gets only hidden states from the pipeline (Megatron-LM's get_batch "
                "gives tokens to the first and last stages only): pass input_ids to every stage's "
                "GPTModel forward, as verl does (a stage past the first ignores them for compute)"
            )
        thd = self.packed is not None and getattr(self.packed, "qkv_format", "thd") == "thd"
        if self.mask_rule is not None:
            self.padding_mask = self._padding_of_mask(ids, layer=layer, rank=rank)
        if parallel_state.get_context_parallel_world_size() > 1:
            return self._cp_keys(ids, thd=thd, layer=layer, rank=rank)
        if thd:
            real, padded = self._thd_bounds(layer=layer, rank=rank)
            return tk.packed_keys(ids, cu_seqlens=real, cu_seqlens_padded=padded)
        return tk.row_keys(ids, padding_mask_BS=self.padding_mask)

    def _thd_bounds(self, *, layer: int, rank: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(cu_seqlens of the real tokens, cu_seqlens of the slots or None)`` of a THD forward: its
        ``packed_seq_params``' own, or the slots with the real lengths ``packed_lengths`` names."""
        padded = getattr(self.packed, "cu_seqlens_q_padded", None)
        if self.real_lengths is None:
            return self.packed.cu_seqlens_q, padded
        slots = padded if padded is not None else self.packed.cu_seqlens_q
        if self.real_lengths.numel() != slots.numel() - 1:
            raise RouteError(
                f"layer {layer} rank {rank}: packed_lengths names {self.real_lengths.numel()} sequences, the "
                f"forward's packed_seq_params hold {slots.numel() - 1} slots; name one real length per packed sequence"
            )
        real = torch.zeros_like(slots)
        real[1:] = torch.cumsum(self.real_lengths.to(device=slots.device), dim=0)
        return real, slots

    def _padding_of_mask(self, ids: torch.Tensor, *, layer: int, rank: int) -> torch.Tensor:
        """Megatron's ``padding_mask`` ``[B, S]`` (True = padding) from the attention mask, as the rule reads it."""
        mask = self.attention_mask
        if not isinstance(mask, torch.Tensor) or tuple(mask.shape) != tuple(ids.shape):
            got = tuple(mask.shape) if isinstance(mask, torch.Tensor) else type(mask).__name__
            raise RouteError(
                f"layer {layer} rank {rank}: padding_from_attention_mask(marks={self.mask_rule!r}): the forward's "
                f"attention_mask is {got}, not [B, S] = {tuple(ids.shape)} like its input_ids; pass padding_mask= "
                "to the GPTModel instead"
            )
        return ~mask.bool() if self.mask_rule == "tokens" else mask.bool()

    def padding_hint(self) -> str:
        """How a BSHD forward that left its padding untold could tell it (appended to a missing-route refusal)."""
        mask = self.attention_mask
        if self.padding_mask is not None or self.packed is not None or not isinstance(mask, torch.Tensor):
            return ""
        if mask.dim() != 2:
            return ""
        return (
            f"; this BSHD forward got attention_mask {tuple(mask.shape)} and no padding_mask, and in-job replay never "
            "reads padding from an attention mask on its own (True means a token in some frameworks, padding in "
            "others): pass padding_mask= (True = padding) to the GPTModel, remove the padding (THD, packed "
            "sequences: verl's use_remove_padding=True), or name the mask's reading with "
            "`with injob.padding_from_attention_mask(marks='tokens'):` around the forward (moeverify.integrations.verl "
            "does this on verl's BSHD path)"
        )

    def _cp_keys(self, ids: torch.Tensor, *, thd: bool, layer: int, rank: int) -> tk.TokenKeys:
        """Context parallel: put the CP ranks' input ids back together, key the full sequences, take this rank's
        tokens (``token_keys`` module docstring). Collective over the CP group, once per forward."""
        from megatron.core import parallel_state  # lazy: megatron

        group = parallel_state.get_context_parallel_group()
        cp, cp_rank = parallel_state.get_context_parallel_world_size(), parallel_state.get_context_parallel_rank()
        if thd:
            parts = _gather_cp(ids, group, cp=cp, layer=layer, rank=rank)
            if ids.dim() != 2 or ids.shape[0] != 1:
                raise RouteError(
                    f"layer {layer} rank {rank}: packed (THD) input_ids must be [1, N], got {tuple(ids.shape)}"
                )
            real, padded = self._thd_bounds(layer=layer, rank=rank)
            slots = padded if padded is not None else real
            length = int(slots[-1])
            if length != ids.shape[1] * cp:
                raise UsageError(
                    f"layer {layer} rank {rank}: context parallel with packed sequences: {cp} CP ranks "
                    f"hold {ids.shape[1]} tokens each but the slots (cu_seqlens_padded, else "
                    f"cu_seqlens) end at {length}; in-job replay (r2) supports Megatron's per-document "
                    "split (every slot a multiple of 2 * cp, no tokens past the last slot)"
                )
            indices = [tk.thd_zigzag_index(slots, rank=r, size=cp) for r in range(cp)]
            full = tk.packed_keys(tk.unshard(parts, indices, length=length), cu_seqlens=real, cu_seqlens_padded=padded)
            return tk.take(full, indices[cp_rank])
        if ids.dim() != 2:
            raise RouteError(f"layer {layer} rank {rank}: token keys need input_ids [B, S], got {tuple(ids.shape)}")
        # the padding mask (this rank's halves, like input_ids) travels with the ids: a key needs the whole row's
        parts = _gather_cp(
            ids if self.padding_mask is None else torch.stack([ids.long(), self.padding_mask.long()]),
            group,
            cp=cp,
            layer=layer,
            rank=rank,
        )
        if self.padding_mask is None:
            parts = [p[None] for p in parts]
        length = ids.shape[1] * cp
        indices = [tk.zigzag_index(length, rank=r, size=cp) for r in range(cp)]
        full_ids = tk.unshard([p[0] for p in parts], indices, length=length)
        full_pad = None if self.padding_mask is None else tk.unshard([p[1] for p in parts], indices, length=length)
        full = tk.row_keys(full_ids, padding_mask_BS=None if full_pad is None else full_pad.bool())
        return tk.take(full, tk.row_zigzag_tokens(indices[cp_rank], batch=ids.shape[0]))


def _stage_of(chunk) -> str:
    from megatron.core import parallel_state  # lazy: megatron

    pp = parallel_state.get_pipeline_model_parallel_world_size()
    where = f"pipeline stage {parallel_state.get_pipeline_model_parallel_rank()} of {pp}"
    vp_stage = getattr(chunk, "vp_stage", None)
    return where if vp_stage is None else f"{where}, virtual chunk {vp_stage}"


def _gather_cp(ids: torch.Tensor, group, *, cp: int, layer: int, rank: int) -> list[torch.Tensor]:
    """Every CP rank's input ids (equal shapes checked first), each wait bounded by the collective timeout."""

    def gather(t: torch.Tensor, what: str) -> list[torch.Tensor]:
        out = [torch.empty_like(t) for _ in range(cp)]
        agreement.wait_bounded(
            dist.all_gather(out, t, group=group, async_op=True),
            f"layer {layer} rank {rank}: gathering the CP group's {what} for token keys did not finish",
            "a CP rank did not run this forward?",
        )
        return out

    ids = ids.contiguous()
    shape = torch.tensor(list(ids.shape), dtype=torch.int64, device=ids.device)
    shapes = [tuple(s.tolist()) for s in gather(shape, "input_ids shapes")]
    if len(set(shapes)) != 1:
        raise RouteError(
            f"layer {layer} rank {rank}: the CP ranks' input_ids have shapes {shapes}; under context "
            "parallel every CP rank holds its zigzag halves of the same batch (equal shapes)"
        )
    return gather(ids.long(), "input_ids")


def _chunk_pre_hook(chunk, args, kwargs):
    _CURRENT.append(ChunkForward(chunk, args, kwargs))
    agreement.note_forward()


def _chunk_post_hook(chunk, args, kwargs, output):
    if _CURRENT and _CURRENT[-1].chunk is chunk:
        fwd = _CURRENT.pop()
        if fwd.check is not None and output is not None:  # not while the forward's own error propagates
            fwd.check()


class ChunkHooks(ModelInitHooks):
    """Patches ``GPTModel.__init__`` so that every model built afterwards announces its forwards (reversible)."""

    def __init__(self):
        super().__init__(_chunk_pre_hook, _chunk_post_hook)


def _routers_of(chunk) -> frozenset:
    from megatron.core.transformer.moe.router import TopKRouter  # lazy: megatron

    held = chunk.__dict__.get("_moeverify_router_ids")
    if held is None:
        held = chunk.__dict__["_moeverify_router_ids"] = frozenset(
            id(m) for m in chunk.modules() if isinstance(m, TopKRouter)
        )
    return held


def _graphs_of(chunk) -> bool:
    held = chunk.__dict__.get("_moeverify_graphs")
    if held is None:
        held = chunk.__dict__["_moeverify_graphs"] = rr.graphs_built([chunk])
    return held


class _RecordIds:
    """Megatron's ``router_replay`` protocol: native top-k in grad-mode slot order, ids kept in the step's table."""

    __slots__ = ("table", "layer", "forward", "rank")

    def __init__(self, table, layer, forward, rank):
        self.table, self.layer, self.forward, self.rank = table, layer, forward, rank

    def get_replay_topk(self, scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
        values, topk_ids_TK = replay_state.grad_mode_topk(default_compute_topk, scores, topk, num_groups, group_topk)
        self.table.add_ids(layer=self.layer, forward=self.forward, ids_TK=topk_ids_TK, rank=self.rank)
        return values, topk_ids_TK


class _ReplayIds:
    """Megatron's ``router_replay`` protocol: the looked-up ids in the slot order a grad-mode pass gives them (the
    replay_state module's rule, so any source's ids sum alike); tokens flagged native route natively. ``kind`` (the
    pass), ``native_T`` and the native top-k it took (``last_native_TK``) are read by the agreement guard."""

    __slots__ = ("topk_ids_TK", "native_T", "kind", "last_native_TK")
    REPLAYS = True  # counted by the agreement guard

    def __init__(self, topk_ids_TK, native_T, kind: str):
        self.topk_ids_TK, self.native_T, self.kind = topk_ids_TK, native_T, kind
        self.last_native_TK = None

    def get_replay_topk(self, scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
        native_TK = None
        if self.native_T is not None or agreement.ACTIVE is not None:
            # one native top-k: the flagged tokens' ids (in native's own order) and the guard's comparison
            with torch.no_grad():
                _, native_TK = replay_state.grad_mode_topk(
                    default_compute_topk, scores.detach(), topk, num_groups, group_topk
                )
            self.last_native_TK = native_TK
        # the table keeps each route's ids ascending (a set): ordered here by the module's rule
        ids_TK = replay_state.canonical_ids(
            scores,
            self.topk_ids_TK,
            default_compute_topk,
            topk=topk,
            num_groups=num_groups,
            group_topk=group_topk,
            native_TK=native_TK,
        )
        if self.native_T is not None:
            ids_TK = torch.where(self.native_T[:, None], native_TK, ids_TK)
        return scores.gather(1, ids_TK), ids_TK


class InJobState:
    """The state autopatch lends the bound model's routers in r2 mode (``route`` / ``recompute`` protocol)."""

    def __init__(self, *, original, num_experts: int, duplicates: str = "refuse"):
        self.original = original
        self.num_experts = num_experts
        self.max_tokens = _env_int(MAX_TOKENS_ENV, DEFAULT_MAX_TOKENS)
        self.duplicates = os.environ.get(DUPLICATES_ENV) or duplicates
        if self.duplicates not in DUPLICATES:
            raise UsageError(f"{DUPLICATES_ENV}={self.duplicates!r}: expected one of {DUPLICATES}")
        self.tables: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # chunk -> RouteTable
        self.phase: str | None = None  # kind of the last bound forward
        self.steps = 0  # tables started (RL steps seen)
        self.table_bytes: int = 0  # device bytes of the frozen tables of the current step

    def _forward(self, router, layer: int, rank: int) -> ChunkForward:
        fwd = _CURRENT[-1] if _CURRENT else None
        if fwd is None or id(router) not in _routers_of(fwd.chunk):
            raise RouteError(
                f"layer {layer} rank {rank}: a routing call outside any GPTModel forward built under "
                "in-job replay: its tokens cannot be identified (build the model after installing "
                "moeverify.patches.autopatch, and call the GPTModel itself)"
            )
        return fwd

    def route(self, router, layer, logits, args, kwargs):
        replay_state.guard_call(router, layer)
        rank = replay_state.current_rank()
        fwd = self._forward(router, layer, rank)
        if fwd.inference or fwd.kind == "native":
            return self.original(router, logits, *args, **kwargs)
        tokens = logits.numel() // router.num_experts
        keys = fwd.keys(router, layer, tokens, rank=rank)
        if fwd.kind == "log_prob":
            hook = self._record(fwd, keys, layer, rank)
        else:
            hook = self._replay(fwd, keys, router, layer, rank)
        return replay_state.call_with_hook(self.original, router, hook, logits, args, kwargs)

    def _record(self, fwd: ChunkForward, keys, layer: int, rank: int) -> _RecordIds:
        if self.phase != "log_prob":
            self.tables = weakref.WeakKeyDictionary()  # a new step: the previous step's routes are dropped
            self.table_bytes = 0
            self.steps += 1
            self.phase = "log_prob"
        table = self.tables.get(fwd.chunk)
        if table is None:
            table = self.tables[fwd.chunk] = RouteTable(
                max_tokens=self.max_tokens, num_experts=self.num_experts, duplicates=self.duplicates
            )
        if fwd.recorded_as is None:
            fwd.recorded_as = table.add_forward(keys, rank=rank)
        return _RecordIds(table, layer, fwd.recorded_as, rank)

    def _replay(self, fwd: ChunkForward, keys, router, layer: int, rank: int) -> _ReplayIds:
        table = self.tables.get(fwd.chunk)
        if table is None:
            raise RouteError(
                f"layer {layer} rank {rank}: a training forward with no routes recorded for this model "
                "chunk: in-job replay (r2) replays the routes of the step's log-prob pass (a forward "
                "under torch.no_grad()); run it first, or mark it with injob.pass_kind('log_prob')"
            )
        if not table.frozen:
            group = _pool_group(router.config)
            for held in self.tables.values():
                held.freeze(rank=rank, group=group)
            self.table_bytes = sum(held.nbytes() for held in self.tables.values())
        self.phase = "training"
        if layer not in table.layer_index:
            raise RouteError(
                f"layer {layer} rank {rank}: the log-prob pass recorded layers {sorted(table.layer_index)} "
                "for this model chunk, not this one"
            )
        return self._replay_from(table, fwd, keys, router, layer, rank)

    def _replay_from(self, table: RouteTable, fwd: ChunkForward, keys, router, layer: int, rank: int) -> _ReplayIds:
        if fwd.found is None:
            fwd.table, fwd.found = table, table.lookup(keys, version=fwd.version)
            fwd.check = lambda: _checked(table, fwd, layer=layer, rank=rank)
        held, found = fwd.table, fwd.found
        assert held is not None and found is not None  # looked up at the forward's first routing call
        ids_TK = held.ids(layer, found)
        region = regions.forward_region()
        if region is not None:
            replay_state.bind_forward(region, router, self, layer, _ReplayIds(ids_TK, found.native_T, fwd.kind))
        replay_state.mark_replayed(router)
        return _ReplayIds(ids_TK, fwd.found.native_T, fwd.kind)

    def recompute(self, router, layer, handle, logits, args, kwargs):
        """``handle``: the forward's replay hook (``bind_forward`` in ``_replay_from``)."""
        return replay_state.call_with_hook(self.original, router, handle, logits, args, kwargs)


class RolloutState(InJobState):
    """r3 (``MOEVERIFY_ROUTER_REPLAY=r3:DIR``): every forward of the bound model, log-prob and training passes alike,
    replays the rollout engine's routes written by ``moeverify.routing.rollout_writer``, found by token identity in the
    newest complete steps of ``DIR`` (``rollout_source``). A token one prefix routed differently in two requests takes
    the first route (``MOEVERIFY_ROUTER_REPLAY_DUPLICATES=refuse`` refuses it)."""

    def __init__(self, *, original, num_experts: int, directory=None, source=None):
        super().__init__(original=original, num_experts=num_experts, duplicates="first")
        self.source = (
            source
            if source is not None
            else RolloutSource(directory, max_tokens=self.max_tokens, duplicates=self.duplicates)
        )

    def route(self, router, layer, logits, args, kwargs):
        replay_state.guard_call(router, layer)
        rank = replay_state.current_rank()
        fwd = self._forward(router, layer, rank)
        if fwd.inference or fwd.kind == "native":
            return self.original(router, logits, *args, **kwargs)
        keys = fwd.keys(router, layer, logits.numel() // router.num_experts, rank=rank)
        if fwd.table is None:  # the forward's first routing call: newer rollout steps replace the tables
            self.source.refresh()
            fwd.table = self.source.table(fwd.chunk, layers=_layers_of(fwd.chunk), config=router.config, rank=rank)
            self.table_bytes = fwd.table.nbytes()
        self.phase = fwd.kind
        hook = self._replay_from(fwd.table, fwd, keys, router, layer, rank)
        return replay_state.call_with_hook(self.original, router, hook, logits, args, kwargs)


def _checked(table: RouteTable, fwd: ChunkForward, *, layer: int, rank: int) -> None:
    """``table.check`` of a forward's lookup; a refusal names how an untold BSHD padding could be told."""
    found = fwd.found
    assert found is not None  # the check runs after the forward's lookup
    try:
        table.check(found, layer=layer, rank=rank)
    except RouteError as exc:
        first = int(found.bad_T.nonzero()[0]) if bool(found.bad_T.any()) else None
        hint = fwd.padding_hint() if first is not None and not bool(found.found_T[first]) else ""
        if not hint:  # a route of another kind (conflicting, another version): padding is not the question
            raise
        raise RouteError(f"{exc}{hint}") from None


def _layers_of(chunk) -> list[int]:
    from megatron.core.transformer.moe.router import TopKRouter  # lazy: megatron

    return sorted(global_layer(m) for m in chunk.modules() if isinstance(m, TopKRouter))


def _pool_group(config):
    """The ranks that each route a part of every sequence, whose recordings are pooled when a table freezes: another
    batch width moves a token to another of them. Under sequence parallel the TP ranks (each a slice of the
    sequence), under context parallel the CP ranks (zigzag halves), both: the TP x CP group; else None."""
    from megatron.core import parallel_state  # lazy: megatron

    sp = getattr(config, "sequence_parallel", False) and parallel_state.get_tensor_model_parallel_world_size() > 1
    cp = parallel_state.get_context_parallel_world_size() > 1
    if sp and cp:
        return parallel_state.get_tensor_and_context_parallel_group()
    if sp:
        return parallel_state.get_tensor_model_parallel_group()
    if cp:
        return parallel_state.get_context_parallel_group()
    return None


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    if value in (None, ""):
        return default
    if not (value.isascii() and value.isdigit()) or len(value) > 18 or int(value) < 1:
        raise UsageError(f"{name}={value[:40]!r}: expected a positive integer")
    return int(value)


def refuse_router(router, layer: int) -> None:
    """Routers in-job replay cannot key by token (checked when a router is bound)."""
    if getattr(router, "is_mtp_layer", False):
        raise UsageError(
            f"layer {layer}: in-job replay (r2, r3) keys a token by its prefix, but an MTP layer's "
            "router also sees the next tokens; MTP layers are not supported in in-job replay"
        )


class InJobSession:
    """The process-wide r2 session behind ``autopatch``: binds the selected model's routers to one ``InJobState``.

    Args:
        selected: ``router -> bool``, autopatch's model choice (build order, ``MOEVERIFY_ROUTER_REPLAY_MODEL``).
    """

    def __init__(self, *, selected, original, directory=None, rollout: bool = False):
        self._selected = selected
        self._original = original
        self._directory = directory  # r3: the rollout directory
        self._rollout = rollout or directory is not None  # r3 (from files, or with the batch when no directory)
        self.batch = None  # r3 with the batch: the routes handed over by injob.add_routes()
        if self._rollout and directory is None:
            self.batch = batch_routes.BatchSource(
                max_tokens=_env_int(MAX_TOKENS_ENV, DEFAULT_MAX_TOKENS),
                duplicates=os.environ.get(DUPLICATES_ENV) or "first",
            )
            batch_routes.attach(self.batch)
        self._bound: dict[int, weakref.ref] = {}
        self._native: weakref.WeakSet = weakref.WeakSet()
        self.state: InJobState | None = None
        self.step = 0

    def bind(self, router):
        """``router_replay.set_fallback`` binder: ``(state, layer)`` for the selected model, None for others."""
        if router in self._native:
            return None
        layer = global_layer(router)
        held = self._bound.get(layer)
        if held is None or held() is not router:
            if not self._selected(router):
                self._native.add(router)
                return None

            fwd = _CURRENT[-1] if _CURRENT else None
            graphs = _graphs_of(fwd.chunk) if fwd is not None and id(router) in _routers_of(fwd.chunk) else None
            rr.refuse_config(router, layer, disable_fusion=False, graphs=graphs)
            refuse_router(router, layer)
            if self.state is None and self._rollout:
                self.state = RolloutState(
                    original=self._original,
                    num_experts=router.num_experts,
                    directory=self._directory,
                    source=self.batch,
                )
            elif self.state is None:
                self.state = InJobState(original=self._original, num_experts=router.num_experts)
            self._bound[layer] = weakref.ref(router)
        return self.state, layer

    def end_step(self) -> None:
        """An optimizer step: nothing to close (one RL step's table serves all its optimizer steps)."""
        self.step += 1

    def finish(self) -> list[str]:
        return []
