"""The receiver loads what the subject streamed: the merged subject tensors (``TensorMerge.merged``), the sink that
hands them over (``SubjectExport``), the streamed comparison and ``ReceiverRun`` on synthetic HF tensors."""

from __future__ import annotations

import types

import pytest
import torch
from test_export_receiver import _export

from moeverify.oracles.export.merge import TensorMerge
from moeverify.oracles.export.receiver import FusedReceiver, ReceiverRun, SubjectExport, compare
from moeverify.oracles.results import Tally


def _merge(ref: torch.Tensor, writes, *, backed: bool, dtype=None) -> TensorMerge:
    t = {k: Tally() for k in ("conflicts", "replicas", "coverage", "shape_dtype", "bitwise")}
    m = TensorMerge(
        name="w",
        shape=tuple(ref.shape),
        dtype=dtype or ref.dtype,
        world_size=2,
        conflicts=t["conflicts"],
        replicas=t["replicas"],
        reference=ref if backed else None,
    )
    for rank, positions, values in writes:
        m.write(rank=rank, positions_P=positions, values_P=values)
    m.check_coverage(t["coverage"])
    m.check_against(ref, shape_dtype=t["shape_dtype"], bitwise=t["bitwise"])
    return m


def _expected(ref: torch.Tensor, writes) -> torch.Tensor:
    """What the subject sent, written element by element in plain Python: NaN (0 for integers) where nothing was."""
    flat = [float("nan") if ref.dtype.is_floating_point else 0] * ref.numel()
    for _rank, positions, values in writes:
        index = range(positions.start, positions.stop) if isinstance(positions, slice) else positions.tolist()
        for i, v in zip(index, values.tolist(), strict=True):
            flat[i] = v
    return torch.tensor(flat, dtype=ref.dtype).reshape(ref.shape)


REF = torch.randn(24, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16).reshape(4, 6)
FLAT = REF.reshape(-1)
CASES = {
    "clean_full": [(0, slice(0, 12), FLAT[:12]), (1, slice(12, 24), FLAT[12:])],
    "clean_with_gap": [(0, slice(0, 10), FLAT[:10]), (1, slice(12, 24), FLAT[12:])],
    "dirty_full": [(0, slice(0, 12), -FLAT[:12]), (1, slice(12, 24), FLAT[12:])],
    "dirty_with_gap": [(0, torch.tensor([0, 3, 5]), -FLAT[[0, 3, 5]]), (1, slice(12, 24), FLAT[12:])],
}


@pytest.mark.parametrize("backed", [True, False])
@pytest.mark.parametrize("case", sorted(CASES))
def test_merged_is_what_the_subject_sent_with_nan_where_nothing_was(case, backed):
    got = _merge(REF, CASES[case], backed=backed).merged()
    want = _expected(REF, CASES[case])
    assert got.shape == want.shape and got.dtype == want.dtype
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(got.nan_to_num(7.0).view(torch.int16), want.nan_to_num(7.0).view(torch.int16))


def test_merged_integer_gaps_are_zero():
    ref = torch.arange(1, 9, dtype=torch.int64).reshape(2, 4)
    writes = [(0, slice(0, 3), ref.reshape(-1)[:3]), (1, slice(5, 8), ref.reshape(-1)[5:] + 10)]
    assert torch.equal(_merge(ref, writes, backed=True).merged(), _expected(ref, writes))


def test_subject_export_hands_each_tensor_over_once():
    sink = SubjectExport()
    sink("a", torch.zeros(2))
    sink("b", torch.ones(3))
    assert len(sink) == 2
    stream = iter(sink)
    assert next(stream)[0] == "a" and len(sink) == 1  # taken, so no longer held here
    assert [n for n, _ in stream] == ["b"] and len(sink) == 0


def test_compare_streams_the_reference_one_tensor_at_a_time():
    ref = _export()
    held = FusedReceiver().load(dict(ref).items())
    from_mapping = compare(held, ref, Tally())
    from_stream = compare(held, ((n, t) for n, t in ref.items()), Tally())
    assert from_stream.passed and (from_stream.checked, from_stream.failures) == (from_mapping.checked, [])
    short = ((n, t) for n, t in ref.items() if n != "model.norm.weight")
    assert compare(held, short, Tally()).failures == [
        "model.norm.weight(whole) = model.norm.weight: the reference has no tensor 'model.norm.weight'"
    ]


def _sctx(reference: dict[str, torch.Tensor], rank: int = 0):
    """A subject context whose ``bridge.export_hf_weights`` streams ``reference``: the receiver's reference."""
    bridge = types.SimpleNamespace(export_hf_weights=lambda chunks, cpu, show_progress: iter(list(reference.items())))
    return types.SimpleNamespace(bridge=bridge, model_chunks=[], rank=rank, world_size=1, options={}, hf_path="unused")


def _stream(run: ReceiverRun, tensors: dict[str, torch.Tensor]) -> None:
    sink = run.sink()
    for name, tensor in tensors.items():
        sink(name, tensor.clone())


def test_receiver_run_loads_the_subjects_stream_not_the_reference():
    ref = _export(0)
    lockstep = Tally()
    lockstep.ok(2)
    run = ReceiverRun(lambda **_: FusedReceiver(), _sctx(ref))
    _stream(run, ref)
    run.check("receiver", {"lockstep": lockstep})
    assert run.finish()["receiver"].passed
    wrong = dict(ref)  # the subject sent gate and up of expert 1 exchanged: the engine holds them so
    up, gate = "model.layers.0.mlp.experts.1.up_proj.weight", "model.layers.0.mlp.experts.1.gate_proj.weight"
    wrong[up], wrong[gate] = ref[gate], ref[up]
    run = ReceiverRun(lambda **_: FusedReceiver(), _sctx(ref))
    _stream(run, wrong)
    run.check("receiver", {"lockstep": lockstep})
    failures = run.finish()["receiver"].failures
    assert [f.split(":")[0] for f in failures] == [
        "model.layers.0.mlp.experts.w13_weight[1].narrow(dim=0, 0, 4) = " + gate,
        "model.layers.0.mlp.experts.w13_weight[1].narrow(dim=0, 4, 4) = " + up,
    ]


def test_receiver_run_reports_a_refused_load_and_a_failed_lockstep():
    ref = _export(0)
    ok, bad = Tally(), Tally()
    ok.ok(2)
    bad.fail("rank 1: subject raised")
    run = ReceiverRun(lambda **_: FusedReceiver(), _sctx(ref))
    _stream(run, ref)
    run.check("receiver", {"lockstep": bad})
    assert run.finish()["receiver"].failures == ["skipped: lockstep failed, the subject's export was not merged"]
    mixed = dict(
        ref, **{"model.layers.0.self_attn.k_proj.weight": ref["model.layers.0.self_attn.k_proj.weight"].float()}
    )
    run = ReceiverRun(lambda **_: FusedReceiver(), _sctx(ref))
    _stream(run, mixed)
    run.check("receiver", {"lockstep": ok})
    (failure,) = run.finish()["receiver"].failures
    assert (
        failure.startswith("the receiver could not load the subject's export") and "fuses tensors of dtypes" in failure
    )
    made = []  # a receiver on every rank (an engine's workers), told which
    other_rank = ReceiverRun(lambda **kw: made.append(kw) or FusedReceiver(), _sctx(ref, rank=1))
    assert other_rank.sink() is None and (made[0]["rank"], made[0]["world_size"]) == (1, 1)
