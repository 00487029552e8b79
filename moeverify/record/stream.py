"""Layer sources: one side of a diff, handed out one MoE layer at a time (``diff.diff_stream``).

A source has ``layers``, ``microbatches``, ``num_experts``, ``topk``, ``microbatch_tokens()`` (no data
read) and ``layer(layer)`` (that layer's ``[T, K]`` ids, one tensor per micro-batch). ``routes()`` gives
the whole ``Routes`` for the in-memory engine (``diff.diff``), through the same reader.

- ``DumpSource``: a dump on disk; ``layer`` reads and merges only that layer (``Dump.layer_routes``).
- ``RoutesSource``: routes already in memory (an array side).
- ``MappedSource``: physical expert slots mapped to logical ids (``expert_map.ExpertMap``) as each layer
  is read.
- ``WidenedSource``: the same ids under a larger expert count (an array knows only its largest id).
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

import torch

from moeverify.record.layer_read import gather_rows
from moeverify.record.reader import Dump
from moeverify.routing.expert_map import ExpertMap
from moeverify.routing.routes import Routes


class LayerSource(Protocol):
    """One side of a diff: the members the module docstring lists."""

    @property
    def layers(self) -> tuple[int, ...]: ...

    @property
    def microbatches(self) -> int: ...

    @property
    def num_experts(self) -> int: ...

    @property
    def topk(self) -> int: ...

    def microbatch_tokens(self) -> list[int]: ...

    def layer(self, layer: int) -> list[torch.Tensor]: ...

    def routes(self) -> Routes: ...


@dataclasses.dataclass(frozen=True)
class RoutesSource:
    data: Routes

    @property
    def layers(self) -> tuple[int, ...]:
        return self.data.layers

    @property
    def microbatches(self) -> int:
        return self.data.microbatches

    @property
    def num_experts(self) -> int:
        return self.data.num_experts

    @property
    def topk(self) -> int:
        return self.data.topk

    def microbatch_tokens(self) -> list[int]:
        first = self.data.layers[0] if self.data.layers else None
        return [0 if first is None else self.data.get(first, mb).shape[0] for mb in range(self.microbatches)]

    def layer(self, layer: int) -> list[torch.Tensor]:
        return [self.data.get(layer, mb) for mb in range(self.microbatches)]

    def routes(self) -> Routes:
        return self.data


@dataclasses.dataclass(frozen=True)
class DumpSource:
    dump: Dump
    step: int = 0

    @property
    def layers(self) -> tuple[int, ...]:
        return tuple(sorted(self.dump.model.moe_layers))

    @property
    def microbatches(self) -> int:
        return self.dump.steps[self.step].microbatches if self.step in self.dump.steps else 0

    @property
    def num_experts(self) -> int:
        return self.dump.model.num_experts

    @property
    def topk(self) -> int:
        return self.dump.model.topk

    def microbatch_tokens(self) -> list[int]:
        return self.dump.microbatch_tokens(step=self.step)

    def layer(self, layer: int) -> list[torch.Tensor]:
        routes = self.dump.layer_routes(step=self.step, layer=layer)
        return [routes.get(layer, mb) for mb in range(routes.microbatches)]

    def routes(self) -> Routes:
        return self.dump.routes(step=self.step)


class LayerPairs:
    """Both sides of a diff, one layer at a time: ``pairs(layer)`` gives A's ``[T, K]`` ids per micro-batch,
    B's, and per micro-batch the global token of each row (None: row ``t`` is token ``t``).

    Of two dumps, B's rows byte-identical to A's rows (checked as A's layer was read) are not checked again
    (``Routes.adopt(like=)``): two runs that mostly agree cost about one side's id checks, not two; a bad row
    of B is still refused, with the message a whole check gives. A layer that one rank alone holds is compared
    in that rank's row order (``Dump.layer_rows``) when both sides share it: the rows are not moved, and only
    the differing rows' global tokens are looked up.
    """

    def __init__(self, a: LayerSource, b: LayerSource):
        self.a, self.b = a, b
        self._same: dict[tuple[int, int], bool] = {}  # (id(A's tokens), id(B's)): the dumps cache them

    def __call__(self, layer: int) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor | None]]:
        a, b = self.a, self.b
        if not (isinstance(a, DumpSource) and isinstance(b, DumpSource)):
            mbs_a, mbs_b = a.layer(layer), b.layer(layer)
            return mbs_a, mbs_b, [None] * len(mbs_a)
        routes_a, tokens_a = a.dump.layer_rows(step=a.step, layer=layer)
        routes_b, tokens_b = b.dump.layer_rows(step=b.step, layer=layer, like=routes_a)
        mbs_a = [routes_a.get(layer, mb) for mb in range(routes_a.microbatches)]
        mbs_b = [routes_b.get(layer, mb) for mb in range(routes_b.microbatches)]
        if len(tokens_a) == len(tokens_b) and all(
            self._same_order(x, y) for x, y in zip(tokens_a, tokens_b, strict=True)
        ):
            return mbs_a, mbs_b, tokens_a
        return _in_token_order(mbs_a, tokens_a), _in_token_order(mbs_b, tokens_b), [None] * len(mbs_a)

    def _same_order(self, x: torch.Tensor | None, y: torch.Tensor | None) -> bool:
        if x is None or y is None:
            return x is y
        key = (id(x), id(y))
        if key not in self._same:
            self._same[key] = x.shape == y.shape and torch.equal(x, y)
        return self._same[key]


def _in_token_order(mbs: list[torch.Tensor], tokens: list[torch.Tensor | None]) -> list[torch.Tensor]:
    """Rows moved to global token order (row ``r`` to ``tokens[mb][r]``)."""
    return [
        t if tok is None else gather_rows(t, torch.empty_like(tok).index_copy_(0, tok, torch.arange(tok.numel())))
        for t, tok in zip(mbs, tokens, strict=True)
    ]


class _Wrapped:
    """A source around ``inner``: its layers, micro-batches, top-k and token counts are ``inner``'s."""

    inner: LayerSource  # a dataclass field of each subclass

    @property
    def layers(self) -> tuple[int, ...]:
        return self.inner.layers

    @property
    def microbatches(self) -> int:
        return self.inner.microbatches

    @property
    def topk(self) -> int:
        return self.inner.topk

    def microbatch_tokens(self) -> list[int]:
        return self.inner.microbatch_tokens()


@dataclasses.dataclass(frozen=True)
class MappedSource(_Wrapped):
    inner: LayerSource
    expert_map: ExpertMap
    where: str
    token_label: object = None  # (microbatch, row) -> text naming the token in messages

    @property
    def num_experts(self) -> int:
        return self.expert_map.logical

    def layer(self, layer: int) -> list[torch.Tensor]:
        return [
            self.expert_map.apply(layer, t, where=self.where, microbatch=mb, token_label=self.token_label)
            for mb, t in enumerate(self.inner.layer(layer))
        ]

    def routes(self) -> Routes:
        return self.inner.routes().map_experts(self.expert_map, where=self.where, token_label=self.token_label)


@dataclasses.dataclass(frozen=True)
class WidenedSource(_Wrapped):
    inner: LayerSource
    num_experts: int

    def layer(self, layer: int) -> list[torch.Tensor]:
        return self.inner.layer(layer)

    def routes(self) -> Routes:
        r = self.inner.routes()
        if r.num_experts == self.num_experts:
            return r
        return Routes(
            {layer: [r.get(layer, mb) for mb in range(r.microbatches)] for layer in r.layers},
            num_experts=self.num_experts,
            topk=r.topk,
        )


def widen(source, num_experts: int):
    """``source`` under ``num_experts`` (its own count when already that)."""
    return source if source.num_experts == num_experts else WidenedSource(source, num_experts)
