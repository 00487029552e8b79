"""``record.save``: write routes as one step of a dump (created, or appended to) and finalise it.

The Python API's one-call writer over ``RankWriter`` and ``finalize``; ``moeverify.record`` re-exports it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch

from moeverify.errors import DumpError, UsageError
from moeverify.record.commit import finalize
from moeverify.record.format import MANIFEST, ModelInfo
from moeverify.record.order import ORDERS, to_router_order
from moeverify.record.reader import load
from moeverify.record.writer import RankWriter
from moeverify.routing.routes import Routes
from moeverify.routing.views import RankCoords
from moeverify.spec.layout import Layout


def save(
    path: str | os.PathLike,
    routes: Routes,
    *,
    step: int = 0,
    num_layers: int | None = None,
    moe_layers: Sequence[int] | None = None,
    seq_len: int | Sequence[int] | None = None,
    batch: int | None = None,
    order: str | None = None,
    probs: Mapping[int, Sequence[torch.Tensor]] | None = None,
    coords: RankCoords | None = None,
    layout: Layout | None = None,
    world_size: int = 1,
    zigzag: bool = True,
) -> Path:
    """Write ``routes`` as step ``step`` of the dump at ``path`` (created, or appended to) and finalise it.

    Args:
        routes: global routes (one process), or this rank's local routes with ``coords``/``layout``.
        num_layers, moe_layers: model shape; default: the layers ``routes`` hold (last one + 1 layers).
        seq_len, batch: micro-batch geometry; needed to merge more than one rank.
        order: the token order of ``routes``, required with ``seq_len`` and ``batch`` > 1 (the two orders differ
            then, and a wrong guess reads back as other tokens): ``"router"`` (Megatron's ``s * B + b``:
            ``session.routes()``, a rank's ``RouteRecorder`` routes, ``Routes.to_local``) or ``"sequence"``
            (``b * S + s``: ``Dump.routes()``, rollout engines; one process's global routes only).
        probs: optional ``{layer: [probs_TK per micro-batch]}`` router probabilities.

    With ``world_size > 1`` every rank calls ``save``; under an initialised torch.distributed group of
    ``world_size`` ranks, rank 0 then writes the manifest after a barrier; otherwise (no group, or one of
    another size: records of several ranks saved from one process) the caller runs ``finalize(path)``
    once all ranks have saved.
    """
    path = Path(path)
    routes = _router_order(routes, seq_len=seq_len, batch=batch, order=order, world_size=world_size)
    default_layers = max(routes.layers) + 1 if routes.layers else 1
    model = ModelInfo(
        num_layers=num_layers if num_layers is not None else default_layers,
        moe_layers=tuple(moe_layers if moe_layers is not None else routes.layers),
        num_experts=routes.num_experts,
        topk=routes.topk,
    )
    if (path / MANIFEST).exists() and step in load(path).steps:
        raise DumpError(f"{path}: step {step} is already in the dump; pick another step or another path")
    with RankWriter(
        path,
        model=model,
        coords=coords,
        layout=layout,
        world_size=world_size,
        zigzag=zigzag,
        background=False,
        append=True,
    ) as writer:
        writer.add_routes(routes, step=step, seq_len=seq_len, batch=batch, probs=probs)
    if world_size > 1 and _group_is_the_dump(world_size):
        torch.distributed.barrier()
        if torch.distributed.get_rank() == 0:
            finalize(path, world_size=world_size)
        torch.distributed.barrier()
    elif world_size == 1:
        finalize(path, world_size=1)
    return path


def _group_is_the_dump(world_size: int) -> bool:
    """Whether the initialised torch.distributed group is the dump's ranks (then ``save`` finalises collectively)."""
    dist = torch.distributed
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() == world_size


def _router_order(routes: Routes, *, seq_len, batch: int | None, order: str | None, world_size: int) -> Routes:
    """``routes`` in the router order a dump stores, from the order the caller states (never a guess)."""
    if order is not None and order not in ORDERS:
        raise UsageError(f"save: order {order!r} is not one of {', '.join(ORDERS)}")
    if seq_len is None or batch is None:
        if order is not None:
            raise UsageError(f"save: order={order!r} needs seq_len and batch (the geometry that maps the order)")
        return routes
    if order is None:
        if batch == 1:
            return routes  # one sequence per micro-batch: both orders list the same tokens
        raise UsageError(
            f"save: with seq_len and batch {batch} say which order the routes are in: order='router' "
            "(s * B + b: session.routes(), RouteRecorder, Routes.to_local) or order='sequence' (b * S + s: "
            "Dump.routes(), rollout engines); the dump stores router order"
        )
    if world_size == 1:
        _check_tokens(routes, seq_len=seq_len, batch=batch)
    if order == "router":
        return routes
    if world_size > 1:
        raise UsageError(
            "save: order='sequence' is for one process's global routes; a rank of a multi-rank job saves "
            "its local routes, which are in router order (order='router')"
        )
    return to_router_order(routes, seq_len=seq_len, batch=batch, where="save")


def _check_tokens(routes: Routes, *, seq_len, batch: int) -> None:
    lens = [seq_len] * routes.microbatches if isinstance(seq_len, int) else list(seq_len)
    if len(lens) != routes.microbatches:
        raise UsageError(f"save: {len(lens)} seq_len value(s) for {routes.microbatches} micro-batch(es)")
    for layer in routes.layers:
        for mb, length in enumerate(lens):
            if routes.get(layer, mb).shape[0] != length * batch:
                raise UsageError(
                    f"save: layer {layer} micro-batch {mb}: {routes.get(layer, mb).shape[0]} tokens != "
                    f"seq_len {length} x batch {batch} = {length * batch}"
                )
