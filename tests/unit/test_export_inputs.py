"""The export oracle end to end on a 1-rank gloo world with a synthetic reference: passes, and every kind
of bad subject input fails with a message naming rank, row and slot (never a hang, never a silent pass)."""

import dataclasses
import textwrap

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import save_file

from moeverify.errors import UsageError
from moeverify.oracles import export
from moeverify.oracles.export import DeferredSlots, RangeSlot, RunSlot, ShardRow, Slot, SubjectContext

REFERENCE = {
    "a": torch.arange(6, dtype=torch.float32).reshape(2, 3),
    "b": torch.tensor([1.5, -0.0, 3.0, 4.0], dtype=torch.bfloat16),
    "i": torch.tensor([5, 6, 7], dtype=torch.int64),
}


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    made = not dist.is_initialized()
    if made:
        store = dist.FileStore(str(tmp_path_factory.mktemp("store") / "store"), 1)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield
    if made and dist.is_initialized():  # only the group this fixture made: others in this worker still use theirs
        dist.destroy_process_group()


@pytest.fixture()
def sctx(world, tmp_path):
    save_file({k: v.contiguous() for k, v in REFERENCE.items()}, str(tmp_path / "model.safetensors"))
    return SubjectContext(
        bridge=None, model_chunks=[], layout=None, rank=0, world_size=1, hf_path=tmp_path, timeout_s=30
    )


def _run(factory, sctx):
    tallies = export.run_subject(factory, sctx, reference=list(REFERENCE.items()))
    return {k: t.as_dict() for k, t in tallies.items()}


def _failed(result):
    return {k for k, v in result.items() if not v["passed"]}


def _sharded(name, t, split):
    flat = t.reshape(-1)
    return [
        ShardRow(
            f"row.{name}",
            [
                Slot(name, tuple(t.shape), torch.arange(0, split), flat[:split]),
                Slot(name, tuple(t.shape), torch.arange(split, flat.numel()), flat[split:]),
            ],
        )
    ]


def test_export_full_tensor_subject_passes(sctx):
    result = _run(lambda ctx: iter(REFERENCE.items()), sctx)
    assert _failed(result) == set()
    assert result["bitwise"]["checked"] == 13 and result["key_set"]["checked"] == 3


def test_export_sharded_subject_with_deferred_slots_passes(sctx):
    def factory(ctx):
        for name, t in REFERENCE.items():
            row = _sharded(name, t, 1)[0]
            yield ShardRow(row.row, DeferredSlots([(name, tuple(t.shape))] * 2, lambda r=row: r.slots), True)

    assert _failed(_run(factory, sctx)) == set()


def test_export_empty_subject_fails_not_passes(sctx):
    result = _run(lambda ctx: iter(()), sctx)
    assert {"coverage", "key_set", "bitwise", "shape_dtype"} <= _failed(result)
    assert "not exported by the subject" in result["coverage"]["failures"][0]


def test_export_a_reused_staging_buffer_is_refused_naming_the_item(sctx):
    # A streaming exporter refilling one buffer per item: every item read as the last one's bits (bitwise failed on
    # every tensor, blaming the values); now refused as what it is, naming the first item overwritten.
    def factory(ctx):
        buffer = torch.empty(16)
        for name in ("a", "b"):
            t = REFERENCE[name].float().reshape(-1)
            buffer[: t.numel()].copy_(t)
            yield name, buffer[: t.numel()].view(REFERENCE[name].shape)

    result = _run(factory, sctx)
    assert _failed(result) == set(export.SUBCHECKS)
    assert "rank 0 item 0 ('a'): its tensor was written into after it was yielded" in result["lockstep"]["failures"][0]
    # a fresh tensor per item (or the model's own, unchanged) passes
    assert _failed(_run(lambda ctx: ((n, t.clone()) for n, t in REFERENCE.items()), sctx)) == set()


def test_export_a_subject_raising_inside_torch_names_its_own_line_too(sctx):
    def factory(ctx):
        yield "a", REFERENCE["a"]
        torch.split(torch.zeros(3), [1, 1])  # raises inside torch's Python code

    message = _run(factory, sctx)["lockstep"]["failures"][0]
    assert "subject raised RuntimeError" in message and "site-packages/torch/" in message, message
    assert f"called from {__file__}:" in message, message


def test_export_wrong_item_type_fails_lockstep(sctx):
    result = _run(lambda ctx: iter([("a", REFERENCE["a"]), "b"]), sctx)
    assert _failed(result) == set(export.SUBCHECKS)
    assert (
        "rank 0 item 1: a subject yields ShardRow records or (hf_name: str, tensor) pairs, got str"
        in result["lockstep"]["failures"][0]
    )


@pytest.mark.parametrize(
    "positions, values, match",
    [
        (
            torch.zeros(1, 6, dtype=torch.int64),
            torch.zeros(6),
            "positions must be a 1-D int64 tensor, got shape (1, 6)",
        ),
        (
            torch.arange(6, dtype=torch.int32),
            torch.zeros(6),
            "positions must be a 1-D int64 tensor, got shape (6,) dtype torch.int32",
        ),
        (torch.arange(1, 7), torch.zeros(6), "positions must lie in [0, 6) for shape (2, 3), got min 1 max 6"),
        (torch.arange(6), torch.zeros(5), "values have 5 elements for 6 positions"),
        (torch.arange(6), [0.0] * 6, "positions and values must be tensors, got Tensor and list"),
    ],
)
def test_export_bad_slot_fails_naming_rank_row_slot(sctx, positions, values, match):
    rows = [ShardRow("row.a", [Slot("a", (2, 3), positions, values)])]
    result = _run(lambda ctx: iter(rows), sctx)
    msg = result["lockstep"]["failures"][0]
    assert "rank 0 row 'row.a' slot 0 ('a')" in msg and match in msg


def test_export_bad_deferred_slot_fails_slot_tables(sctx):
    bad = [Slot("a", (2, 3), torch.arange(1, 7), torch.zeros(6))]
    rows = [ShardRow("row.a", DeferredSlots([("a", (2, 3))], lambda: bad))]
    result = _run(lambda ctx: iter(rows), sctx)
    assert (
        "rank 0 row 'row.a': SubjectError: rank 0 row 'row.a' slot 0 ('a'): positions must lie in [0, 6)"
        in result["slot_tables"]["failures"][0]
    )
    assert "coverage" in _failed(result)


def _ranged(name, t, split):
    flat = t.reshape(-1)
    return ShardRow(
        f"row.{name}",
        [RangeSlot(name, tuple(t.shape), 0, flat[:split]), RangeSlot(name, tuple(t.shape), split, flat[split:])],
    )


@pytest.mark.parametrize("deferred", [False, True])
def test_export_range_slots_pass_and_fail_like_slots(sctx, deferred):
    def rows(change=lambda name, row: row):
        for name, t in REFERENCE.items():
            row = change(name, _ranged(name, t, 1))
            yield (
                ShardRow(row.row, DeferredSlots([(name, tuple(t.shape))] * 2, lambda r=row: r.slots))
                if deferred
                else row
            )

    assert _failed(_run(lambda ctx: rows(), sctx)) == set()
    assert RangeSlot("a", (2, 3), 2, torch.zeros(3)).positions.tolist() == [2, 3, 4]

    def gap(name, row):  # element 1 of "b" never written: coverage names it
        return (
            ShardRow(
                row.row, [row.slots[0], dataclasses.replace(row.slots[1], start=2, values=row.slots[1].values[1:])]
            )
            if name == "b"
            else row
        )

    result = _run(lambda ctx: rows(gap), sctx)
    assert (
        _failed(result) == {"coverage"}
        and "b: 1 of 4 element(s) never written, flat [1]" in result["coverage"]["failures"][0]
    )

    def shifted(name, row):  # "a"'s second range one place late: its values land on the wrong elements
        return ShardRow(row.row, [row.slots[0], dataclasses.replace(row.slots[1], start=2)]) if name == "a" else row

    result = _run(lambda ctx: rows(shifted), sctx)
    assert (
        "positions must lie in [0, 6) for shape (2, 3), got min 2 max 6"
        in (result["lockstep"]["failures"] + result["slot_tables"]["failures"])[0]
    )


@pytest.mark.parametrize(
    "start, values, match",
    [
        (-1, torch.zeros(2), "positions must lie in [0, 6) for shape (2, 3), got min -1 max 0"),
        (5, torch.zeros(2), "positions must lie in [0, 6) for shape (2, 3), got min 5 max 6"),
        (True, torch.zeros(2), "a RangeSlot's start must be an int, got bool"),
        (0.0, torch.zeros(2), "a RangeSlot's start must be an int, got float"),
        (0, [0.0, 1.0], "values must be a tensor, got list"),
    ],
)
def test_export_bad_range_slot_fails_naming_rank_row_slot(sctx, start, values, match):
    rows = [ShardRow("row.a", [RangeSlot("a", (2, 3), start, values)])]
    msg = _run(lambda ctx: iter(rows), sctx)["lockstep"]["failures"][0]
    assert "rank 0 row 'row.a' slot 0 ('a')" in msg and match in msg


def _run_slots(name, t, mine):
    """``t`` split between two RunSlots: the elements ``mine`` selects (as runs) and the others."""
    flat = t.reshape(-1)
    out = []
    for keep in (mine, ~mine):
        idx = keep.nonzero().flatten()
        heads = torch.cat([torch.tensor([True]), idx[1:] != idx[:-1] + 1]) if idx.numel() else idx.bool()
        starts = idx[heads]
        lengths = torch.diff(torch.cat([heads.nonzero().flatten(), torch.tensor([idx.numel()])]))
        out.append(RunSlot(name, tuple(t.shape), starts, lengths, flat[idx]))
    return ShardRow(f"row.{name}", out)


@pytest.mark.parametrize("deferred", [False, True])
def test_export_run_slots_pass_and_fail_like_slots(sctx, deferred):
    masks = {
        "a": torch.tensor([1, 0, 1, 1, 0, 1], dtype=torch.bool),
        "b": torch.tensor([0, 1, 1, 0], dtype=torch.bool),
        "i": torch.tensor([1, 0, 0], dtype=torch.bool),
    }

    def rows(change=lambda name, row: row):
        for name, t in REFERENCE.items():
            row = change(name, _run_slots(name, t, masks[name]))
            yield (
                ShardRow(row.row, DeferredSlots([(name, tuple(t.shape))] * 2, lambda r=row: r.slots))
                if deferred
                else row
            )

    result = _run(lambda ctx: rows(), sctx)
    assert _failed(result) == set() and result["bitwise"]["checked"] == 13
    assert RunSlot("a", (2, 3), torch.tensor([4, 0]), torch.tensor([2, 1]), torch.zeros(3)).positions.tolist() == [
        4,
        5,
        0,
    ]

    def flipped(name, row):  # one value of "a" with other bits: bitwise names it
        s = row.slots[0]
        values = s.values.clone()
        values[-1] = -values[-1] - 1
        return ShardRow(row.row, [dataclasses.replace(s, values=values), row.slots[1]]) if name == "a" else row

    result = _run(lambda ctx: rows(flipped), sctx)
    assert (
        _failed(result) == {"bitwise"}
        and "a: 1 element(s) differ from the reference, flat [5]" in result["bitwise"]["failures"][0]
    )

    def gap(name, row):  # the last run of "b" one element short: coverage names the element
        s = row.slots[0]
        return (
            ShardRow(
                row.row,
                [
                    dataclasses.replace(
                        s, lengths=s.lengths - torch.tensor([0] * (s.lengths.numel() - 1) + [1]), values=s.values[:-1]
                    ),
                    row.slots[1],
                ],
            )
            if name == "b"
            else row
        )

    result = _run(lambda ctx: rows(gap), sctx)
    assert (
        _failed(result) == {"coverage"}
        and "b: 1 of 4 element(s) never written, flat [2]" in result["coverage"]["failures"][0]
    )


@pytest.mark.parametrize(
    "starts, lengths, values, match",
    [
        (
            torch.tensor([0, 4]),
            torch.tensor([2, 3]),
            torch.zeros(5),
            "positions must lie in [0, 6) for shape (2, 3), got min 0 max 6",
        ),
        (torch.tensor([-1]), torch.tensor([2]), torch.zeros(2), "got min -1 max 0"),
        (torch.tensor([0, 3]), torch.tensor([2, -1]), torch.zeros(1), "run lengths must be >= 0, got min -1"),
        (torch.tensor([0, 3]), torch.tensor([2, 2]), torch.zeros(3), "values have 3 elements for runs of 4 positions"),
        (torch.tensor([0, 3]), torch.tensor([2]), torch.zeros(2), "2 starts for 1 lengths"),
        (torch.tensor([0.0]), torch.tensor([2]), torch.zeros(2), "starts must be a 1-D int64 tensor"),
        ([0], torch.tensor([2]), torch.zeros(2), "starts, lengths and values must be tensors, got list"),
    ],
)
def test_export_bad_run_slot_fails_naming_rank_row_slot(sctx, starts, lengths, values, match):
    rows = [ShardRow("row.a", [RunSlot("a", (2, 3), starts, lengths, values)])]
    msg = _run(lambda ctx: iter(rows), sctx)["lockstep"]["failures"][0]
    assert "rank 0 row 'row.a' slot 0 ('a')" in msg and match in msg


def test_export_raising_factory_fails_lockstep(sctx):
    def factory(ctx):
        yield ("a", REFERENCE["a"])
        raise RuntimeError("boom in the exporter")

    result = _run(factory, sctx)
    assert "rank 0: subject raised RuntimeError: boom in the exporter" in result["lockstep"]["failures"][0]


def test_export_fp32_through_bf16_fails_bitwise_only(sctx):
    def factory(ctx):
        for name, t in REFERENCE.items():
            yield (
                name,
                (t.to(torch.bfloat16).to(t.dtype) + (1e-3 if name == "a" else 0) if t.is_floating_point() else t),
            )

    result = _run(factory, sctx)
    assert _failed(result) == {"bitwise"}
    assert "a: " in result["bitwise"]["failures"][0] and "expected 0x" in result["bitwise"]["failures"][0]


def test_export_integer_and_nan_tensors_pass(sctx):
    ref = dict(REFERENCE, a=torch.tensor([[float("nan"), 1, 2], [3, 4, 5]]))
    tallies = export.run_subject(lambda ctx: iter(ref.items()), sctx, reference=list(ref.items()))
    assert tallies and {k: t.failures for k, t in tallies.items() if not t.passed} == {}


def test_load_subject_unknown_name_raises():
    with pytest.raises(UsageError, match="subject 'nope' is not bridge, sharded, gather, verl, package.module:attr"):
        export.load_subject("nope")


def test_load_subject_missing_module_raises():
    with pytest.raises(UsageError, match="subject 'no_such_mod:factory': no module named 'no_such_mod'"):
        export.load_subject("no_such_mod:factory")


def test_load_subject_file_factory(tmp_path):
    path = tmp_path / "my_subject.py"
    path.write_text(
        textwrap.dedent("""
        def factory(ctx):
            return iter(())
    """)
    )
    assert export.load_subject(f"{path}:factory")(None) is not None
    with pytest.raises(UsageError, match="has no attribute 'other'"):
        export.load_subject(f"{path}:other")


def test_load_subject_builtin_names_importable():
    from moeverify.subjects import bridge, sharded

    assert export.load_subject("bridge") is bridge and export.load_subject("sharded") is sharded
    assert export.load_subject("moeverify.subjects:sharded") is sharded
