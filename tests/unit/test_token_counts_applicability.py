"""When the replay subcheck ``token_counts`` applies (expert bias, aux loss or z-loss), and how a subcheck that does
not apply is reported: with its reason, never failed, never counted as the only thing a check passed on. Whether an
aux loss applies is decided as megatron-core's own ``TopKRouter`` decides it (held to it here)."""

from __future__ import annotations

import types

import pytest

from moeverify.oracles.replay.token_counts import not_applicable
from moeverify.oracles.results import CheckRecord, Tally


def config(*, bias=False, aux=0.0, z=None, balancing="aux_loss"):
    """The attributes of a megatron ``TransformerConfig`` the decision reads (``TransformerConfig``'s defaults)."""
    return types.SimpleNamespace(
        moe_router_enable_expert_bias=bias,
        moe_aux_loss_coeff=aux,
        moe_z_loss_coeff=z,
        moe_router_load_balancing_type=balancing,
    )


@pytest.mark.parametrize(
    "traits_bias, cfg",
    [
        (True, config(bias=True)),  # expert bias alone (DeepSeek-V3's aux-loss-free routing)
        (False, config(aux=0.001)),  # aux loss alone
        (False, config(aux=[0.0, 0.01], balancing=["aux_loss", "seq_aux_loss"])),  # one of several aux-loss types
        (False, config(aux=0.01, balancing="global_aux_loss")),  # Qwen3-Next's
        (False, config(z=1e-3)),  # z-loss alone
    ],
)
def test_token_counts_applies_with_any_of_bias_aux_z(traits_bias, cfg):
    assert not_applicable(expert_bias=traits_bias, config=cfg) is None


@pytest.mark.parametrize(
    "traits_bias, cfg",
    [
        (False, config()),  # DeepSeek-V2's tiny model
        (False, config(aux=[0.0, 0.0], z=0.0, balancing=["aux_loss", "seq_aux_loss"])),
        (False, config(aux=0.001, balancing="none")),  # GPT-OSS's bridge: a coefficient beside no aux-loss type
        (False, config(aux=[0.01, 0.0], balancing=["none", "aux_loss"])),  # the coefficient > 0 is the "none" one's
        (True, config(bias=False)),  # a router variant that switched the model's bias off
        (False, config(bias=True)),  # the traits say the checkpoint has no bias to count with
    ],
)
def test_token_counts_not_applicable_names_what_is_missing(traits_bias, cfg):
    why = not_applicable(expert_bias=traits_bias, config=cfg)
    assert "no expert bias" in why and "no aux loss (moe_aux_loss_coeff" in why and "no z-loss" in why
    assert f"moe_router_load_balancing_type {cfg.moe_router_load_balancing_type!r}" in why


BALANCING = [
    ("aux_loss", 0.001),
    ("seq_aux_loss", 0.01),
    ("global_aux_loss", 0.001),
    ("none", 0.001),
    ("sinkhorn", 0.0),
    ("aux_loss", 0.0),
    (["aux_loss", "seq_aux_loss"], [0.0, 0.01]),
    (["none", "aux_loss"], [0.01, 0.0]),
    (["seq_aux_loss", "global_aux_loss"], [0.0, 0.0]),
    (["aux_loss", "aux_loss"], [0.0, 0.5]),
]


@pytest.mark.parametrize("balancing, coeff", BALANCING)
def test_aux_loss_applies_exactly_where_megatron_core_applies_one(balancing, coeff):
    """The rule against megatron-core's own ``TopKRouter.get_aux_loss_coeff`` / ``is_aux_loss_enabled``, run on the
    same settings: per type, the coefficient Megatron applies, and whether any aux loss is on."""
    import functools

    from megatron.core.transformer.moe.router import TopKRouter

    from moeverify.oracles.replay.token_counts import AUX_LOSS_TYPES, aux_loss_coeffs

    cfg = config(aux=coeff, balancing=balancing)
    router = types.SimpleNamespace(routing_type=balancing, config=cfg)
    router.get_aux_loss_coeff = functools.partial(TopKRouter.get_aux_loss_coeff, router)
    megatron = {kind: c for kind in AUX_LOSS_TYPES if (c := router.get_aux_loss_coeff(kind)) > 0}
    assert aux_loss_coeffs(cfg) == megatron
    assert bool(aux_loss_coeffs(cfg)) == TopKRouter.is_aux_loss_enabled(router)
    assert (not_applicable(expert_bias=False, config=cfg) is None) == TopKRouter.is_aux_loss_enabled(router)


def test_not_applicable_subcheck_reported_with_reason_and_not_counted_as_a_pass():
    na = Tally()
    na.skip("no expert bias")
    assert na.passed and na.as_dict()["not_applicable"] == "no expert bias"
    empty = Tally()
    assert not empty.passed and empty.as_dict()["failures"]  # checked 0 without a reason still fails
    alone = CheckRecord.from_tallies(scenario="s", check="replay", seconds=0.0, tallies={"token_counts": na})
    assert not alone.passed  # a check where nothing applied proves nothing
    ok = Tally()
    ok.ok()
    both = CheckRecord.from_tallies(scenario="s", check="replay", seconds=0.0, tallies={"token_counts": na, "x": ok})
    assert both.passed
    bad = Tally()
    bad.fail("wrong")
    assert not CheckRecord.from_tallies(
        scenario="s", check="replay", seconds=0.0, tallies={"token_counts": na, "x": bad}
    ).passed


def test_a_subcheck_that_counted_items_cannot_be_marked_not_applicable():
    t = Tally()
    t.ok()
    with pytest.raises(RuntimeError, match="checked 1 item"):
        t.skip("late")


def test_replay_report_marks_a_subcheck_not_applicable_only_where_no_variant_checked_it(tmp_path):
    """The oracle's merge over router variants (1 rank): not applicable to every variant -> reported so, with each
    variant's reason; applicable to one variant -> that variant's items count and no reason is shown."""
    import json

    from moeverify.oracles.replay import oracle
    from moeverify.routing import views
    from moeverify.spec.checks import ReplayOptions
    from moeverify.spec.layout import Layout
    from moeverify.spec.router_variants import VARIANTS

    ctx = types.SimpleNamespace(rank=0, world_size=1, scenario=types.SimpleNamespace(name="s"))
    opts = ReplayOptions(
        impl="moeverify",
        variants=(VARIANTS["default"],),
        subchecks=("token_counts", "weights"),
        notes_path=str(tmp_path / "notes.json"),
    )
    coords = views.rank_coords(Layout(), rank=0, world_size=1)

    def tallies(*, checked_in_padding: bool):
        out = {}
        for variant in ("default", "padding"):
            tc, w = Tally(), Tally()
            w.ok(3)
            if variant == "padding" and checked_in_padding:
                tc.ok(4)
            else:
                tc.skip(f"no bias in {variant}")
            out[variant] = {"token_counts": tc, "weights": w}
        return out

    total = oracle._report(ctx, opts, coords, tallies(checked_in_padding=False), {"default": {}, "padding": {}}, {})
    assert total["token_counts"].as_dict() == {
        "passed": True,
        "checked": 0,
        "failures": [],
        "not_applicable": "[default] no bias in default; [padding] no bias in padding",
    }
    notes = json.loads((tmp_path / "notes.json").read_text())
    assert notes["variants"]["default"]["subchecks"]["token_counts"]["not_applicable"] == "no bias in default"
    total = oracle._report(ctx, opts, coords, tallies(checked_in_padding=True), {"default": {}, "padding": {}}, {})
    assert total["token_counts"].as_dict() == {"passed": True, "checked": 4, "failures": []}
