"""Recompute under router replay is matched to its forward by identity: every backward order, every checkpoint.

Legend: T = tokens, E = experts, K = top-k, H = hidden. The reference is a plain (never checkpointed)
router replaying the same routes with backward in forward order: its gradients are the right answer.
"""

from __future__ import annotations

import pytest
import torch
from test_router_replay import hidden, make_router, random_routes

from moeverify.errors import RouteError
from moeverify.patches import router_replay as rr

pytestmark = pytest.mark.usefixtures("patched_megatron_world")

MB = 3
RECOMPUTE = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)


def megatron_checkpoint(router, x):
    from megatron.core import tensor_parallel

    return tensor_parallel.checkpoint(lambda inp: router(inp)[0], False, x)


def torch_reentrant(router, x):
    from torch.utils.checkpoint import checkpoint

    return checkpoint(lambda inp: router(inp)[0], x, use_reentrant=True)


def torch_non_reentrant(router, x):
    from torch.utils.checkpoint import checkpoint

    return checkpoint(lambda inp: router(inp)[0], x, use_reentrant=False)


CHECKPOINTS = {
    "megatron": megatron_checkpoint,
    "torch_reentrant": torch_reentrant,
    "torch_non_reentrant": torch_non_reentrant,
}


def backward(losses, order: str) -> None:
    if order == "forward":
        for loss in losses:
            loss.backward()
    elif order == "reverse":
        for loss in reversed(losses):
            loss.backward()
    elif order == "summed":
        sum(losses).backward()
    elif order == "shuffled":
        for i in (1, 2, 0):
            losses[i].backward()
    else:
        raise AssertionError(order)


def reference_grad(routes, xs, seed, order="forward"):
    """Gradient of a never-checkpointed router replaying ``routes``, backward in the same order (same sums)."""
    plain = make_router(1, seed=seed)
    with rr.ReplaySession(plain).replay(routes):
        backward([plain(x)[0].square().sum() for x in xs], order)
    return plain.weight.grad


def inputs(seed: int):
    return [hidden(seed + i).requires_grad_() for i in range(MB)]


@pytest.mark.parametrize("kind", sorted(CHECKPOINTS))
@pytest.mark.parametrize("order", ["forward", "reverse", "summed", "shuffled"])
def test_recompute_gets_its_own_forward_routes_in_any_backward_order(kind, order):
    routes = random_routes([0], microbatches=MB, seed=11)
    expected = reference_grad(routes, inputs(30), seed=13, order=order)
    router = make_router(1, seed=13, **RECOMPUTE)
    session = rr.ReplaySession(router)
    with session.replay(routes):
        losses = [CHECKPOINTS[kind](router, x).square().sum() for x in inputs(30)]
        backward(losses, order)
    session.check_consumed()
    assert torch.equal(router.weight.grad, expected), (kind, order)


@pytest.mark.parametrize("kind", sorted(CHECKPOINTS))
def test_recompute_takes_its_forwards_slot_order_without_ordering_again(kind, monkeypatch):
    from moeverify.patches import replay_state

    calls = []
    real = replay_state.canonical_ids
    monkeypatch.setattr(replay_state, "canonical_ids", lambda *a, **k: calls.append(1) or real(*a, **k))
    routes = random_routes([0], microbatches=MB, seed=15)
    expected = reference_grad(routes, inputs(50), seed=16, order="reverse")
    calls.clear()
    router = make_router(1, seed=16, **RECOMPUTE)
    session = rr.ReplaySession(router)
    with session.replay(routes):
        backward([CHECKPOINTS[kind](router, x).square().sum() for x in inputs(50)], "reverse")
    session.check_consumed()
    assert len(calls) == MB  # one slot order per forward; each recompute reused its forward's
    assert torch.equal(router.weight.grad, expected), kind


def test_recompute_after_replay_context_exited_uses_forward_routes():
    routes = random_routes([0], microbatches=MB, seed=12)
    expected = reference_grad(routes, inputs(40), seed=14, order="reverse")
    router = make_router(1, seed=14, **RECOMPUTE)
    session = rr.ReplaySession(router)
    with session.replay(routes):
        losses = [megatron_checkpoint(router, x).square().sum() for x in inputs(40)]
    backward(losses, "reverse")  # outside the context: the router is held by nobody now
    session.check_consumed()
    assert torch.equal(router.weight.grad, expected)


def test_forward_only_pass_under_no_grad_in_train_mode_expects_no_recompute():
    # A log-prob pass with the model in train mode still goes through Megatron's checkpoint: its graph is
    # never built, so it must neither wait for a recompute nor shift the training pass's routes.
    routes = random_routes([0], microbatches=2 * MB, seed=15)
    train_routes = rr.Routes(
        {0: [routes.get(0, MB + i) for i in range(MB)]}, num_experts=routes.num_experts, topk=routes.topk
    )
    expected = reference_grad(train_routes, inputs(50), seed=16, order="summed")
    router = make_router(1, seed=16, **RECOMPUTE)
    assert router.training
    session = rr.ReplaySession(router)
    with session.replay(routes):
        with torch.no_grad():
            for x in inputs(50):
                megatron_checkpoint(router, x)
        losses = [megatron_checkpoint(router, x).square().sum() for x in inputs(50)]
        backward(losses, "summed")
    session.check_consumed()
    assert torch.equal(router.weight.grad, expected)


def test_gradient_accumulation_two_steps_reverse_order():
    routes = random_routes([0], microbatches=2 * MB, seed=17)
    plain = make_router(1, seed=18)
    with rr.ReplaySession(plain).replay(routes):
        for step in range(2):
            backward(
                [plain(hidden(60 + step * MB + i).requires_grad_())[0].square().sum() for i in range(MB)], "reverse"
            )
    router = make_router(1, seed=18, **RECOMPUTE)
    session = rr.ReplaySession(router)
    with session.replay(routes):
        for step in range(2):
            losses = [
                megatron_checkpoint(router, hidden(60 + step * MB + i).requires_grad_()).square().sum()
                for i in range(MB)
            ]
            backward(losses, "reverse")
    session.check_consumed()
    assert torch.equal(router.weight.grad, plain.weight.grad)


def test_recompute_by_unknown_mechanism_refused():
    router = make_router(1, seed=19)

    class Foreign(torch.autograd.Function):  # re-runs the router in backward, outside any known checkpoint
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(x)
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            (x,) = ctx.saved_tensors
            with torch.enable_grad():
                router(x.detach())
            return grad

    session = rr.ReplaySession(router)
    with session.replay(random_routes([0], microbatches=1)):
        x = hidden(70).requires_grad_()
        out = Foreign.apply(x)
        router(x)
        with pytest.raises(
            RouteError,
            match=r"layer 0 rank 0: a routing call inside backward is not the recompute of "
            r"any replayed forward \(1 of 1 forward micro-batch\(es\) used",
        ):
            out.sum().backward()


def test_recorded_forward_recomputes_natively_under_a_later_replay():
    router = make_router(1, seed=20, **RECOMPUTE)
    session = rr.ReplaySession(router)
    x = hidden(71).requires_grad_()
    with session.record():
        loss = megatron_checkpoint(router, x).square().sum()  # recorded with grad: backward comes later
    other = random_routes([0], microbatches=1, seed=21)
    plain = make_router(1, seed=20)
    plain(x)[0].square().sum().backward()
    with session.replay(other):
        loss.backward()  # recompute of the recorded (native) forward: native again, not the replayed routes
    assert torch.equal(router.weight.grad, plain.weight.grad)
