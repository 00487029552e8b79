"""Token order: which token each route row belongs to, so two sources are compared token for token.

Two orders occur per micro-batch of ``B`` sequences of ``S`` tokens:

- ``sequence``: ``g = b * S + s``, each sequence contiguous. The canonical order: a dump whose steps record
  their geometry (``seq_len``, ``batch``) merges to it (``Dump.routes``), and rollout engines (vLLM's
  ``routed_experts``, SGLang's ``return_routed_experts``) return each request's tokens in it.
- ``router``: ``r = s * B + b``, Megatron's router flattening ``[s, b, h]``; what ``session.routes()``,
  a one-rank ``RouteRecorder`` and Megatron-Core's own ``router_trace`` hold.

A source whose order is not known (an array or a trace converted without ``--order``/``--seq-len``/
``--batch``, a dump saved without geometry) is never compared by position: ``dump diff`` refuses it and
says what to supply. Legend: T = tokens of a micro-batch, K = top-k.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from moeverify.errors import UsageError
from moeverify.routing.routes import Routes

ORDERS = ("sequence", "router")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Ordered:
    """One source (a ``stream`` layer source or ``Routes``) and what is known of its token order (``order``
    None: unknown) and, in sequence order, of its sequences (``seq_len`` per micro-batch and ``batch``)."""

    routes: object
    source: str
    order: str | None
    why_unknown: str = ""
    seq_len: tuple[int, ...] | None = None
    batch: int | None = None

    @property
    def geometry(self) -> tuple[tuple[int, ...], int] | None:
        return None if self.seq_len is None or self.batch is None else (self.seq_len, self.batch)


def _lengths(seq_len: int | Sequence[int], microbatches: int, where: str) -> list[int]:
    lens = [seq_len] * microbatches if isinstance(seq_len, int) else list(seq_len)
    if len(lens) != microbatches:
        raise UsageError(f"{where}: {len(lens)} seq_len value(s) for {microbatches} micro-batch(es)")
    return lens


def _permute(routes: Routes, *, seq_len, batch: int, where: str, to: str) -> Routes:
    """Routes reordered ``router -> sequence`` (``to="sequence"``) or back (``to="router"``)."""
    lens = _lengths(seq_len, routes.microbatches, where)
    per_layer = {}
    for layer in routes.layers:
        out = []
        for mb, length in enumerate(lens):
            ids_TK = routes.get(layer, mb)
            if ids_TK.shape[0] != length * batch:
                raise UsageError(
                    f"{where}: layer {layer} micro-batch {mb}: {ids_TK.shape[0]} tokens != seq_len "
                    f"{length} x batch {batch} = {length * batch}"
                )
            if to == "sequence":  # [S, B, K] -> [B, S, K]
                out.append(ids_TK.view(length, batch, -1).transpose(0, 1).reshape(length * batch, -1))
            else:
                out.append(ids_TK.view(batch, length, -1).transpose(0, 1).reshape(length * batch, -1))
        per_layer[layer] = out
    return Routes(per_layer, num_experts=routes.num_experts, topk=routes.topk)


def to_sequence_order(
    routes: Routes, *, order: str, seq_len=None, batch: int | None = None, where: str = "routes"
) -> Routes:
    """``routes`` (in ``order``) in sequence order; router order needs ``seq_len`` and ``batch``."""
    if order not in ORDERS:
        raise UsageError(f"{where}: token order {order!r} is not one of {', '.join(ORDERS)}")
    if order == "sequence" or batch == 1:
        return routes
    if seq_len is None or batch is None:
        raise UsageError(
            f"{where}: routes in router order (s * B + b) need --seq-len and --batch to be put in sequence order"
        )
    return _permute(routes, seq_len=seq_len, batch=batch, where=where, to="sequence")


def to_router_order(routes: Routes, *, seq_len, batch: int, where: str = "routes") -> Routes:
    """Sequence-order ``routes`` in Megatron's router order (how a one-rank dump stores them)."""
    return routes if batch == 1 else _permute(routes, seq_len=seq_len, batch=batch, where=where, to="router")


def shared_geometry(a: Ordered, b: Ordered) -> tuple[tuple[int, ...], int] | None:
    """The sequences both sides are cut into (``(seq_len per micro-batch, batch)``), from whichever side knows
    them; None when neither does. Two sides that know different cuts are refused."""
    if a.geometry is not None and b.geometry is not None and a.geometry != b.geometry:
        (sa, ba), (sb, bb) = a.geometry, b.geometry
        raise UsageError(
            f"{a.source} cuts its tokens into sequences of seq_len {list(sa)} x batch {ba}, {b.source} "
            f"into seq_len {list(sb)} x batch {bb}: token g is not the same token on both sides"
        )
    return a.geometry or b.geometry


def require_same_tokens(a: Ordered, b: Ordered, *, assume_same_order: bool) -> None:
    """Refuse a comparison whose rows may not be the same tokens in the same order."""
    shared_geometry(a, b)
    if assume_same_order:
        return
    unknown = [s for s in (a, b) if s.order is None]
    if unknown:
        lines = "; ".join(f"{s.source}: {s.why_unknown}" for s in unknown)
        raise UsageError(
            f"cannot line the two sources up token for token: {lines}. Give the token order "
            f"(dump convert --order sequence|router --seq-len S --batch B, or the same flags of "
            f"dump diff for an array), or pass --assume-same-order if you know both list the same "
            f"tokens in the same order"
        )
