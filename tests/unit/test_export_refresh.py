"""The export oracle's ``refresh`` (a second export after a weight update) and ``reference_keys`` (the reference's
own names and shapes against the source checkpoint), on a 1-rank gloo world with plain modules as the model and
a bridge stand-in that exports them: stale subjects fail ``refresh``, a fresh one passes; a reference that drops
or reshapes a checkpoint tensor fails ``reference_keys`` naming the reference."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import save_file

from moeverify.oracles import export
from moeverify.oracles.export import SubjectContext, refresh
from moeverify.oracles.results import Tally


class _Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.w = torch.nn.Parameter(torch.randn(3, 4, generator=g).to(torch.bfloat16))
        self.norm = torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16))
        self.bias = torch.nn.Parameter(torch.zeros(4, dtype=torch.bfloat16))  # zeros must move too
        self.register_buffer("expert_bias", torch.zeros(2, dtype=torch.float32))


class _Bridge:
    """Exports the model's tensors under HF names (what ``export_hf_weights`` does for a real model)."""

    def __init__(self, *, drop: str | None = None, reshape: str | None = None) -> None:
        self.drop, self.reshape = drop, reshape

    def export_hf_weights(self, chunks, *, cpu, show_progress):
        m = chunks[0]
        for name, t in (("w", m.w), ("norm", m.norm), ("bias", m.bias), ("expert_bias", m.expert_bias)):
            if name == self.drop:
                continue
            t = t.detach().clone()
            yield name, t.reshape(-1) if name == self.reshape else t


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    made = not dist.is_initialized()
    if made:
        store = dist.FileStore(str(tmp_path_factory.mktemp("store") / "store"), 1)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield
    if made and dist.is_initialized():
        dist.destroy_process_group()


def _sctx(tmp_path, bridge=None) -> SubjectContext:
    model = _Model()
    tensors = dict(_Bridge().export_hf_weights([model], cpu=True, show_progress=False))
    save_file(tensors, str(tmp_path / "model.safetensors"))
    return SubjectContext(
        bridge=bridge or _Bridge(),
        model_chunks=[model],
        layout=None,
        rank=0,
        world_size=1,
        hf_path=tmp_path,
        timeout_s=30,
    )


def _failed(tallies) -> set[str]:
    return {k for k, t in tallies.items() if not t.passed}


def test_step_like_changes_every_element_and_keeps_equal_shapes_equal():
    a = torch.tensor([0.0, -0.0, 1.0, -3.5, 1e-30, 65504.0], dtype=torch.bfloat16)
    b = a.clone()
    new_a, new_b = refresh.step_like(a), refresh.step_like(b)
    assert torch.equal(new_a.view(torch.int16), new_b.view(torch.int16))  # copies of one tensor stay copies
    assert bool((new_a.view(torch.int16) != a.view(torch.int16)).all())
    fp32 = torch.randn(63, generator=torch.Generator().manual_seed(1))  # below HELD_FROM: every element moves
    assert bool((refresh.step_like(fp32) != fp32).all())


def test_step_like_holds_one_element_in_sixteen_of_a_large_tensor():
    """Where the weights did not change, a second export must not change either (``refresh_delta``): a large
    tensor keeps every 16th element (from index 5) and moves every other one; a 2-D shape holds the same flat ones."""
    fp32 = torch.randn(1000, generator=torch.Generator().manual_seed(1))
    new = refresh.step_like(fp32)
    held = torch.zeros(1000, dtype=torch.bool)
    held[5::16] = True
    assert torch.equal(new[held], fp32[held]) and bool((new[~held] != fp32[~held]).all())
    grid = fp32.reshape(40, 25).to(torch.bfloat16)
    assert torch.equal(refresh.step_like(grid).reshape(-1)[held], grid.reshape(-1)[held])


def test_updated_weights_restores_original_bits(world, tmp_path):
    sctx = _sctx(tmp_path)
    before = {k: v.clone() for k, v in sctx.model_chunks[0].state_dict().items()}
    with refresh.updated_weights(sctx.model_chunks) as n:
        assert n == 4  # three parameters and the expert bias
        assert not any(torch.equal(v, before[k]) for k, v in sctx.model_chunks[0].state_dict().items())
    after = sctx.model_chunks[0].state_dict()
    assert sorted(after) == sorted(before) and len(before) >= 4
    assert [k for k, v in after.items() if not torch.equal(v.view(torch.uint8), before[k].view(torch.uint8))] == []


def _fresh(ctx):
    yield from _Bridge().export_hf_weights(ctx.model_chunks, cpu=True, show_progress=False)


def _caching():
    cache = {}

    def subject(ctx):
        for name, t in _fresh(ctx):
            yield name, cache.setdefault(name, t)

    return subject


def _caching_one(keep: str):
    cache = {}

    def subject(ctx):
        for name, t in _fresh(ctx):
            yield name, cache.setdefault(name, t) if name == keep else t

    return subject


def test_updated_weights_updates_a_shared_parameter_once(world):
    shared = torch.nn.Parameter(torch.ones(5, dtype=torch.bfloat16))
    first, second = torch.nn.Module(), torch.nn.Module()
    first.w, second.w = shared, shared  # tied across chunks (one Parameter): one step, not two
    with refresh.updated_weights([first, second]) as n:
        assert n == 1
        assert torch.equal(shared.detach(), refresh.step_like(torch.ones(5, dtype=torch.bfloat16)))
    assert torch.equal(shared.detach(), torch.ones(5, dtype=torch.bfloat16))


def test_refresh_fresh_subject_passes(world, tmp_path):
    tallies = refresh.run_twice(export.run_subject, _fresh, _sctx(tmp_path))
    assert _failed(tallies) == set()
    assert tallies["refresh"].checked == 12 + 4 + 4 + 2


def test_refresh_stale_cache_fails_only_refresh(world, tmp_path):
    tallies = refresh.run_twice(export.run_subject, _caching(), _sctx(tmp_path))
    assert _failed(tallies) == {"refresh", "refresh_delta"}  # the first export's bits where every weight changed
    assert any(
        f.startswith("after the weight update (passed before it): bitwise: w:") for f in tallies["refresh"].failures
    ), tallies["refresh"].failures


def test_refresh_one_stale_tensor_names_it(world, tmp_path):
    tallies = refresh.run_twice(export.run_subject, _caching_one("expert_bias"), _sctx(tmp_path))
    assert _failed(tallies) == {"refresh", "refresh_delta"}
    assert [f.split(":")[0] for f in tallies["refresh_delta"].failures] == ["expert_bias"]
    failures = tallies["refresh"].failures
    assert failures and all(": bitwise: expert_bias:" in f for f in failures), failures


def _second_export(change):
    """A subject right on its first export and ``change(name, tensor)`` on every later one."""
    calls = []

    def subject(ctx):
        calls.append(1)
        for name, t in _fresh(ctx):
            yield name, (t if len(calls) == 1 else change(name, t.clone()))

    return subject


def test_refresh_delta_names_what_each_wrong_element_holds(world, tmp_path):
    assert refresh.run_twice(export.run_subject, _fresh, _sctx(tmp_path))["refresh_delta"].checked == 12 + 4 + 4 + 2
    # frozen: every element the update changed kept the first export's bits
    frozen = refresh.run_twice(export.run_subject, _caching(), _sctx(tmp_path))["refresh_delta"].failures
    assert any(
        f.startswith("w: 12 of 12 element(s) kept the previous export's bits where the weights changed") for f in frozen
    ), frozen

    def torn(name, t):  # bits of neither version (a reused buffer) in one element of w
        if name == "w":
            t.view(-1)[5] = 123.0
        return t

    failures = refresh.run_twice(export.run_subject, _second_export(torn), _sctx(tmp_path))["refresh_delta"].failures
    assert [f for f in failures if f.startswith("w:")] == [
        "w: 1 of 12 element(s) hold bits of neither the previous nor the new weights (a buffer reused or overwritten "
        "before it was read); first at [1, 1]"
    ], failures


class _Wide(_Model):
    """``_Model`` with a 64-element weight: the update holds 4 of its elements (``refresh.HELD``)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(8, 8, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16))


def test_refresh_delta_names_a_change_where_the_built_in_update_held_the_weights(world, tmp_path):
    """Through the real update and two real exports: a second export one ulp off in every element of ``w`` holds
    bits of neither version where the update moved ``w`` (60 elements) and changes where it held them (4)."""
    sctx = _sctx(tmp_path)
    sctx.model_chunks[0] = model = _Wide()
    save_file(
        dict(_Bridge().export_hf_weights([model], cpu=True, show_progress=False)), str(tmp_path / "model.safetensors")
    )

    def nudged(name, t):  # one ulp up in every element of w (its bits as int16, plus one)
        return (t.contiguous().view(torch.int16) + 1).view(torch.bfloat16) if name == "w" else t

    failures = refresh.run_twice(export.run_subject, _second_export(nudged), sctx)["refresh_delta"].failures
    assert [f.split(";")[0] for f in failures if f.startswith("w:")] == [
        "w: 60 of 64 element(s) hold bits of neither the previous nor the new weights (a buffer reused or "
        "overwritten before it was read)",
        "w: 4 of 64 element(s) changed where the weights did not",
    ], failures
    assert refresh.run_twice(export.run_subject, _fresh, _sctx(tmp_path))["refresh_delta"].passed  # control


def test_refresh_delta_sees_a_change_where_the_weights_did_not_change():
    before, after = (
        refresh.Fingerprints(lambda: iter(()), record=True, keep=True),
        refresh.Fingerprints(lambda: iter(()), record=True, keep=True),
    )
    old, new = torch.arange(6, dtype=torch.float32), torch.arange(6, dtype=torch.float32)
    new[0] += 1  # the weights changed in element 0 only
    before.kept["t"], after.kept["t"] = old.clone(), new.clone()
    delta = refresh.Delta(before, after)
    delta.first("t", old.clone())
    sent = new.clone()
    sent[3] = -1.0  # the second export changed element 3 too
    delta.second("t", sent)
    assert delta.finish().failures == ["t: 1 of 6 element(s) changed where the weights did not; first at [3]"]
    assert delta.tally.checked == 6


def test_refresh_unchanged_reference_fails(world, tmp_path):
    t = Tally()
    same = {"a": "d1", "b": "d2"}
    passed = {k: Tally(checked=1) for k in ("bitwise", "coverage")}
    refresh.fold(first=passed, second=passed, before=same, after={"a": "d1", "b": "d3"}, tally=t)
    assert t.failures == [
        "the weight update left 1 reference tensor(s) bit-identical, so a stale copy of them "
        "cannot be told from a fresh one: ['a']"
    ]


def test_refresh_fold_ignores_subchecks_failing_before_the_update():
    failing = Tally(checked=3, failures=["x"])
    first = {"bitwise": failing, "coverage": Tally(checked=2)}
    second = {"bitwise": Tally(checked=3, failures=["y"]), "coverage": Tally(checked=2, failures=["z"])}
    t = refresh.fold(first=first, second=second, before={"a": "1"}, after={"a": "2"}, tally=Tally())
    assert t.failures == ["after the weight update (passed before it): coverage: z"]


def test_refresh_fold_counts_nothing_without_a_reference():
    ok = {"bitwise": Tally(checked=0)}
    t = refresh.fold(first=ok, second=ok, before={}, after={}, tally=Tally())
    assert not t.passed and "nothing compared" in t.failures[0]


def test_refresh_skipped_when_lockstep_fails(world, tmp_path):
    tallies = refresh.run_twice(export.run_subject, lambda ctx: iter(["bad"]), _sctx(tmp_path))
    assert not tallies["refresh"].passed and "skipped: lockstep failed" in tallies["refresh"].failures[0]


def test_reference_keys_dropped_tensor_names_the_reference(world, tmp_path):
    tallies = export.run_subject(_fresh, _sctx(tmp_path, _Bridge(drop="norm")))
    failures = tallies["reference_keys"].failures
    assert failures == [
        "the reference (Megatron-Bridge's export_hf_weights) dropped 1 tensor(s) of the source "
        "checkpoint: ['norm (4,)'] (name and checkpoint shape); the subject exported 1 of them "
        "(4 element(s)), unverified bit for bit for want of a reference"
    ]
    assert "key_set" in _failed(tallies)  # still caught there too, pointing at reference_keys
    assert (
        "which the reference (Megatron-Bridge's export_hf_weights) lacks (see reference_keys)"
        in tallies["key_set"].failures[0]
    )


def test_reference_keys_wrong_shape_names_the_reference(world, tmp_path):
    tallies = export.run_subject(_fresh, _sctx(tmp_path, _Bridge(reshape="w")))
    assert tallies["reference_keys"].failures == [
        "w: the reference (Megatron-Bridge's export_hf_weights) exported shape (12,), "
        "the source checkpoint holds (3, 4)"
    ]


def test_reference_keys_control_passes(world, tmp_path):
    tallies = export.run_subject(_fresh, _sctx(tmp_path))
    assert _failed(tallies) == set() and tallies["reference_keys"].checked == 4


def _fused(**_options):
    from moeverify.oracles.export.receiver import FusedReceiver

    return FusedReceiver()


def test_receiver_loads_the_subjects_stream_fresh_passes_stale_fails_the_reload(world, tmp_path):
    tallies = export.run_export(_fresh, _sctx(tmp_path), refresh=True, receiver=_fused)
    assert _failed(tallies) == set()
    assert (tallies["receiver"].checked, tallies["receiver_reload"].checked) == (4, 4)
    stale = export.run_export(_caching(), _sctx(tmp_path), refresh=True, receiver=_fused)
    assert _failed(stale) == {"refresh", "refresh_delta", "receiver_reload"}  # the first step's weights again
    assert stale["receiver_reload"].failures and all(
        f.startswith("after the weight sync: ") for f in stale["receiver_reload"].failures
    )


def test_receiver_holds_the_subjects_bits_and_nan_where_it_sent_nothing(world, tmp_path):
    from moeverify.oracles.export import ShardRow, Slot

    def subject(ctx):
        for name, t in _fresh(ctx):
            if name == "w":
                yield name, -t  # wrong bits under the right name
            elif name == "norm":  # the last element never sent
                yield ShardRow(row="norm", slots=[Slot("norm", (4,), torch.arange(3), t[:3])], contributes=True)
            else:
                yield name, t

    tallies = export.run_export(subject, _sctx(tmp_path), receiver=_fused)
    assert {"bitwise", "coverage", "receiver"} <= _failed(tallies)
    assert "receiver_reload" not in tallies  # no weight sync without refresh
    failures = tallies["receiver"].failures
    assert any(f.startswith("w(whole) = w: 12 of 12 element(s) differ") for f in failures), failures
    assert any(f.startswith("norm(whole) = norm: 1 of 4 element(s) differ, first at [3]: held nan") for f in failures)
