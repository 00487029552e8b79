"""Unit tests of the replay oracles' plain-tensor helpers (no Megatron, no torchrun)."""

import math

import pytest
import torch

from moeverify.errors import UsageError
from moeverify.oracles.replay import compare as cmp
from moeverify.oracles.replay import pass_checks as rc
from moeverify.oracles.replay.drive import Batches, PassResult, local_microbatches
from moeverify.oracles.results import Tally
from moeverify.routing.routes import Routes
from moeverify.spec.layout import Layout
from moeverify.spec.router_variants import DEFAULT_VARIANTS, VARIANTS, select


def _pass(routing=None, recompute=None, logits=None, seq_loss=None, grads=None) -> PassResult:
    return PassResult(
        routing=routing or {},
        recompute=recompute or {},
        logits=logits or {},
        seq_loss=seq_loss or {},
        grads=grads or {},
    )


def _ids(rows):
    return torch.tensor(rows, dtype=torch.int64)


def test_describe_mismatch_one_ulp():
    a = torch.tensor([1.0])
    b = torch.nextafter(a, torch.tensor([2.0]))
    assert "1 of 1 element(s) differ" in cmp.describe_mismatch(a, b)


def test_describe_mismatch_shape():
    assert cmp.describe_mismatch(torch.zeros(2), torch.zeros(3)) == "shape (2,) != (3,)"


def test_compare_maps_missing_and_extra_keys():
    checked, failures = cmp.compare_maps(
        {"a": torch.ones(1), "b": torch.ones(1)}, {"a": torch.ones(1), "c": torch.ones(1)}, what="grad"
    )
    assert checked == 3
    assert failures == ["grad b: missing in the run under test", "grad c: present only in the run under test"]


def test_compare_maps_reports_first_difference():
    _, failures = cmp.compare_maps({"w": torch.tensor([1.0, 2.0])}, {"w": torch.tensor([1.0, 3.0])}, what="grad")
    assert len(failures) == 1 and "first at flat index 1: 2.0 != 3.0" in failures[0]


def test_topk_ids_from_map_roundtrip():
    ids_TK = _ids([[3, 0], [1, 2]])
    map_TE = cmp.map_from_topk_ids(ids_TK, num_experts=4)
    assert torch.equal(cmp.topk_ids_from_map(map_TE), _ids([[0, 3], [1, 2]]))


def test_topk_ids_from_map_uneven_rows_rejected():
    map_TE = torch.tensor([[True, True, False], [True, False, False]])
    with pytest.raises(ValueError, match="between 1 and 2 experts"):
        cmp.topk_ids_from_map(map_TE)


def test_agreement_ignores_order_within_row():
    a = _ids([[0, 1], [2, 3], [0, 2], [1, 3]])
    b = _ids([[1, 0], [2, 3], [0, 3], [3, 1]])
    assert cmp.agreement(a, b) == pytest.approx(0.75)


def test_same_experts_shape_mismatch_rejected():
    with pytest.raises(ValueError, match="route shapes differ"):
        cmp.same_experts(_ids([[0, 1]]), _ids([[0, 1], [1, 2]]))


def test_close_within_rejects_nan_and_far_values():
    assert cmp.close_within(1.0, 1.00001, rtol=1e-4, atol=0.0)
    assert not cmp.close_within(1.0, 1.1, rtol=1e-4, atol=1e-4)
    assert not cmp.close_within(1.0, math.nan, rtol=1.0, atol=1.0)


def _routing(routes: Routes, probs_scale=1.0):
    out = {}
    for layer in routes.layers:
        for mb in range(routes.microbatches):
            map_TE = cmp.map_from_topk_ids(routes.get(layer, mb), num_experts=routes.num_experts)
            out[(layer, mb)] = (map_TE, map_TE.float() * probs_scale)
    return out


ROUTES = Routes(
    {1: [_ids([[0, 1], [2, 3]]), _ids([[1, 2], [0, 3]])], 3: [_ids([[3, 1], [0, 2]]), _ids([[0, 1], [1, 3]])]},
    num_experts=4,
    topk=2,
)


def test_check_follows_passes_when_routes_taken():
    t = Tally()
    rc.check_follows(t, ROUTES, _pass(routing=_routing(ROUTES)), prefix="", what="recorded", stage_layers=ROUTES.layers)
    assert t.passed and t.checked == 4


def test_check_follows_fails_on_swapped_microbatches():
    swapped = Routes(
        {layer: [ROUTES.get(layer, 1), ROUTES.get(layer, 0)] for layer in ROUTES.layers}, num_experts=4, topk=2
    )
    t = Tally()
    rc.check_follows(
        t, ROUTES, _pass(routing=_routing(swapped)), prefix="", what="recorded", stage_layers=ROUTES.layers
    )
    assert not t.passed
    assert "layer 1 mb 0: 2 of 2 token(s) did not follow the recorded routes" in t.failures[0]


def test_check_follows_fails_when_a_layer_never_ran():
    routing = {k: v for k, v in _routing(ROUTES).items() if k[0] == 1}
    t = Tally()
    rc.check_follows(t, ROUTES, _pass(routing=routing), prefix="", what="recorded", stage_layers=ROUTES.layers)
    assert any("layer 3 mb 0: recorded route never used" in f for f in t.failures)


def test_check_recorded_fails_on_layer_shift():
    shifted = Routes(
        {1: [ROUTES.get(3, 0), ROUTES.get(3, 1)], 3: [ROUTES.get(1, 0), ROUTES.get(1, 1)]}, num_experts=4, topk=2
    )
    t = Tally()
    rc.check_recorded(t, shifted, _pass(routing=_routing(ROUTES)), prefix="p: ")
    assert not t.passed and t.failures[0].startswith("p: layer 1 mb 0: recorded routes differ")


def test_check_drift_moved_fails_when_nothing_changed():
    t = Tally()
    rc.check_drift_moved(
        t, rc.drift_agreement(ROUTES, _pass(routing=_routing(ROUTES))), prefix="", stage_layers=ROUTES.layers
    )
    assert not t.passed and "changed no native route" in t.failures[0]


def test_a_dense_stage_routes_nothing_and_a_moe_stage_that_routes_nothing_fails():
    empty = Routes({}, num_experts=4, topk=2)
    t = Tally()
    rc.check_follows(t, empty, _pass(routing={}), prefix="", what="recorded", stage_layers=())
    rc.check_drift_moved(t, {}, prefix="", stage_layers=())
    assert not t.failures and t.checked == 0  # nothing to check here: the other stages carry the items
    rc.check_follows(t, empty, _pass(routing={}), prefix="", what="recorded", stage_layers=(1, 3))
    rc.check_drift_moved(t, {}, prefix="", stage_layers=(1, 3))
    assert len(t.failures) == 2 and "no router ran (this stage holds MoE layers [1, 3])" in t.failures[0]
    assert "changed no native route (0 of 0" in t.failures[1]


def test_drift_agreement_counts_tokens_per_layer():
    moved = ROUTES.replace(1, 0, _ids([[0, 1], [1, 2]]))
    counts = rc.drift_agreement(ROUTES, _pass(routing=_routing(moved)))
    assert counts == {1: (3, 4), 3: (4, 4)}


def test_check_recompute_calls_fails_when_recompute_routes_natively():
    routing = _routing(ROUTES)
    other = _routing(ROUTES.replace(3, 1, _ids([[2, 3], [1, 3]])))
    recompute = {1: [routing[(1, 0)], routing[(1, 1)]], 3: [routing[(3, 0)], other[(3, 1)]]}
    t = Tally()
    rc.check_recompute_calls(t, _pass(routing=routing, recompute=recompute), microbatches=2, prefix="")
    assert any("layer 3 mb 1: recompute routed 1 of 2 token(s) differently" in f for f in t.failures)


def test_check_recompute_calls_fails_on_missing_recompute():
    routing = _routing(ROUTES)
    t = Tally()
    rc.check_recompute_calls(
        t, _pass(routing=routing, recompute={1: [routing[(1, 0)]], 3: []}), microbatches=2, prefix=""
    )
    assert "layer 1: 1 recompute routing call(s), expected 2" in t.failures[0]


def test_compare_passes_fails_on_grad_difference():
    a = _pass(routing=_routing(ROUTES), grads={"w": torch.ones(3)})
    b = _pass(routing=_routing(ROUTES), grads={"w": torch.tensor([1.0, 1.0, 0.0])})
    t = Tally()
    rc.compare_passes(t, a, b, prefix="")
    assert [f.split(":")[0] for f in t.failures] == ["grad w"]


def test_check_losses_close_uses_the_dp_slice():
    got = _pass(seq_loss={0: torch.tensor([5.0, 6.0])})
    ref = {0: torch.tensor([1.0, 2.0, 5.0, 6.00001])}
    t = Tally()
    rc.check_losses_close(t, got, ref, dp_rank=1, batch=2, prefix="")
    assert t.passed and t.checked == 2
    t = Tally()
    rc.check_losses_close(t, got, ref, dp_rank=0, batch=2, prefix="")
    assert not t.passed and "mb 0 sequence 0: loss 5.0 vs 1-rank reference 1.0" in t.failures[0]


def test_batches_are_deterministic_and_split_by_dp():
    b = Batches(seq_len=8, batch=2, microbatches=2, dp=2, vocab_size=50, seed=3)
    assert torch.equal(b.global_tokens(1), b.global_tokens(1))
    assert not torch.equal(b.global_tokens(0), b.global_tokens(1))
    items = local_microbatches(b, Layout(), dp_rank=1, cp_rank=0)
    assert torch.equal(items[1].tokens_BS, b.global_tokens(1)[2:4])
    assert torch.equal(items[1].labels_BS[:, :-1], items[1].tokens_BS[:, 1:])


def test_local_microbatches_cp_takes_zigzag_positions():
    b = Batches(seq_len=8, batch=1, microbatches=1, dp=1, vocab_size=50)
    items = local_microbatches(b, Layout(cp=2), dp_rank=0, cp_rank=0)
    assert items[0].position_ids_BS.tolist() == [[0, 1, 6, 7]]


def test_select_variants_default_full_and_unknown():
    assert tuple(v.name for v in select(None)) == DEFAULT_VARIANTS
    assert len(select("full")) == len(VARIANTS)
    with pytest.raises(UsageError, match="unknown router variant"):
        select(["softmax", "nope"])


def test_replay_options_reject_unknown_subcheck():
    from moeverify.spec.checks import ReplayOptions

    with pytest.raises(
        UsageError, match=r"ReplayOptions: option replay_subchecks: unknown replay subchecks \['bogus'\]"
    ):
        ReplayOptions.from_options({"replay_subchecks": ["equivalence", "bogus"]})


def test_replay_options_microbatches_follow_interleaving():
    from moeverify.spec.checks import ReplayOptions

    opts = ReplayOptions.from_options({})
    assert opts.num_microbatches(Layout()) == 3
    assert opts.num_microbatches(Layout(pp=2, vpp=2)) == 4


def test_make_impl_unknown_name_rejected():
    from moeverify.oracles.replay.impls import make_impl

    with pytest.raises(
        UsageError, match="replay implementation 'bogus' is not moeverify, native, verl, package.module:attr"
    ):
        make_impl("bogus")


def test_make_impl_factory_must_return_adapter():
    from moeverify.oracles.replay.impls import make_impl

    with pytest.raises(UsageError, match="returned dict, expected a ReplayImpl"):
        make_impl("builtins:dict")


def test_load_verl_router_replay_patch_skips_verl_init():
    import sys

    pytest.importorskip("megatron.core")
    from moeverify.oracles.replay.impls import load_verl_router_replay_patch

    module = load_verl_router_replay_patch()
    assert hasattr(module, "apply_router_replay_patch")
    assert "verl.protocol" not in sys.modules  # verl/__init__ (ray, tensordict) never ran
