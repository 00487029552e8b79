"""The replay oracle's later builds copy the first build's weights (``setup.WeightCopy``) instead of loading the
checkpoint again: a copied build equals a freshly loaded one bit for bit, every parameter and buffer, on families
with expert bias, grouped experts with biases and an MTP layer; a build of another structure loads."""

from __future__ import annotations

import types

import pytest
import torch

from moeverify import models
from moeverify.oracles.bits import bitwise_equal
from moeverify.oracles.replay import setup as st
from moeverify.oracles.replay.impls import make_impl
from moeverify.routing import views
from moeverify.spec.checks import RECOMPUTE_MODES, ReplayOptions
from moeverify.spec.layout import Layout
from moeverify.spec.models.ref import ModelRef
from moeverify.spec.router_variants import VARIANTS

pytestmark = pytest.mark.usefixtures("patched_megatron_world")


def _setup(family: str) -> st.Setup:
    scenario = types.SimpleNamespace(
        name=f"{family}-unit", family=family, model=ModelRef.builtin(family), seed=0, layout=Layout()
    )
    ctx = types.SimpleNamespace(scenario=scenario, world_size=1, rank=0, options={})
    opts = ReplayOptions(impl="moeverify", variants=(VARIANTS["default"],), microbatches=2)
    return st.make_setup(
        ctx, opts, make_impl("moeverify"), VARIANTS["default"], views.rank_coords(Layout(), rank=0, world_size=1)
    )


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3", "gpt_oss", "qwen3_next_mtp"])
def test_a_copied_build_is_the_loaded_build_bit_for_bit(family):
    setup = _setup(family)
    first = st.build(setup, Layout(), overrides={})
    copied = st.build(setup, Layout(), overrides={}, extra=RECOMPUTE_MODES["full"])  # the recompute subcheck's
    assert setup.builds == {"loaded": 1, "copied": 1}
    want, got = st._tensors(first), st._tensors(copied)  # the variant's seeded expert biases included
    assert want.keys() == got.keys() and len(want) > 10
    assert [key for key in want if not bitwise_equal(want[key], got[key])] == []
    loaded = st._tensors(
        models.build(ModelRef.builtin(family), Layout(), seed=0, overrides=dict(st._EXACT)).model_chunks
    )  # a plain load: the checkpoint's
    assert loaded.keys() == want.keys()
    assert [
        key for key in loaded if not key[1].endswith("expert_bias") and not bitwise_equal(loaded[key], got[key])
    ] == []


def test_a_build_of_another_structure_loads_and_keeps_the_first_copy():
    """Qwen3-Next's ``global_aux_loss`` keeps per-router token buffers; the backward_order subcheck builds it with the
    aux loss off, without them: that build loads through the bridge."""
    setup = _setup("qwen3_next")
    st.build(setup, Layout(), overrides={})
    (copy,) = setup.weights.values()
    chunks = st.build(setup, Layout(), overrides={}, extra={"moe_aux_loss_coeff": 0.0})
    assert setup.builds == {"loaded": 2, "copied": 0}
    assert len(st._tensors(chunks)) < len(copy.tensors)
    assert setup.weights == {Layout(): copy}


def test_restore_refuses_a_model_of_other_shapes_and_touches_nothing():
    small = [torch.nn.Linear(4, 3)]
    copy = st.WeightCopy.of(small)
    other = [torch.nn.Linear(4, 2)]
    before = other[0].weight.detach().clone()
    assert copy.restore(other) is None
    assert torch.equal(other[0].weight, before)
    same = [torch.nn.Linear(4, 3)]
    assert copy.restore(same) == 0 and torch.equal(same[0].weight, small[0].weight)


def test_a_large_build_first_frees_the_model_a_subcheck_dropped(monkeypatch):
    """A dropped model held only by its own reference cycles is collected before the next build once the weight copies
    exceed ``COLLECT_ABOVE`` (at production width it would be another copy of the model on the device), and not
    before (tiny builds skip the collection's cost). Automatic collection is off, so only the build's can free it."""
    import gc
    import weakref

    def dropped_model():
        holder = torch.nn.Linear(2, 2)
        holder.cycle = [holder]
        return weakref.ref(holder)

    setup = _setup("qwen3_moe")
    st.build(setup, Layout(), overrides={})
    gc.disable()
    try:
        monkeypatch.setattr(st, "COLLECT_ABOVE", 1 << 40)
        kept = dropped_model()
        st.build(setup, Layout(), overrides={})
        assert kept() is not None
        monkeypatch.setattr(st, "COLLECT_ABOVE", 0)
        freed = dropped_model()
        st.build(setup, Layout(), overrides={})
        assert freed() is None
    finally:
        gc.enable()


def test_every_build_of_a_variant_starts_with_no_other_model_alive(monkeypatch):
    """At production width each model alive is another fp32 copy on the device: every subcheck lets its model go
    before the next build (validation's, backward order's, both token-count builds included), so a variant holds one
    model, its gradients and the weight copy. Parameters of modules still tracked by the collector, reachable or not,
    are counted before each build (collection forced on)."""
    import gc
    import traceback

    def live_parameter_bytes() -> int:
        return sum(
            p.numel() * p.element_size()
            for o in gc.get_objects()
            if isinstance(o, torch.nn.Module)
            for p in o.parameters(recurse=False)
        )

    from moeverify.oracles.replay import subchecks as sc
    from moeverify.oracles.results import Tally
    from moeverify.spec.checks import CHECKS

    monkeypatch.setattr(st, "COLLECT_ABOVE", 0)
    baseline, seen = live_parameter_bytes(), []
    real_build = models.build

    def counting_build(*args, **kwargs):
        seen.append((traceback.extract_stack()[-3].name, live_parameter_bytes() - baseline))
        return real_build(*args, **kwargs)

    monkeypatch.setattr(st.models, "build", counting_build)
    setup = _setup("qwen3_moe")
    tallies = {name: Tally() for name in CHECKS["replay"].subchecks if name != "cross_layout"}
    sc.variant_on_layout(setup, tallies, {})
    assert {name: t.failures for name, t in tallies.items() if not t.passed} == {}
    callers = {name for name, _ in seen}
    assert {"variant_on_layout", "_backward_order", "_validation", "_one_case"} <= callers and len(seen) >= 5
    assert not callers & {"_native_parity", "_recompute"}  # they run on the variant's own build (``toggles``)
    assert [(name, extra) for name, extra in seen if extra > 0] == []


def test_guarded_steps_report_their_own_seconds_nested_steps_apart(monkeypatch):
    """The replay notes' ``seconds``: each guarded step's wall time without the steps it runs inside it, summed over
    its calls; a step that raised is timed too. The clock is the test's own (it advances only when a step says so),
    so the sums are exact whatever else the host runs."""
    now = [0.0]

    def advance(seconds: float) -> None:
        now[0] += seconds

    monkeypatch.setattr(st, "time", types.SimpleNamespace(perf_counter=lambda: now[0]))
    fake = types.SimpleNamespace(prefix="", _open=[], seconds={})

    def _inner():
        advance(0.05)

    def _failing():
        advance(0.02)
        raise ValueError("refused")

    def _outer():
        advance(0.03)
        st.guarded(fake, {}, _inner)
        st.guarded(fake, {}, _inner)
        st.guarded(fake, {"x": Tally()}, _failing)

    from moeverify.oracles.results import Tally

    st.guarded(fake, {}, _outer)
    assert fake.seconds == {"inner": 0.1, "failing": 0.02, "outer": 0.03} and fake._open == []
    assert round(sum(fake.seconds.values()), 3) == round(now[0], 3) == 0.15  # each second counted once


@pytest.mark.parametrize(("free_gb", "home"), [(200, "cuda"), (100, "cuda"), (70, "cpu"), (10, "cpu")])
def test_a_weight_copy_stays_on_the_gpu_only_with_room_for_the_gradients_besides(free_gb, home):
    """A 40 GB copy on a GPU: after it, the model's gradients (40 GB) and a quarter more must still fit."""
    assert st.copy_home(40 << 30, free=free_gb << 30) == home


def test_a_copy_held_elsewhere_restores_into_the_model_bit_for_bit():
    """A copy in host memory restores into a model on another device; only names, shapes and dtypes must match."""
    setup = _setup("qwen3_moe")
    first = st.build(setup, Layout(), overrides={})
    copy = st.WeightCopy.of(first)
    assert copy.device == "cpu" and copy.nbytes == sum(t.numel() * t.element_size() for t in copy.tensors.values())
    moved = st.WeightCopy({key: t.to(torch.float64).to(torch.float32) for key, t in copy.tensors.items()})
    fresh = st.build(setup, Layout(), overrides={})
    for t in st._tensors(fresh).values():
        with torch.no_grad():
            t.zero_()
    assert moved.restore(fresh) == 0
    got = st._tensors(fresh)
    assert [key for key in copy.tensors if not bitwise_equal(copy.tensors[key], got[key])] == []
    wrong = st.WeightCopy(
        {key: t.to(torch.bfloat16) if t.is_floating_point() else t for key, t in copy.tensors.items()}
    )
    assert wrong.restore(fresh) is None


def test_the_tied_scores_variant_ties_router_rows_in_pairs_in_every_build():
    """Loaded and copied builds alike: expert 2j+1's router row is expert 2j's, so their logits tie bitwise."""
    setup = _setup("deepseek_v3_wide")
    setup.variant = VARIANTS["tied_scores"]
    for chunks in (st.build(setup, Layout(), overrides={}), st.build(setup, Layout(), overrides={})):
        for _, router in st.find_routers(chunks).values():
            w = router.weight.detach()
            assert torch.equal(w[1::2], w[0::2]) and not torch.equal(w[0::2][:-1], w[0::2][1:])
            x = torch.randn(64, w.shape[1], generator=torch.Generator().manual_seed(0))
            logits = x @ w.t()
            assert torch.equal(logits[:, 1::2], logits[:, 0::2])
    assert setup.builds == {"loaded": 1, "copied": 1}


@pytest.mark.parametrize(
    ("impl", "builds"), [("moeverify", {"loaded": 1, "copied": 0}), ("native", {"loaded": 1, "copied": 1})]
)
def test_in_layout_subchecks_run_on_one_build_and_keep_no_copy(impl, builds):
    """``replay_subchecks: in_layout`` (what a production-size model runs): native parity and both recompute modes
    run on the variant's one build, so no weight copy is made (at 48 Qwen3-30B-A3B layers it was 61 GB of host
    memory) and every subcheck still checks items and passes. An implementation built with overrides of its own
    (``native``: ``moe_enable_routing_replay``) gets native parity on a second build, copied from the first."""
    import dataclasses

    from moeverify.oracles.replay import subchecks as sc
    from moeverify.oracles.results import Tally
    from moeverify.spec.checks import REPLAY_IN_LAYOUT

    setup = _setup("deepseek_v3")
    setup.impl = make_impl(impl)
    setup.impl.apply()
    setup.opts = dataclasses.replace(setup.opts, subchecks=REPLAY_IN_LAYOUT)
    tallies = {name: Tally() for name in REPLAY_IN_LAYOUT}
    sc.variant_on_layout(setup, tallies, {})
    assert {name: (t.passed, t.checked > 0) for name, t in tallies.items()} == dict.fromkeys(
        REPLAY_IN_LAYOUT, (True, True)
    )
    assert setup.builds == builds and (setup.weights == {}) == (builds["copied"] == 0)


def test_validation_refuses_each_bad_case_for_its_own_reason_on_one_build(monkeypatch):
    """The validation subcheck's control forward replays the first micro-batch's routes alone, so it uses every route
    it is given: the bad routes after it are refused for their own fault (not because the control left micro-batches
    unused, which made every case but the first pass whatever the implementation checks) and no model is rebuilt."""
    from moeverify.oracles.replay import subchecks as sc
    from moeverify.oracles.results import Tally

    setup = _setup("qwen3_moe")
    setup.impl.apply()
    errors = []
    one_forward = sc._one_forward

    def spy(chunks, item, *, impl, routes):
        routed, error = one_forward(chunks, item, impl=impl, routes=routes)
        errors.append(error)
        return routed, error

    monkeypatch.setattr(sc, "_one_forward", spy)
    t = Tally()
    sc._validation(setup, t)
    assert t.passed and t.checked == 10 and setup.builds == {"loaded": 1, "copied": 0}
    controls, bad = errors[0::2], errors[1::2]
    assert controls == [None] * 5
    assert all("never used" not in e for e in bad), bad
    assert [e.split(": ", 1)[0] for e in bad] == ["RouteError"] * 5
    wants = ["shape", "dtype", "out of range", "layers", "twice"]
    assert [w for w, e in zip(wants, bad, strict=True) if w not in e] == []


def test_a_later_build_takes_the_intact_tensors_of_the_build_before_it_and_the_written_ones_from_the_copy(monkeypatch):
    """The handover (on a GPU model with its copy in host memory; switched on for the CPU here): a second build takes
    every large tensor the first still holds as loaded, and one the first wrote into (in place, and through
    ``.data``, which no version counter sees) from the copy; either way the second build is the loaded one bit for
    bit. A build of another layout, or with no room on the device, takes nothing."""
    from moeverify.oracles.replay import handover

    monkeypatch.setattr(handover, "ON_CPU", True)
    monkeypatch.setattr(handover, "LARGE", 64)  # the tiny model's tensors are all small
    monkeypatch.setattr(st, "copy_home", lambda nbytes, *, free: "cpu")
    setup = _setup("qwen3_moe")
    first = st.build(setup, Layout(), overrides={})
    (copy,) = setup.weights.values()
    large = sorted(copy.prints)
    assert copy.prints and len(large) > 4 and setup.kept is not None
    want = {key: t.detach().clone() for key, t in st._tensors(first).items()}
    routers = [key for key in large if key[1].endswith("router.weight")]
    experts = [key for key in large if "experts" in key[1]]
    assert routers and experts
    with torch.no_grad():
        st._tensors(first)[routers[0]].add_(1.0)
        st._tensors(first)[experts[0]].data[0, 0] += 1.0
    del first
    second = st.build(setup, Layout(), overrides={})
    assert setup.builds == {"loaded": 1, "copied": 1} and setup.handed_over == len(large) - 2
    got = st._tensors(second)
    assert [key for key in want if not bitwise_equal(want[key], got[key])] == []
    # the kept tensors are the second build's now; with no room beside them, none is taken
    monkeypatch.setattr(handover, "room_for", lambda kept, nbytes: False)
    del second
    st.build(setup, Layout(), overrides={})
    assert setup.builds == {"loaded": 1, "copied": 2} and setup.handed_over == len(large) - 2


def test_every_subcheck_passes_on_handed_over_builds(monkeypatch):
    """The whole-model subchecks' builds take the tensors the build before them left intact (drift's perturbed routers
    and the variant's seeded expert biases from the copy), and every subcheck still checks items and passes."""
    from moeverify.oracles.replay import handover
    from moeverify.oracles.replay import subchecks as sc
    from moeverify.oracles.results import Tally
    from moeverify.spec.checks import CHECKS

    monkeypatch.setattr(handover, "ON_CPU", True)
    monkeypatch.setattr(handover, "LARGE", 64)
    monkeypatch.setattr(st, "copy_home", lambda nbytes, *, free: "cpu")
    setup = _setup("deepseek_v3")
    tallies = {name: Tally() for name in CHECKS["replay"].subchecks if name != "cross_layout"}
    sc.variant_on_layout(setup, tallies, {})
    assert {name: (t.passed, t.checked > 0) for name, t in tallies.items()} == dict.fromkeys(tallies, (True, True))
    assert setup.builds["copied"] >= 4 and setup.handed_over > 4 * len(setup.weights[Layout()].prints) // 2
