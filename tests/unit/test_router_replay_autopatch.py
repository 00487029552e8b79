"""``moeverify.patches.autopatch``: env-var parsing and a record -> replay round trip through a dump."""

from __future__ import annotations

import pytest
import torch

from moeverify.errors import UsageError
from moeverify.layout import Layout
from moeverify.patches import autopatch
from moeverify.patches import router_replay as rr

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


def make_router(layer: int, seed: int):
    from megatron.core.transformer.moe.moe_utils import get_default_pg_collection
    from megatron.core.transformer.moe.router import TopKRouter
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(num_layers=2, hidden_size=H, num_attention_heads=2, num_moe_experts=E,
                               moe_router_topk=K, use_cpu_initialization=True, moe_aux_loss_coeff=0.0)
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
    setting = autopatch.parse("replay:/data/run1")
    assert (setting.mode, str(setting.rank_dir(3))) == ("replay", "/data/run1/rank00003")


def test_autopatch_record_then_replay_follows_recording(tmp_path):
    routers = [make_router(1, seed=1), make_router(2, seed=2)]
    xs = [torch.randn(S, B, H, generator=torch.Generator().manual_seed(i)) for i in range(2)]
    autopatch.install(autopatch.Setting(mode="record", directory=tmp_path))
    with torch.no_grad():
        recorded = [[ids_of(r(x)[1]) for r in routers] for x in xs]
    autopatch.session().finish()
    autopatch.uninstall()
    assert (tmp_path / "rank00000" / "manifest.json").exists()

    with torch.no_grad():
        for r in routers:
            r.weight.add_(torch.randn(E, H, generator=torch.Generator().manual_seed(9)) * 3)
    replaying = autopatch.install(autopatch.Setting(mode="replay", directory=tmp_path))
    try:
        replayed = [[ids_of(r(x)[1]) for r in routers] for x in xs]
        assert replaying._state.problems() == []
    finally:
        autopatch.uninstall()
    for got, want in zip(replayed, recorded):
        for g, w in zip(got, want):
            assert torch.equal(g, w)


def test_autopatch_second_model_same_layer_left_native(tmp_path):
    actor, reference = make_router(1, seed=3), make_router(1, seed=4)
    x = torch.randn(S, B, H)
    expected = reference(x)[1]
    autopatch.install(autopatch.Setting(mode="record", directory=tmp_path))
    try:
        with torch.no_grad():
            actor(x)
            with pytest.warns(UserWarning, match="a second router claims layer 0"):
                got = reference(x)[1]
        assert torch.equal(got, expected)
        assert autopatch.session().routes().microbatches == 1
    finally:
        autopatch.uninstall()
