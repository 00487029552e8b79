"""The live agreement guard (``moeverify.patches.agreement``) on real megatron-core TopKRouters (1-rank gloo, CPU).

The expected agreement is decided independently: each router's own native forward (no session, no guard) gives
its routing map, and the share of tokens whose replayed id set equals that map's is counted here by hand.
Legend: S = positions, B = sequences, T = tokens, E = experts, K = top-k, H = hidden.
"""

from __future__ import annotations

import json

import pytest
import torch
from seeded_router import seeded_router

from moeverify.errors import RouteError, UsageError
from moeverify.patches import agreement
from moeverify.patches import router_replay as rr
from moeverify.routing.routes import Routes

H, E, K, S, B = 16, 8, 2, 6, 2
T = S * B

pytestmark = pytest.mark.usefixtures("patched_megatron_world")


def make_router(layer: int, seed: int, **overrides):
    return seeded_router(hidden=H, experts=E, topk=K, seed=seed, layer=layer, num_layers=4, **overrides)


def hidden(seed: int) -> torch.Tensor:
    return torch.randn(S, B, H, generator=torch.Generator().manual_seed(100 + seed))


def native_ids(router, x) -> torch.Tensor:
    _, map_TE = router(x)  # no session: megatron-core's own routing
    return map_TE.nonzero()[:, 1].view(-1, K)


def share_equal(a_TK, b_TK) -> float:
    return (a_TK.sort(dim=1).values == b_TK.sort(dim=1).values).all(dim=1).double().mean().item()


@pytest.fixture
def guard_path(tmp_path):
    yield tmp_path / "agreement.jsonl"
    agreement.stop()


@pytest.fixture(params=["softmax", "sigmoid_bias"])
def routers(request):
    extra = (
        {}
        if request.param == "softmax"
        else dict(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True)
    )
    return [make_router(layer, seed=layer, **extra) for layer in (1, 3)]


def _replay_step(routers, per_layer, x, optimizer):
    session = rr.ReplaySession(routers)
    with session.replay(Routes(per_layer, num_experts=E, topk=K)):
        loss = sum(router(x)[0].sum() for router in routers)
    loss.backward()
    session.check_consumed()
    optimizer.step()
    optimizer.zero_grad()


def test_native_routes_agree_fully_and_one_line_per_layer_per_optimizer_step(routers, guard_path):
    x = [hidden(0), hidden(1)]
    optimizer = torch.optim.SGD([p for r in routers for p in r.parameters()], lr=0.0)  # weights unchanged
    guard = agreement.guard(path=guard_path)
    for step in range(2):
        per_layer = {r.layer_number - 1: [native_ids(r, x[step])] for r in routers}
        _replay_step(routers, per_layer, x[step], optimizer)
    rows = [json.loads(line) for line in guard_path.read_text().splitlines()]
    assert [(r["step"], r["layer"]) for r in rows] == [(1, 0), (1, 2), (2, 0), (2, 2)]
    assert [(r["agreement"], r["tokens"], r["rank"]) for r in rows] == [(1.0, T, 0)] * 4, rows
    assert guard.step == 2 and guard.history == rows


def test_perturbed_routes_give_the_share_counted_by_hand_and_the_minimum_fails_the_step(routers, guard_path):
    x = hidden(2)
    g = torch.Generator().manual_seed(5)
    per_layer, expected = {}, {}
    for r in routers:
        native = native_ids(r, x)
        other = torch.rand(T, E, generator=g).argsort(dim=1)[:, :K]
        keep_T = torch.rand(T, generator=g) < 0.5  # about half the tokens keep native's route
        ids = torch.where(keep_T[:, None], native, other)
        per_layer[r.layer_number - 1], expected[r.layer_number - 1] = [ids], share_equal(ids, native)
    assert min(expected.values()) < 1.0
    optimizer = torch.optim.SGD([p for r in routers for p in r.parameters()], lr=0.0)
    agreement.guard(path=guard_path, minimum=0.999)
    with pytest.raises(RouteError) as err:
        _replay_step(routers, per_layer, x, optimizer)
    worst = min(expected, key=expected.get)
    assert (
        f"agreement guard: step 1 replay pass layer {worst} rank 0: agreement (top-k set equal to native "
        f"routing's) {expected[worst]:.4%} over {T} replayed tokens"
    ) in str(err.value)
    assert "expected at least 99.9000% (MOEVERIFY_AGREEMENT_MIN)" in str(err.value)
    rows = {r["layer"]: r["agreement"] for r in map(json.loads, guard_path.read_text().splitlines())}
    assert rows == pytest.approx(expected, abs=0), rows  # written before the step fails


def test_record_and_native_calls_are_not_counted_and_a_logger_gets_one_scalar_per_layer(routers, guard_path):
    class Writer:  # the add_scalar protocol of TensorBoard's SummaryWriter
        def __init__(self):
            self.scalars = []

        def add_scalar(self, tag, value, step):
            self.scalars.append((tag, value, step))

    x, writer = hidden(3), Writer()
    guard = agreement.guard(writer=writer)
    session = rr.ReplaySession(routers)
    with session.record():
        for r in routers:
            r(x)
    for r in routers:
        r(x)  # native
    assert guard.end_step() == {}  # nothing replayed: no step
    with session.replay(session.routes()):
        for r in routers:
            r(x)
    session.check_consumed()
    assert guard.end_step() == {0: 1.0, 2: 1.0}
    assert writer.scalars == [("moeverify/agreement/layer0", 1.0, 1), ("moeverify/agreement/layer2", 1.0, 1)]


def test_off_by_default_and_settings_refused(monkeypatch, tmp_path):
    assert agreement.ACTIVE is None
    monkeypatch.delenv(agreement.ENV, raising=False)
    monkeypatch.delenv(agreement.MIN_ENV, raising=False)
    assert agreement.from_env() is None
    monkeypatch.setenv(agreement.MIN_ENV, "0.99")
    with pytest.raises(UsageError, match=r"MOEVERIFY_AGREEMENT_MIN=0.99 needs MOEVERIFY_AGREEMENT=PATH.jsonl"):
        agreement.from_env()
    monkeypatch.setenv(agreement.ENV, str(tmp_path / "a.jsonl"))
    for bad in ("1.5", "x", "-0.1"):
        monkeypatch.setenv(agreement.MIN_ENV, bad)
        with pytest.raises(UsageError, match=r"expected a share in \[0, 1\]"):
            agreement.from_env()
    assert agreement.ACTIVE is None
    monkeypatch.setenv(agreement.MIN_ENV, "0.5")
    try:
        assert agreement.from_env().minimum == 0.5
        with pytest.raises(UsageError, match="already active"):
            agreement.guard()
    finally:
        agreement.stop()
    assert agreement.ACTIVE is None
