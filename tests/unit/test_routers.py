"""The one router finder (``moeverify.patches.routers``): which routers a model has and each one's global layer.

The reference is Megatron-Core's own numbering: a real GPT model with an MTP block, whose MTP router has
``layer_number`` 1 (its MTP depth) and ``is_mtp_layer`` set, must come out after the decoder's layers.
The patch, the recorder and the replay oracles all use this finder, so they agree on it.
"""

from __future__ import annotations

import pytest
import torch
from test_router_replay import make_router

from moeverify.errors import UsageError
from moeverify.patches import router_replay as rr
from moeverify.patches.routers import find_routers, global_layer

pytestmark = pytest.mark.usefixtures("patched_megatron_world")


@pytest.fixture(scope="module")
def gpt_with_mtp(patched_megatron_world):
    """A tiny Megatron GPTModel: 2 MoE decoder layers and 1 MoE MTP layer (local spec, CPU)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec, get_gpt_mtp_block_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(
        num_layers=2,
        hidden_size=16,
        num_attention_heads=2,
        num_moe_experts=4,
        moe_router_topk=2,
        use_cpu_initialization=True,
        add_bias_linear=False,
        mtp_num_layers=1,
        moe_aux_loss_coeff=0.0,
    )
    spec = get_gpt_layer_local_spec(num_experts=4)
    mtp = get_gpt_mtp_block_spec(config, spec, use_transformer_engine=False)
    return GPTModel(
        config=config, transformer_layer_spec=spec, vocab_size=32, max_sequence_length=8, mtp_block_spec=mtp
    )


def test_find_routers_mtp_router_after_decoder_layers(gpt_with_mtp):
    found = find_routers([gpt_with_mtp])
    assert sorted(found) == [0, 1, 2]
    mtp_router = found[2][1]
    assert mtp_router.is_mtp_layer and mtp_router.layer_number == 1  # Megatron numbers it by MTP depth
    assert any(m is mtp_router for m in gpt_with_mtp.mtp.modules())
    assert {layer: (found[layer][1].is_mtp_layer, found[layer][1].layer_number) for layer in (0, 1)} == {
        0: (False, 1),
        1: (False, 2),
    }


def test_find_routers_patch_and_recorder_see_the_same_layers(gpt_with_mtp):
    from moeverify.patches.recorder import RouteRecorder

    assert rr.ReplaySession(gpt_with_mtp).layers == (0, 1, 2)
    with RouteRecorder([gpt_with_mtp], writer=None) as recorder:
        assert recorder.layers_hooked == 3


def test_find_routers_vpp_chunks_keep_chunk_index():
    chunk0 = torch.nn.ModuleList([make_router(1), make_router(3)])
    chunk1 = torch.nn.ModuleList([make_router(2), make_router(4)])
    found = find_routers([chunk0, chunk1])
    assert {layer: c for layer, (c, _) in found.items()} == {0: 0, 2: 0, 1: 1, 3: 1}


def test_find_routers_router_reached_twice_counted_once():
    router = make_router(2)
    found = find_routers([torch.nn.ModuleList([router]), torch.nn.ModuleList([router])])
    assert list(found) == [1] and found[1] == (0, router)


def test_find_routers_one_module_or_empty_list():
    router = make_router(1)
    assert find_routers(router) == {0: (0, router)}
    assert find_routers([]) == {}


def test_find_routers_mtp_never_collides_with_the_last_decoder_layer():
    found = find_routers([make_router(4), make_router(1, mtp=True)])  # num_layers=4
    assert sorted(found) == [3, 4]


def test_find_routers_duplicate_global_layer_refused():
    with pytest.raises(UsageError, match="two routers claim global layer 3; pass the chunks of one model only"):
        find_routers([make_router(4), make_router(4)])


def test_global_layer_without_layer_number_refused():
    router = make_router(1)
    router.layer_number = None
    with pytest.raises(UsageError, match="has no layer_number"):
        global_layer(router)
