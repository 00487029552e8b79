import re

import pytest

from moeverify.errors import LayoutError
from moeverify.spec.layout import Layout, ModelShape, parse_layout_name

MOE = ModelShape(num_layers=4, num_heads=4, num_query_groups=2, num_experts=8, moe_layers=(0, 1, 2, 3))
DENSE = ModelShape(num_layers=4, num_heads=4, num_query_groups=2)
HYBRID = ModelShape(
    num_layers=4, num_heads=4, num_query_groups=2, num_experts=8, moe_layers=(0, 1, 2, 3), linear_heads=(2, 4)
)  # Qwen3-Next's tiny gated delta net: 2 key heads, 4 value heads


@pytest.mark.parametrize(
    "layout, world, shape, match",
    [
        (Layout(tp=2, pp=2), 6, DENSE, r"world_size 6 is not divisible by tp\*pp\*cp = 2\*2\*1 = 4"),
        (Layout(tp=8), 8, DENSE, r"num_attention_heads 4 is not divisible by tp 8"),
        (
            Layout(tp=4),
            4,
            ModelShape(num_layers=4, num_heads=4, num_query_groups=2),
            r"num_query_groups 2 is not divisible by tp 4",
        ),
        (Layout(pp=2, vpp=4), 2, DENSE, r"num_layers 4 is not divisible by pp\*vpp = 2\*4 = 8"),
        (Layout(pp=3), 3, DENSE, r"num_layers 4 is not divisible by pp\*vpp = 3\*1 = 3"),
        (Layout(ep=3), 3, MOE, r"num_experts 8 is not divisible by ep 3"),
        (Layout(tp=2), 2, MOE, r"MoE with tp 2 > 1 needs sp"),
        (Layout(ep=2), 2, DENSE, r"ep 2 > 1 needs an MoE model"),
        (Layout(etp=2), 2, DENSE, r"etp 2 set on a dense model"),
        (Layout(ep=4), 2, MOE, r"world_size 2 is not divisible by etp\*ep\*pp = 1\*4\*1 = 4"),
        (Layout(tp=2, sp=True, ep=2, pp=2), 4, MOE, r"world_size 4 is not divisible by etp\*ep\*pp = 2\*2\*2 = 8"),
        (Layout(tp=2, sp=True, cp=2), 4, HYBRID, r"linear attention's 2 key heads are not divisible by tp\*cp = 2\*2"),
        (Layout(cp=4), 4, HYBRID, r"linear attention's 2 key heads are not divisible by tp\*cp = 1\*4"),
    ],
)
def test_layout_validate_rejects_with_rule(layout, world, shape, match):
    with pytest.raises(LayoutError, match=match):
        layout.validate(world_size=world, shape=shape)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(pp=1, vpp=2), r"vpp 2 needs pp > 1"),
        (dict(sp=True), r"sp \(sequence parallel\) needs tp > 1"),
        (dict(tp=0), r"tp must be a positive integer, got 0"),
        (dict(ep="2"), r"ep must be a positive integer, got '2'"),
        (dict(etp=0), r"etp must be a positive integer or None, got 0"),
        (dict(pp_first=1), r"pp_first need pp > 1"),
        (dict(pp=2, pp_last=0), r"pp_last must be a positive integer or None, got 0"),
    ],
)
def test_layout_construct_rejects_invalid(kwargs, match):
    with pytest.raises(LayoutError, match=match):
        Layout(**kwargs)


@pytest.mark.parametrize(
    "layout, world, name",
    [
        (Layout(), 1, "tp1"),
        (Layout(tp=2, pp=2), 4, "tp2-pp2"),
        (Layout(pp=2, ep=2), 8, "pp2-ep2-dp4"),
        (Layout(ep=2), 2, "ep2-dp2"),
        (Layout(pp=2, vpp=2), 2, "pp2-vpp2"),
        (Layout(tp=2, pp=2, ep=2, sp=True), 8, "tp2-pp2-ep2-sp-dp2"),
        (Layout(etp=2), 2, "etp2-dp2"),
        (Layout(cp=2), 2, "cp2"),
        (Layout(pp=4, pp_first=1, pp_last=1, ep=2), 8, "pp4-ppfirst1-pplast1-ep2-dp2"),
        (Layout(pp=2, vpp=2, pp_last=2), 2, "pp2-pplast2-vpp2"),
        (Layout(tp=2, ep=2, etp=1, sp=True), 4, "tp2-ep2-etp1-sp-dp2"),  # not tp2-ep2-sp-dp2 (expert TP 2)
    ],
)
def test_layout_name_orders_dims_and_round_trips(layout, world, name):
    assert layout.name(world) == name
    parsed, dp = parse_layout_name(name)
    assert parsed == layout and dp == layout.dp(world)


def test_layout_valid_combinations_pass():
    for layout, world in [
        (Layout(tp=2, sp=True), 2),
        (Layout(ep=2), 4),
        (Layout(pp=2, vpp=2, ep=2), 4),
        (Layout(tp=2, pp=2, ep=2, sp=True), 8),
        (Layout(etp=2), 2),
        (Layout(cp=2), 2),
    ]:
        layout.validate(world_size=world, shape=MOE)
    assert Layout(ep=2).expert_dp(4) == 2 and Layout(etp=2).dp(2) == 2


def test_layout_from_mapping_rejects_unknown_key():
    with pytest.raises(LayoutError, match=r"scn: unknown layout key\(s\) \['pipeline'\]"):
        Layout.from_mapping({"pipeline": 2}, where="scn")


@pytest.mark.parametrize(
    "layout, layers, match",
    [
        (
            Layout(pp=3, pp_first=1),
            4,
            r"the 3 layer\(s\) between pp_first are not divisible by the 2 middle stage\(s\) x vpp 1",
        ),
        (Layout(pp=2, pp_first=1, pp_last=1), 4, r"leaves 2 layer\(s\) for 0 middle stage\(s\)"),
        (Layout(pp=2, pp_first=5), 4, r"num_layers 4 minus pp_first 5 leaves -1 layer"),
        (Layout(pp=2, vpp=2, pp_first=1), 4, r"pp_first 1 is not divisible by vpp 2"),
        (Layout(pp=3), 4, r"num_layers 4 is not divisible by pp\*vpp = 3\*1 = 3; pp_first/pp_last set an uneven split"),
    ],
)
def test_uneven_pipeline_refused_with_the_rule(layout, layers, match):
    with pytest.raises(LayoutError, match=match):
        layout.stage_layers(layers)


def _megatron_offset(layout: Layout, num_layers: int, pp_rank: int, vp_stage: int) -> int:
    """Megatron-Core's own layer offset of a model chunk (pure function of the config and the ranks)."""
    from types import SimpleNamespace

    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    from moeverify.runtime import bridge_import  # noqa: F401  (megatron.core imports without TE)

    config = SimpleNamespace(
        pipeline_model_parallel_size=layout.pp,
        pipeline_model_parallel_layout=None,
        num_layers=num_layers,
        num_layers_in_first_pipeline_stage=layout.pp_first,
        num_layers_in_last_pipeline_stage=layout.pp_last,
        virtual_pipeline_model_parallel_size=layout.vpp,
        account_for_embedding_in_pipeline_split=False,
        account_for_loss_in_pipeline_split=False,
    )
    return get_transformer_layer_offset(config, vp_stage=vp_stage if layout.vpp else None, pp_rank=pp_rank)


@pytest.mark.parametrize(
    "layout, layers",
    [
        (Layout(pp=2), 4),
        (Layout(pp=2, vpp=2), 8),
        (Layout(pp=2, pp_first=1), 4),
        (Layout(pp=2, pp_last=3), 4),
        (Layout(pp=3, pp_first=1, pp_last=1), 4),
        (Layout(pp=4, pp_first=2, pp_last=2), 8),
        (Layout(pp=2, vpp=2, pp_first=2), 6),
        (Layout(pp=3, vpp=2, pp_first=2, pp_last=4), 12),
        (Layout(pp=8, pp_first=11, pp_last=11), 94),  # a 94-layer model at PP8
        (Layout(pp=16, pp_first=4, pp_last=1), 61),  # a 61-layer model at PP16
    ],
)
def test_chunks_start_where_megatron_places_them_and_cover_every_layer_once(layout, layers):
    from moeverify.routing.views import chunk_layers

    seen = []
    for p in range(layout.pp):
        for c in range(layout.vpp_chunks):
            chunk = chunk_layers(layout, pp_rank=p, vp_stage=c, num_layers=layers)
            assert chunk.start == _megatron_offset(layout, layers, p, c), (p, c)
            seen += list(chunk)
    assert sorted(seen) == list(range(layers))


PP_LAYOUTS = [  # (pp, vpp, Megatron pipeline_model_parallel_layout, decoder layers)
    (2, None, "Et|tttL", 4),
    (2, None, "Ettt|tL", 4),
    (2, None, "E|ttttL", 4),
    (2, 2, "Et|t|t|tL", 4),
    (2, 2, "Ett|t|tt|tL", 6),
    (4, None, "Et*3|t*4|t*4|t*2L", 13),
    (4, 2, "E(tt|)*7tL", 15),
]


@pytest.mark.parametrize("pp, vpp, text, layers", PP_LAYOUTS)
def test_pp_layout_chunks_are_megatrons_and_cover_every_layer_once(monkeypatch, pp, vpp, text, layers):
    from megatron.core import parallel_state
    from megatron.core.transformer.enums import LayerType
    from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout

    from moeverify.routing.views import chunk_layers
    from moeverify.runtime import bridge_import  # noqa: F401  (megatron.core imports without TE)

    layout = Layout(pp=pp, vpp=vpp, pp_layout=text)
    theirs = PipelineParallelLayerLayout(text, pp)
    monkeypatch.setattr(parallel_state, "get_virtual_pipeline_model_parallel_world_size", lambda: vpp)
    seen = []
    for p in range(pp):
        for c in range(layout.vpp_chunks):
            chunk = chunk_layers(layout, pp_rank=p, vp_stage=c, num_layers=layers)
            assert list(chunk) == theirs.get_layer_id_list(layer_type=LayerType.decoder, vp_stage=c, pp_rank=p)
            seen += list(chunk)
    assert sorted(seen) == list(range(layers))
    assert layout.stage_layers(layers) == tuple(
        sum(len(chunk_layers(layout, pp_rank=p, vp_stage=c, num_layers=layers)) for c in range(layout.vpp_chunks))
        for p in range(pp)
    )


@pytest.mark.parametrize(
    "kwargs, layers, match",
    [
        (dict(pp=2, pp_layout="Et|tL"), 4, r"Number of decoder layers 2\s*must match num_layers 4"),
        (dict(pp=2, pp_layout="Et|tt|tL"), 3, r"must be divisible by pipeline_model_parallel_size"),
        (dict(pp=2, pp_layout="Ex|tL"), 2, r"Invalid layer character: x"),
        (dict(pp=1, pp_layout="EtL"), 1, r"pp_layout needs pp > 1"),
        (
            dict(pp=2, pp_layout="Et|t|t|tL"),
            4,
            r"holds 2 model chunk\(s\) per pipeline stage .* vpp says 1; set vpp: 2",
        ),
        (dict(pp=2, pp_layout="Et|tmL"), 2, r"MTP layers \('m'\) are not modelled"),
        (dict(pp=2, pp_layout="t|EtL"), 2, r"The first layer must be embedding"),
        (dict(pp=2, pp_layout="Et|tL", pp_first=1), 2, r"pp_layout places every layer itself; drop pp_first"),
        (dict(pp=2, pp_layout=""), 2, r"pp_layout must be a non-empty string"),
    ],
)
def test_pp_layout_refused_with_the_rule(kwargs, layers, match):
    with pytest.raises(LayoutError, match=match):
        Layout(**kwargs).stage_layers(layers)


def test_pp_layout_is_named_by_a_digest_and_not_parsed_back():
    layout = Layout(pp=2, pp_layout="Et|tttL")
    assert re.fullmatch(r"pp2-pplayout[0-9a-f]{8}", layout.name(2)) and layout.name(2) != Layout(pp=2).name(2)
    assert Layout(**layout.as_dict()) == layout and "pp_layout" not in Layout(pp=2).as_dict()
    with pytest.raises(LayoutError, match=r"a pp_layout cannot be read back from its name"):
        parse_layout_name(layout.name(2))


def test_as_dict_of_an_even_layout_keeps_the_key_set_older_dumps_hold():
    assert set(Layout(ep=2).as_dict()) == {"tp", "pp", "vpp", "ep", "etp", "cp", "sp"}
    uneven = Layout(pp=2, pp_first=1)
    assert uneven.as_dict()["pp_first"] == 1 and Layout(**uneven.as_dict()) == uneven


def test_layout_admits_linear_attention_heads_split_over_tp_or_cp():
    for layout, world in ((Layout(tp=2, sp=True), 2), (Layout(cp=2), 2), (Layout(ep=2), 2)):
        layout.validate(world_size=world, shape=HYBRID)
