"""``moeverify.patches.autopatch``: env-var parsing and a record -> replay round trip through a dump."""

from __future__ import annotations

import gc

import pytest
import torch

from moeverify.errors import RouteError, UsageError
from moeverify.patches import autopatch
from moeverify.patches import router_replay as rr
from moeverify.spec.layout import Layout

H, E, K, S, B = 16, 8, 2, 5, 2


@pytest.fixture(scope="module", autouse=True)
def megatron_world():
    from moeverify import runtime

    runtime.init("cpu")
    with runtime.parallel(Layout(), seed=0):
        try:
            yield
        finally:
            autopatch.uninstall()
            rr.revert()


@pytest.fixture(autouse=True)
def fresh_build_order():
    """Models are numbered by build order over live routers: free the routers of earlier tests."""
    gc.collect()
    yield
    autopatch.uninstall()


def make_router(layer: int, seed: int):
    from megatron.core.transformer.moe.moe_utils import get_default_pg_collection
    from megatron.core.transformer.moe.router import TopKRouter
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(
        num_layers=2,
        hidden_size=H,
        num_attention_heads=2,
        num_moe_experts=E,
        moe_router_topk=K,
        use_cpu_initialization=True,
        moe_aux_loss_coeff=0.0,
    )
    router = TopKRouter(config, pg_collection=get_default_pg_collection())
    with torch.no_grad():
        router.weight.normal_(0.0, 1.0, generator=torch.Generator().manual_seed(seed))
    router.set_layer_number(layer)
    return router


def ids_of(routing_map_TE):
    return routing_map_TE.nonzero()[:, 1].view(routing_map_TE.shape[0], -1)


@pytest.mark.parametrize("value", ["record", "replay:", "play:/tmp/x", "/tmp/x"])
def test_parse_bad_value_raises(value):
    with pytest.raises(UsageError, match=r"MOEVERIFY_ROUTER_REPLAY=.*: expected record:DIR or replay:DIR"):
        autopatch.parse(value)


def test_parse_record_and_replay():
    setting = autopatch.parse("replay:/data/run1", "1")
    assert (setting.mode, str(setting.directory), setting.model) == ("replay", "/data/run1", 1)


def test_parse_bad_model_index_raises():
    with pytest.raises(UsageError, match=r"MOEVERIFY_ROUTER_REPLAY_MODEL='actor': expected a model index"):
        autopatch.parse("record:/tmp/x", "actor")


def forward_steps(routers, steps, *, microbatches=2, seed=0, critic=False):
    """``steps`` optimizer steps of ``microbatches`` no-grad forwards; returns the ids of every call.

    ``critic``: a dense critic's optimizer steps after the actor's every iteration (a step with no routing)."""
    opt = torch.optim.SGD([p for r in routers for p in r.parameters()], lr=0.0)
    critic_opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(3))], lr=0.0) if critic else None
    seen = []
    for step in range(steps):
        for mb in range(microbatches):
            x = torch.randn(S, B, H, generator=torch.Generator().manual_seed(seed + 10 * step + mb))
            with torch.no_grad():
                seen.append([ids_of(r(x)[1]) for r in routers])
        opt.step()
        if critic_opt is not None:
            critic_opt.step()
    return seen


def test_autopatch_record_then_replay_follows_recording_per_step(tmp_path):
    autopatch.install(autopatch.Setting(mode="record", directory=tmp_path))
    try:
        routers = [make_router(1, seed=1), make_router(2, seed=2)]
        recorded = forward_steps(routers, 2)
        assert autopatch.session().finish() == []
    finally:
        autopatch.uninstall()
    from moeverify import record

    assert sorted(record.load(tmp_path).steps) == [0, 1]  # one dump step per optimizer step

    with torch.no_grad():
        for r in routers:
            r.weight.add_(torch.randn(E, H, generator=torch.Generator().manual_seed(9)) * 3)
    autopatch.install(autopatch.Setting(mode="replay", directory=tmp_path))
    try:
        replayed = forward_steps(routers, 2)
        assert autopatch.session().finish() == []
    finally:
        autopatch.uninstall()
    for got, want in zip(replayed, recorded, strict=True):
        for g, w in zip(got, want, strict=True):
            assert torch.equal(g, w)


def test_autopatch_replay_other_micro_batching_fails_at_the_step(tmp_path):
    autopatch.install(autopatch.Setting(mode="record", directory=tmp_path))
    try:
        routers = [make_router(1, seed=1)]
        forward_steps(routers, 2, microbatches=2)
        autopatch.session().finish()
    finally:
        autopatch.uninstall()
    autopatch.install(autopatch.Setting(mode="replay", directory=tmp_path))
    try:
        with pytest.raises(
            RouteError,
            match=r"rank 0 optimizer step 0: forwards replayed so far per layer \{0: 1\} != the "
            r"recording's 2 by the end of this step",
        ):
            forward_steps(routers, 2, microbatches=1)
    finally:
        autopatch.uninstall()


def test_autopatch_record_into_existing_dump_refused_before_start(tmp_path):
    (tmp_path / "rank00000").mkdir()
    with pytest.raises(UsageError, match=r"record directory .* already holds files"):
        autopatch.install(autopatch.Setting(mode="record", directory=tmp_path))
    assert autopatch.session() is None


def test_autopatch_replay_without_dump_refused_before_start(tmp_path):
    with pytest.raises(UsageError, match=r"holds no routing dump \(expected .*manifest.json from a record:"):
        autopatch.install(autopatch.Setting(mode="replay", directory=tmp_path))


def test_autopatch_second_model_without_selection_refused(tmp_path):
    autopatch.install(autopatch.Setting(mode="record", directory=tmp_path))
    try:
        _reference, actor = make_router(1, seed=4), make_router(1, seed=3)  # two models built
        x = torch.randn(S, B, H)
        with torch.no_grad():
            with pytest.raises(
                UsageError,
                match=r"2 MoE models are built in this process \(model 0: layers \[0\]; "
                r"model 1: layers \[0\]\); set MOEVERIFY_ROUTER_REPLAY_MODEL=N",
            ):
                actor(x)
    finally:
        autopatch.uninstall()


def test_autopatch_selected_model_by_build_order_not_call_order(tmp_path):
    autopatch.install(autopatch.Setting(mode="record", directory=tmp_path, model=1))
    try:
        reference, actor = make_router(1, seed=4), make_router(1, seed=3)  # actor built second: model 1
        x = torch.randn(S, B, H)
        expected_ref = ids_of(reference(x)[1])
        with torch.no_grad():
            got_ref = ids_of(reference(x)[1])  # the reference runs first: still native, not bound
            actor_ids = ids_of(actor(x)[1])
        assert torch.equal(got_ref, expected_ref)
        assert autopatch.session().routes().microbatches == 1
        assert torch.equal(autopatch.session().routes().get(0, 0).sort(dim=1).values, actor_ids)
    finally:
        autopatch.uninstall()


def test_autopatch_router_built_before_install_refused(tmp_path):
    early = make_router(1, seed=5)
    autopatch.install(autopatch.Setting(mode="record", directory=tmp_path))
    try:
        with pytest.raises(UsageError, match=r"a TopKRouter \(layer 0\) was built before moeverify.patches.autopatch"):
            with torch.no_grad():
                early(torch.randn(S, B, H))
    finally:
        autopatch.uninstall()


def test_autopatch_a_dense_critics_optimizer_steps_record_nothing_and_replay_alike(tmp_path):
    autopatch.install(autopatch.Setting(mode="record", directory=tmp_path))
    try:
        routers = [make_router(1, seed=1)]
        recorded = forward_steps(routers, 3, critic=True)
        assert autopatch.session().finish() == []
    finally:
        autopatch.uninstall()
    from moeverify import record

    assert sorted(record.load(tmp_path).steps) == [0, 2, 4]  # the actor's optimizer steps; the critic's add none
    with torch.no_grad():
        routers[0].weight.add_(torch.randn(E, H, generator=torch.Generator().manual_seed(9)) * 3)
    autopatch.install(autopatch.Setting(mode="replay", directory=tmp_path))
    try:
        replayed = forward_steps(routers, 3, critic=True)
        assert autopatch.session().finish() == []
    finally:
        autopatch.uninstall()
    assert (
        recorded
        and [i for i, (g, w) in enumerate(zip(replayed, recorded, strict=True)) if not torch.equal(g[0], w[0])] == []
    )
    autopatch.install(autopatch.Setting(mode="replay", directory=tmp_path))
    try:  # without the critic the optimizer steps no longer line up: refused at the step, not later
        with pytest.raises(
            RouteError,
            match=r"optimizer step 1: forwards replayed so far per layer \{0: 4\} != "
            r"the recording's 2",
        ):
            forward_steps(routers, 3, critic=False)
    finally:
        autopatch.uninstall()


def test_autopatch_agreement_guard_from_the_environment_fails_the_step_below_its_minimum(tmp_path, monkeypatch):
    from moeverify.patches import agreement

    autopatch.install(autopatch.Setting(mode="record", directory=tmp_path / "dump"))
    try:
        routers = [make_router(1, seed=1), make_router(2, seed=2)]
        forward_steps(routers, 1)
        assert autopatch.session().finish() == []
    finally:
        autopatch.uninstall()
    with torch.no_grad():
        for r in routers:  # the replayed job's routers now route otherwise for most tokens
            r.weight.add_(torch.randn(E, H, generator=torch.Generator().manual_seed(9)) * 3)
    monkeypatch.setenv(agreement.ENV, str(tmp_path / "agreement.jsonl"))
    monkeypatch.setenv(agreement.MIN_ENV, "0.999")
    autopatch.install(autopatch.Setting(mode="replay", directory=tmp_path / "dump"))
    try:
        assert agreement.ACTIVE is not None
        with pytest.raises(
            RouteError,
            match=r"agreement guard: step 1 replay pass layer \d rank 0: .* expected at least "
            r"99.9000%",
        ):
            forward_steps(routers, 1)
    finally:
        autopatch.uninstall()
    assert agreement.ACTIVE is None  # ended with the session
    rows = [line for line in (tmp_path / "agreement.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and all('"step": 1' in row for row in rows), rows
