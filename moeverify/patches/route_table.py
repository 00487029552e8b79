"""One model chunk's routes of one RL step's log-prob passes, found again by token identity.

Legend of shape suffixes: T = tokens of one forward (router order), N = recorded tokens (all forwards),
G = distinct recorded keys, K = top-k.

Recording appends each log-prob forward's keys ``[T]`` and, per MoE layer, its ids ``[T, K]``. The first
lookup freezes the table: keys are sorted once, duplicates (the same prefix recorded more than once: GRPO
responses of one prompt, a sequence in two passes) collapse to one entry, and a key whose copies hold
different expert sets is marked as a conflict. A lookup is one sorted search per forward; each layer then
gathers its ids with that search's result. A recorded token may be flagged native (R3: the last token of a request,
whose route the rollout engine never computed): it is found, and routes natively; a real route recorded for the
same key elsewhere wins over the flag. The lookup makes no host sync: whether every token was found is
copied to pinned host memory behind an event and read once per forward, when it ends, waiting only for the search
(long finished by then), never for the work queued after it.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from moeverify.errors import RouteError
from moeverify.patches.token_keys import TokenKeys, salted, version_salt

DUPLICATES = ("refuse", "first")  # a key recorded with different routes: refuse at lookup, or keep the first
# The environment variables of a table's settings (read by ``injob``, named by the messages here)
MAX_TOKENS_ENV = "MOEVERIFY_ROUTER_REPLAY_MAX_TOKENS"  # RouteTable.max_tokens
DUPLICATES_ENV = "MOEVERIFY_ROUTER_REPLAY_DUPLICATES"  # one of DUPLICATES
_R2_ORIGIN = "this step's log-prob pass"
_R2_REMEDY = "run the log-prob pass on every sequence the step trains on"
# Where a padding token reads as content: packed sequences whose cu_seqlens_q holds the padded lengths (verl's
# preprocess_packed_seqs passes cu_seqlens_padded as both) give padding no mark at all.
_MARK_PADDING = (
    "mark padding: padding_mask for [B, S] batches; for packed (THD) ones cu_seqlens_q must hold the real lengths "
    "and cu_seqlens_q_padded the slots (passing the padded lengths as both, as verl's preprocess_packed_seqs does, "
    "makes each slot's padding read as content)"
)


class _DeviceFlag:
    """A device boolean read later without draining the stream: copied to pinned memory behind an event, so the
    read waits only for the kernels before it (long done by then), not for the work queued since."""

    __slots__ = ("value", "host", "event")

    def __init__(self, value: torch.Tensor):
        self.value, self.host, self.event = value, None, None
        if value.is_cuda:
            self.host = torch.empty((), dtype=value.dtype, pin_memory=True)
            self.host.copy_(value, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()

    def read(self) -> bool:
        if self.event is None:
            return bool(self.value)
        self.event.synchronize()
        return bool(self.host)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Lookup:
    """Where a forward's tokens sit in a frozen table: ``index_T`` (G rows); ``native_T``: tokens to route natively
    (padding not found, tokens recorded native; None when there are none); ``bad_T``: tokens ``RouteTable.check``
    refuses."""

    index_T: torch.Tensor
    native_T: torch.Tensor | None
    bad_T: torch.Tensor
    found_T: torch.Tensor
    keys: TokenKeys
    any_bad: _DeviceFlag
    version_T: torch.Tensor | None = None  # versioned tables: the index (in ``versions``) each token was served from
    ambiguous_T: torch.Tensor | None = None  # versioned tables: sequences held whole by several versions
    version: int | torch.Tensor | None = None  # the version the forward named (per token ``[T]``: per sequence), if any
    ids_TLK: torch.Tensor | None = None  # every layer's ids of the forward, gathered at its first layer


_NONE = torch.empty(0)  # a frozen table's tensors before ``freeze`` (``RouteTable.frozen``: not this one)


class RouteTable:
    """Routes keyed by token; see the module docstring.

    Args:
        max_tokens: refuse to record more tokens than this (duplicates counted): the table's memory bound.
        num_experts: picks the stored id dtype (int16 up to 32767 experts).
        duplicates: ``"refuse"`` or ``"first"`` (see ``DUPLICATES``).
        origin: what recorded the routes, and how to record a missing token, for error messages.
    """

    def __init__(
        self,
        *,
        max_tokens: int,
        num_experts: int,
        duplicates: str = "refuse",
        origin: tuple[str, str] = (_R2_ORIGIN, _R2_REMEDY),
    ):
        self.max_tokens = max_tokens
        self.duplicates = duplicates
        self.origin, self.remedy = origin
        self.dtype = torch.int16 if num_experts <= torch.iinfo(torch.int16).max else torch.int32
        self.tokens = 0
        self._keys: list[torch.Tensor] = []  # keys_2T per forward
        self._native: list[torch.Tensor | None] = []  # native_T per forward
        # frozen: set by ``freeze`` (empty before)
        self.native_G: torch.Tensor = _NONE
        self.any_native = False
        self._ids: dict[int, list[torch.Tensor]] = {}
        self._unsorted = False  # some ids added with rows not yet ascending (``add_ids``)
        self.keys_2G: torch.Tensor = _NONE  # sorted by the first half
        self.conflict_G: torch.Tensor = _NONE
        self.ids_GLK: torch.Tensor = _NONE  # every layer's ids, one gather serves a forward
        self.layer_index: dict[int, int] = {}  # global layer -> its column in ids_GLK
        self.versions: list[int] = []  # rollout versions held (newest first); empty: one unversioned recording
        self._forward_version: list[int] = []  # per recorded forward, its index in ``versions``
        self.xconflict_G: torch.Tensor = _NONE  # versioned: the token's route differs in another version
        self._salts: dict = {}  # frozen, versioned: device -> version_salt(self.versions) (``_versioned``)

    @property
    def frozen(self) -> bool:
        return self.keys_2G is not _NONE

    def add_forward(
        self, keys: TokenKeys, *, rank: int, native_T: torch.Tensor | None = None, version: int | None = None
    ) -> int:
        """Register a recorded forward's tokens (``native_T``: those to route natively; ``version``: the rollout
        version they were generated under, kept apart from other versions' routes); returns its forward index."""
        if self.tokens + keys.tokens > self.max_tokens:
            raise RouteError(
                f"rank {rank}: {self.tokens + keys.tokens} tokens of {self.origin} for one model chunk, "
                f"over the cap of {self.max_tokens} (memory bound of in-job replay); raise "
                f"{MAX_TOKENS_ENV} if they really are that many"
            )
        if (version is None) != (not self.versions) and self.tokens:
            raise RouteError(f"rank {rank}: a route table holds versioned and unversioned routes at once")
        if version is not None:
            if version not in self.versions:
                self.versions.append(version)
            keys = salted(keys, version_salt([version], device=keys.keys_2T.device)[:, 0])
            self._forward_version.append(self.versions.index(version))
        self.tokens += keys.tokens
        self._keys.append(keys.keys_2T)
        self._native.append(native_T)
        return len(self._keys) - 1

    def add_ids(self, *, layer: int, forward: int, ids_TK: torch.Tensor, rank: int, canonical: bool = False) -> None:
        """One layer's ids of a registered forward; ``canonical``: each row already ascending (no sort at freeze)."""
        held = self._ids.setdefault(layer, [])
        if len(held) != forward:
            raise RouteError(
                f"layer {layer} rank {rank}: log-prob forward {forward} routed this layer after "
                f"{len(held)} forward(s); each forward must route every layer once"
            )
        held.append(ids_TK.to(self.dtype))
        if not canonical:
            self._unsorted = True

    def freeze(self, *, rank: int, group=None) -> None:
        """Sort and deduplicate the recorded keys; mark keys recorded with different expert sets.

        Args:
            group: a process group whose ranks each routed a part of every token list (the TP group under
                sequence parallel): their recordings are pooled, since another batching splits sequences
                over the ranks at other positions. Collective over ``group``."""
        forwards = len(self._keys)
        short = {layer: len(ids) for layer, ids in self._ids.items() if len(ids) != forwards}
        if short:
            raise RouteError(
                f"rank {rank}: per layer, log-prob forwards routed {short} of {forwards}: a log-prob "
                "forward stopped before its last MoE layer"
            )
        key1_N, key2_N = torch.cat(self._keys, dim=1)
        native_N = torch.cat(
            [
                torch.zeros(k.shape[1], dtype=torch.bool, device=k.device)
                if n is None
                else n.to(device=k.device, dtype=torch.bool)
                for k, n in zip(self._keys, self._native, strict=True)
            ]
        )
        if group is not None:
            key1_N, key2_N, native_N = self._pool(key1_N, key2_N, native_N, group)
        order_N = torch.argsort(native_N.to(torch.int8), stable=True)  # a real route before a native flag
        order_N = order_N[torch.argsort(key2_N[order_N], stable=True)]
        order_N = order_N[torch.argsort(key1_N[order_N], stable=True)]
        key1_N, key2_N, native_N = key1_N[order_N], key2_N[order_N], native_N[order_N]
        same1 = key1_N[1:] == key1_N[:-1]
        same = same1 & (key2_N[1:] == key2_N[:-1])
        if bool((same1 & ~same).any()):
            raise RouteError(
                f"rank {rank}: two different recorded token prefixes share one 64-bit key half (chance "
                "about N^2 / 2^65); rerun the step"
            )
        first_N = torch.ones_like(key1_N, dtype=torch.bool)
        first_N[1:] = ~same
        group_N = torch.cumsum(first_N, dim=0) - 1
        heads_G = first_N.nonzero().squeeze(1)
        conflict_G = torch.zeros(heads_G.shape[0], dtype=torch.int32, device=key1_N.device)
        layers = sorted(self._ids)
        self.layer_index = {layer: i for i, layer in enumerate(layers)}
        if layers:  # every layer at once: one gather, one sort (where the rows are not ascending yet), one compare
            ids_NLK = torch.stack(
                [self._ids[layer][0] if forwards == 1 else torch.cat(self._ids[layer]) for layer in layers], dim=1
            )[order_N]
            if self._unsorted:
                ids_NLK = ids_NLK.sort(dim=2).values  # a route is an expert set: slot order does not count
            if not bool(same.any()):  # every key once: nothing to compare
                self.ids_GLK = ids_NLK
            else:
                differs_N = (ids_NLK != ids_NLK[heads_G][group_N]).flatten(1).any(dim=1) & ~native_N
                conflict_G.index_add_(0, group_N, differs_N.to(torch.int32))
                self.ids_GLK = ids_NLK[heads_G]  # kept ascending: replay orders a set's slots itself
        else:
            self.ids_GLK = torch.zeros(heads_G.shape[0], 0, 0, dtype=self.dtype, device=key1_N.device)
        self.keys_2G = torch.stack([key1_N[heads_G], key2_N[heads_G]])
        self.conflict_G = conflict_G > 0
        self.native_G = native_N[heads_G]
        self.any_native = bool(self.native_G.any())
        if self.versions:
            version_N = torch.cat(
                [
                    torch.full((k.shape[1],), v, dtype=torch.int64, device=k.device)
                    for k, v in zip(self._keys, self._forward_version, strict=True)
                ]
            )[order_N]
            self.xconflict_G = self._across_versions(version_N[heads_G])
        self._keys.clear()
        self._forward_version.clear()
        self._native.clear()
        self._ids.clear()
        self._unsorted = False

    def _across_versions(self, version_G: torch.Tensor) -> torch.Tensor:
        """``[G]``: the same token (unsalted key) holds another expert set in another version (a real route in each)."""
        if len(self.versions) == 1:  # no other version to differ from
            return torch.zeros_like(version_G, dtype=torch.bool)
        salt_2G = version_salt(self.versions, device=version_G.device)[:, version_G]
        plain1_G, plain2_G = self.keys_2G - salt_2G
        order_G = torch.argsort(plain2_G, stable=True)
        order_G = order_G[torch.argsort(plain1_G[order_G], stable=True)]
        p1, p2 = plain1_G[order_G], plain2_G[order_G]
        first = torch.ones_like(p1, dtype=torch.bool)
        first[1:] = (p1[1:] != p1[:-1]) | (p2[1:] != p2[:-1])
        group = torch.cumsum(first, dim=0) - 1
        heads = first.nonzero().squeeze(1)
        real = ~self.native_G[order_G]
        differs = torch.zeros(heads.shape[0], dtype=torch.int32, device=version_G.device)
        head_real = real[heads][group]
        for i in range(self.ids_GLK.shape[1]):
            canon = self.ids_GLK[order_G, i]  # rows ascending since freeze
            differs.index_add_(0, group, ((canon != canon[heads][group]).any(dim=1) & real & head_real).to(torch.int32))
        out = torch.zeros_like(plain1_G, dtype=torch.bool)
        out[order_G] = (differs > 0)[group]
        return out

    def _pool(self, key1_N, key2_N, native_N, group) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """All-gather the recorded rows of ``group`` (sizes differ per rank); flags and every layer's ids come along."""
        layers = sorted(self._ids)
        rows_NC = torch.cat(
            [key1_N[:, None], key2_N[:, None], native_N[:, None].long()]
            + [torch.cat(self._ids[layer]).long() for layer in layers],
            dim=1,
        )
        count = torch.tensor([rows_NC.shape[0]], device=rows_NC.device)
        counts = [torch.zeros_like(count) for _ in range(dist.get_world_size(group))]
        dist.all_gather(counts, count, group=group)
        most = int(max(c.item() for c in counts))
        padded_NC = torch.zeros(most, rows_NC.shape[1], dtype=rows_NC.dtype, device=rows_NC.device)
        padded_NC[: rows_NC.shape[0]] = rows_NC
        gathered = [torch.empty_like(padded_NC) for _ in counts]
        dist.all_gather(gathered, padded_NC, group=group)
        pooled_NC = torch.cat([g[: int(c.item())] for g, c in zip(gathered, counts, strict=True)])
        k = (pooled_NC.shape[1] - 3) // max(len(layers), 1)
        for i, layer in enumerate(layers):
            self._ids[layer] = [pooled_NC[:, 3 + i * k : 3 + (i + 1) * k].to(self.dtype)]
        return pooled_NC[:, 0].contiguous(), pooled_NC[:, 1].contiguous(), pooled_NC[:, 2].bool()

    def nbytes(self) -> int:
        """Device bytes held by the frozen table (keys, conflict flags and ids)."""
        if not self.frozen:
            raise RouteError("nbytes() of a table still recording")
        tensors = [self.keys_2G, self.conflict_G, self.native_G, self.ids_GLK]
        if self.xconflict_G is not _NONE:
            tensors.append(self.xconflict_G)
        return sum(t.numel() * t.element_size() for t in tensors)

    def _find(self, keys_2T: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(index_T, found_T)`` of keys in the frozen table."""
        index_T = torch.searchsorted(self.keys_2G[0], keys_2T[0]).clamp(max=self.keys_2G.shape[1] - 1)
        return index_T, (self.keys_2G[:, index_T] == keys_2T).all(dim=0)

    def _versioned(
        self, keys: TokenKeys, version: int | torch.Tensor | None
    ) -> tuple[TokenKeys, torch.Tensor, torch.Tensor | None]:
        """Each token's version: the one named (for the forward, or ``[Q]`` per sequence), else the version that
        holds its whole sequence (its last real token), the newest where several do (flagged ambiguous). Returns
        the keys salted with it."""
        device = keys.keys_2T.device
        salt_2V = self._salts.get(device)
        if salt_2V is None:  # made once a device: a tensor built from host ints per lookup would sync the stream
            salt_2V = self._salts[device] = version_salt(self.versions, device=device)
        if keys.last_2T is None:
            raise RouteError("versioned route tables need each token's sequence key (TokenKeys.last_2T)")
        if isinstance(version, torch.Tensor):  # one version per sequence of the forward
            if keys.seq_T is None or keys.sequences != version.numel():
                raise RouteError(
                    f"rollout_version: {version.numel()} per-sequence versions for a forward of "
                    f"{keys.sequences if keys.seq_T is not None else 'an unknown number of'} sequences (batch rows, "
                    "or packed sequences): give one version per sequence, in the forward's order"
                )
            named_T = version.to(device)[keys.seq_T]
            version_T = torch.full((keys.tokens,), -1, dtype=torch.int64, device=device)
            for i, v in enumerate(self.versions):
                version_T = version_T.masked_fill(named_T == v, i)
            salt_2T = salt_2V[:, version_T.clamp(min=0)]
            return salted(keys, salt_2T), version_T, torch.zeros_like(version_T, dtype=torch.bool)
        if version is not None:
            if version not in self.versions:
                version_T = torch.full((keys.tokens,), -1, dtype=torch.int64, device=device)
                return keys, version_T, torch.zeros(keys.tokens, dtype=torch.bool, device=device)
            version_T = torch.full((keys.tokens,), self.versions.index(version), dtype=torch.int64, device=device)
            return salted(keys, salt_2V[:, version_T]), version_T, torch.zeros_like(version_T, dtype=torch.bool)
        if len(self.versions) == 1:  # one version: every sequence is either in it or not found at all
            version_T = torch.zeros(keys.tokens, dtype=torch.int64, device=device)
            return salted(keys, salt_2V[:, 0]), version_T, None
        held_VT = torch.stack([self._find(keys.last_2T + salt_2V[:, v, None])[1] for v in range(len(self.versions))])
        version_T = held_VT.to(torch.int8).argmax(dim=0).long()  # the first (newest) version holding the sequence
        ambiguous_T = held_VT.sum(dim=0) > 1
        return salted(keys, salt_2V[:, version_T]), version_T, ambiguous_T

    def lookup(self, keys: TokenKeys, *, version: int | torch.Tensor | None = None) -> Lookup:
        """Find a forward's tokens, with no host sync: ``Lookup.check`` (later) refuses the bad ones.

        Args:
            version: a versioned table serves every token from this version (the forward named it), or from its
                sequence's (``[Q]``: one per batch row or packed sequence); else each sequence from the version
                that holds it whole (several: refused).
        """
        version_T = ambiguous_T = None
        if self.versions:
            keys, version_T, ambiguous_T = self._versioned(keys, version)
        elif version is not None:
            raise RouteError(f"a forward names rollout version {version}, but {self.origin} carry no version")
        index_T, found_T = self._find(keys.keys_2T)
        if version_T is not None:
            found_T = found_T & (version_T >= 0)
        bad_T = ~found_T
        if ambiguous_T is not None:  # a sequence whole in several versions: refused where its routes differ
            ambiguous_T = ambiguous_T & found_T & self.xconflict_G[index_T]
            bad_T = bad_T | ambiguous_T
        if self.duplicates == "refuse":
            bad_T = bad_T | (found_T & self.conflict_G[index_T])
        native_T = None
        if keys.pad_T is not None:
            bad_T = bad_T & ~keys.pad_T
            native_T = keys.pad_T | ~found_T  # padding routes natively (bad_T covers the rest)
        if self.any_native:
            flagged_T = found_T & self.native_G[index_T]
            native_T = flagged_T if native_T is None else native_T | flagged_T
        return Lookup(
            index_T=index_T,
            native_T=native_T,
            bad_T=bad_T,
            found_T=found_T,
            keys=keys,
            any_bad=_DeviceFlag(bad_T.any()),
            version_T=version_T,
            ambiguous_T=ambiguous_T,
            version=version if not isinstance(version, torch.Tensor) else version.to(keys.keys_2T.device)[keys.seq_T],
        )

    def check(self, found: Lookup, *, layer: int, rank: int) -> None:
        """``RouteError`` for a looked-up token (not padding) with no route or a conflicting one."""
        if found.any_bad.read():
            raise RouteError(self._explain(found, layer=layer, rank=rank))

    def _explain(self, found: Lookup, *, layer: int, rank: int) -> str:
        keys, found_T, bad_T = found.keys, found.found_T, found.bad_T
        bad = bad_T.nonzero().squeeze(1)
        t = int(bad[0])
        seq, pos = keys.locate(t)
        where = f"layer {layer} rank {rank}: training token {t} (sequence {seq} of this forward, position {pos})"
        more = f" ({bad.numel()} of {keys.tokens} tokens of this forward)"
        versions = ", ".join(str(v) for v in self.versions)
        named = int(found.version[t]) if isinstance(found.version, torch.Tensor) else found.version
        if named is not None and isinstance(found.version, torch.Tensor):
            where += f", its sequence named rollout version {named}"
        if named is not None and named not in self.versions:
            return (
                f"{where}: the forward names rollout version {named}, but {self.origin} hold versions "
                f"{versions}{more}: train on a version that is served, or write that version's routes"
            )
        if found.ambiguous_T is not None and bool(found.ambiguous_T[t]):
            return (
                f"{where}: its whole sequence was rolled out under several versions ({versions}), routed "
                f"differently in them{more}; which version's routes it trains on cannot be told from its tokens: "
                "name the version the batch was generated under with `with injob.rollout_version(N):` around the "
                "forward"
            )
        if not bool(found_T[t]) and named is not None:
            return (
                f"{where} has no route recorded by {self.origin}{more}: version {named}, which the "
                "forward names (injob.rollout_version), did not roll out this token's sequence; train it under "
                "the version that generated it"
            )
        if not bool(found_T[t]) and self.versions:
            return (
                f"{where} has no route recorded by {self.origin}{more}: no served version holds its whole sequence "
                f"(versions {versions}; a sequence takes every route from the one version that rolled it out, "
                f"never a shared prefix's route from another); {self.remedy}, or {_MARK_PADDING}"
            )
        if not bool(found_T[t]):
            return (
                f"{where} has no route recorded by {self.origin}{more}; in-job replay replays routes only on "
                f"the tokens (same content and position from the sequence start) it recorded: {self.remedy}, "
                f"or {_MARK_PADDING}"
            )
        return (
            f"{where} was recorded more than once with different expert sets{more}: identical prefixes "
            f"routed differently by {self.origin}: batch-dependent numerics, or a pass of other weights on this "
            "model recorded too (a reference model's log-probs computed by loading its weights into the training "
            "model: run that pass under injob.pass_kind('native')); set "
            f"{DUPLICATES_ENV}=first to replay the first recorded route"
        )

    def ids(self, layer: int, found: Lookup) -> torch.Tensor:
        """This layer's recorded ids ``[T, K]`` (int64) for a looked-up forward: the forward's first call gathers
        every layer's at once (one gather and one cast a forward, not one each per layer)."""
        ids_TLK = found.ids_TLK
        if ids_TLK is None:
            ids_TLK = self.ids_GLK[found.index_T].long()
            object.__setattr__(found, "ids_TLK", ids_TLK)
        return ids_TLK[:, self.layer_index[layer]]
