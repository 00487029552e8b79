"""A built model switched to a recompute mode or to Megatron's native ``RouterReplay`` (``oracles/replay/toggles.py``)
is what building it with that setting gives: every module's recompute flags and config settings, every router's
replay object; the switch is undone after, and refused where its version assumptions do not hold."""

from __future__ import annotations

import pytest
import torch

from moeverify import models
from moeverify.errors import EnvironmentProblem
from moeverify.oracles.replay import setup as st
from moeverify.oracles.replay import toggles
from moeverify.patches.routers import find_routers
from moeverify.spec.checks import RECOMPUTE_MODES
from moeverify.spec.layout import Layout
from moeverify.spec.models.ref import ModelRef

pytestmark = pytest.mark.usefixtures("patched_megatron_world")

FAMILIES = ["qwen3_moe", "deepseek_v3", "gpt_oss", "qwen3_next_mtp"]


def _build(family: str, **extra) -> list:
    return models.build(
        ModelRef.builtin(family), Layout(), seed=0, load_weights=False, overrides={**st._EXACT, **extra}
    ).model_chunks


def _recompute_state(chunks: list) -> dict:
    """Every recompute-named attribute of every module and config, by module name."""
    out = {}
    for c, chunk in enumerate(chunks):
        for name, module in chunk.named_modules():
            for attr, value in vars(module).items():
                if "recompute" in attr and isinstance(value, (bool, int, str, list, tuple, type(None))):
                    out[(c, name, attr)] = value
            config = getattr(module, "config", None)
            if hasattr(config, "recompute_granularity"):
                for attr in ("recompute_granularity", "recompute_method", "recompute_num_layers", "recompute_modules"):
                    out[(c, name, "config." + attr)] = getattr(config, attr)
    return out


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("mode", sorted(RECOMPUTE_MODES))
def test_a_toggled_recompute_mode_is_the_built_one(family, mode):
    built = _recompute_state(_build(family, **RECOMPUTE_MODES[mode]))
    chunks = _build(family)
    before = _recompute_state(chunks)
    with toggles.recompute(chunks, mode):
        toggled = _recompute_state(chunks)
    assert toggled.keys() == built.keys() and len(built) > 10
    assert {k: (toggled[k], built[k]) for k in built if toggled[k] != built[k]} == {}
    assert toggled != before  # the mode changed something
    assert _recompute_state(chunks) == before  # and is undone after
    with pytest.raises(EnvironmentProblem, match="built with recompute settings"):
        with toggles.recompute(_build(family, **RECOMPUTE_MODES[mode]), mode):
            pass


@pytest.mark.parametrize("family", FAMILIES)
def test_attached_native_replay_is_the_built_one_and_leaves_nothing_behind(family):
    from megatron.core.transformer.moe.router_replay import RouterReplay

    def replay_state(chunks):
        return {layer: (type(r.router_replay), vars(r.router_replay)) for layer, (_, r) in find_routers(chunks).items()}

    native = _build(family, moe_enable_routing_replay=True)
    want = replay_state(native)
    del native
    RouterReplay.global_router_replay_instances.clear()
    chunks = _build(family)
    with toggles.native_replay(chunks):
        got = replay_state(chunks)
        assert len(RouterReplay.global_router_replay_instances) == len(got)
    assert got == want and len(want) >= 1 and all(t is RouterReplay for t, _ in got.values())
    assert all(r.router_replay is None for _, r in find_routers(chunks).values())
    assert RouterReplay.global_router_replay_instances == []
    with toggles.native_replay(chunks), pytest.raises(EnvironmentProblem, match="have a router_replay object"):
        with toggles.native_replay(chunks):
            pass


def test_unknown_recompute_mode_is_refused():
    with pytest.raises(ValueError, match="unknown recompute mode 'layers'"):
        with toggles.recompute([torch.nn.Linear(1, 1)], "layers"):
            pass
