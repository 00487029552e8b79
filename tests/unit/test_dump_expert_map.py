"""Physical expert slots (EPLB redundant experts) mapped to logical ids before a diff: the map turns a wrong
agreement into 100 %; maps that are no valid mapping, and tokens holding two replicas of one expert, are refused."""

import json
import re

import numpy as np
import pytest
import torch

from moeverify import record
from moeverify.cli import main
from moeverify.record.stream import MappedSource, RoutesSource, widen
from moeverify.routing import expert_map
from moeverify.routing.expert_map import ExpertMapError
from moeverify.routing.routes import Routes

E, K, P, LAYERS, NUM_LAYERS = 8, 2, 11, (0, 2), 3  # layer 1 is dense
SEQ, BATCH = 6, 4
MAP = [0, 1, 2, 3, 4, 5, 6, 7, 1, 4, 6]  # slots 8, 9, 10 replicate logical experts 1, 4, 6
MAP_L2 = [0, 1, 2, 3, 4, 5, 6, 7, 0, 3, 3]  # layer 2's own placement


def _logical(seed=0, microbatches=2):
    gen = torch.Generator().manual_seed(seed)
    return Routes(
        {
            layer: [torch.rand(SEQ * BATCH, E, generator=gen).topk(K, dim=1).indices for _ in range(microbatches)]
            for layer in LAYERS
        },
        num_experts=E,
        topk=K,
    )


def _physical(logical, maps, seed=1):
    """Each logical id placed on one of its replicas at random; every replica used somewhere."""
    gen = torch.Generator().manual_seed(seed)
    data = {}
    for layer in logical.layers:
        slots = {e: [s for s, m in enumerate(maps[layer]) if m == e] for e in range(E)}
        data[layer] = []
        for mb in range(logical.microbatches):
            ids = logical.get(layer, mb).clone()
            for t in range(ids.shape[0]):
                for j in range(K):
                    choice = slots[int(ids[t, j])]
                    ids[t, j] = choice[int(torch.randint(len(choice), (1,), generator=gen))]
            data[layer].append(ids)
    return Routes(data, num_experts=P, topk=K)


@pytest.fixture
def sides(tmp_path):
    logical = _logical()
    physical = _physical(logical, {0: MAP, 2: MAP_L2})
    assert any(int(physical.get(layer, mb).max()) >= E for layer in LAYERS for mb in range(2))
    record.save(tmp_path / "logical", logical, order="router", seq_len=SEQ, batch=BATCH, num_layers=NUM_LAYERS)
    record.save(tmp_path / "physical", physical, order="router", seq_len=SEQ, batch=BATCH, num_layers=NUM_LAYERS)
    (tmp_path / "map.json").write_text(json.dumps({"0": MAP, "2": MAP_L2}))
    return tmp_path, logical, physical


def _diff(tmp_path, *extra, a="logical", b="physical"):
    out = tmp_path / "d.json"
    code = main(["dump", "diff", str(tmp_path / a), str(tmp_path / b), "--json", str(out), *extra])
    return code, (json.loads(out.read_text()) if code != 2 else None)


def test_the_map_turns_a_refused_comparison_into_100_percent(sides, capsys):
    tmp_path, logical, physical = sides
    code, _ = _diff(tmp_path, "--fail-on-diff")  # 8 logical experts vs 11 physical slots: not one model's ids
    assert code == 2
    assert (
        f"has {E} experts, B ({tmp_path / 'physical'}) has {P}: routes of different models" in capsys.readouterr().err
    )
    for engine in ([], ["--in-memory"]):
        code, right = _diff(tmp_path, "--expert-map-b", str(tmp_path / "map.json"), "--fail-on-diff", *engine)
        assert code == 0
        assert right["tokens_diverging_any_layer"] == 0.0 and right["agreement_all_layers"] == 1.0
        assert right["num_experts"] == E
        assert right["expert_maps"] == {
            "b": {
                "file": str(tmp_path / "map.json"),
                "physical_slots": P,
                "logical_experts": E,
                "layers": [0, 2],
                "redundant_slots_per_layer": 3,
            }
        }
        assert right["layers"]["0"]["load_b"] == right["layers"]["0"]["load_a"]


def test_the_map_on_side_a_and_on_both_sides(sides):
    tmp_path = sides[0]
    code, _ = _diff(tmp_path, "--expert-map-a", str(tmp_path / "map.json"), "--fail-on-diff", a="physical", b="logical")
    assert code == 0
    code, result = _diff(
        tmp_path,
        "--expert-map-a",
        str(tmp_path / "map.json"),
        "--expert-map-b",
        str(tmp_path / "map.json"),
        "--fail-on-diff",
        a="physical",
        b="physical",
    )
    assert code == 0 and set(result["expert_maps"]) == {"a", "b"}


@pytest.mark.parametrize(
    "write",
    [
        lambda p: p.write_text(json.dumps({"physical_to_logical_map": {"0": MAP, "2": MAP_L2}})),
        lambda p: p.write_text(json.dumps([MAP, MAP_L2])),  # one row per MoE layer
        lambda p: p.write_text(json.dumps([MAP, [0] * P, MAP_L2])),  # one row per decoder layer; the dense row ignored
        lambda p: np.save(p.with_suffix(".npy"), np.array([MAP, MAP_L2], dtype=np.int32)),
        lambda p: np.save(p.with_suffix(".npy"), np.array([MAP, [-1] * P, MAP_L2], dtype=np.int64)),
    ],
    ids=["wrapped", "moe-rows", "all-layer-rows", "npy-moe-rows", "npy-all-layer-rows"],
)
def test_every_map_format(sides, write):
    tmp_path = sides[0]
    path = tmp_path / "m.json"
    write(path)
    path = path if path.exists() else path.with_suffix(".npy")
    code, result = _diff(tmp_path, "--expert-map-b", str(path), "--fail-on-diff")
    assert code == 0 and result["tokens_diverging_any_layer"] == 0.0


def test_one_map_for_all_layers(tmp_path):
    logical = _logical(seed=3)
    physical = _physical(logical, {0: MAP, 2: MAP}, seed=4)
    mapped = MappedSource(
        widen(RoutesSource(physical), P),
        expert_map.from_object(MAP, moe_layers=LAYERS, physical_experts=P, name="inline"),
        where="B",
    )
    assert record.diff_stream(RoutesSource(logical), mapped).tokens_diverging_any_layer == 0.0
    assert record.diff(logical, mapped.routes()).tokens_diverging_any_layer == 0.0
    unmapped = record.diff(
        Routes({la: [logical.get(la, m) for m in range(2)] for la in LAYERS}, num_experts=P, topk=K), physical
    )
    assert unmapped.tokens_diverging_any_layer > 0.1


BAD = [
    ("short", json.dumps(MAP[:-1]), r"layer 0: 10 slot\(s\) != .*'s 11 experts \(its physical slots\)"),
    ("out-of-range", json.dumps(MAP[:3] + [11] + MAP[4:]), r"layer 0 slot 3: logical id 11 out of range \[0, 11\)"),
    (
        "negative",
        json.dumps({"0": MAP, "2": MAP_L2[:5] + [-1] + MAP_L2[6:]}),
        r"layer 2 slot 5: logical id -1 out of range \[0, 11\)",
    ),
    ("float", json.dumps(MAP[:2] + [2.5] + MAP[3:]), r"layer 0 slot 2: 2.5 is not an integer logical id"),
    ("bool", json.dumps(MAP[:2] + [True] + MAP[3:]), r"layer 0 slot 2: True is not an integer logical id"),
    ("string", json.dumps({"0": MAP, "2": ["0"] + MAP_L2[1:]}), r"layer 2 slot 0: '0' is not an integer logical id"),
    ("layer-missing", json.dumps({"0": MAP}), r"MoE layer\(s\) \[2\] missing \(the map names layers \[0\]"),
    ("past-the-layers", json.dumps({"0": MAP, "2": MAP, "3": MAP}), r"layer\(s\) \[3\] are not MoE layers of \[0, 2\]"),
    ("not-a-layer", json.dumps({"0": MAP, "x": MAP}), r"key 'x' is not a global layer number"),
    ("rows", json.dumps([MAP] * 4), r"4 row\(s\) fit neither the 2 MoE layers \[0, 2\] nor all 3 decoder layers"),
    ("mixed", json.dumps([MAP, 3]), r"a list mixing numbers and lists"),
    (
        "unplaced",
        json.dumps([0, 1, 2, 3, 4, 6, 6, 7, 1, 4, 6]),
        r"layer 0: logical expert\(s\) \[5\] have no physical slot",
    ),
    (
        "more-logical",
        json.dumps([0, 1, 2, 3, 4, 5, 6, 7, 8, 4, 6]),
        r"maps onto 9 logical experts, .*logical's side has 8",
    ),
    ("wrapper-extra", json.dumps({"physical_to_logical_map": MAP, "note": 1}), r"must hold nothing else"),
    ("not-json", "[0, 1,", r"not valid JSON"),
    ("number", "5", r"expected a list, a list of lists, an object keyed by layer or an array; got int"),
    ("empty-row", json.dumps({"0": [], "2": MAP}), r"layer 0: expected a non-empty list of logical ids"),
    (
        "repeated-key",
        f'{{"0": {json.dumps(MAP)}, "2": {json.dumps(MAP)}, "0": {json.dumps(MAP)}}}',
        r"key\(s\) \['0'\] given twice",
    ),
    (
        "padded-key",
        json.dumps({"0": MAP, "2": MAP, "00": MAP}),
        r"key '00' is not a global layer number written plainly",
    ),
    ("underscore-key", json.dumps({"0": MAP, "2": MAP, "1_0": MAP}), r"key '1_0' is not a global layer number"),
]


@pytest.mark.parametrize("name,text,match", BAD, ids=[b[0] for b in BAD])
def test_maps_that_are_not_valid_mappings_are_refused_naming_file_layer_and_slot(sides, capsys, name, text, match):
    tmp_path = sides[0]
    path = tmp_path / f"{name}.json"
    path.write_text(text)
    capsys.readouterr()
    assert _diff(tmp_path, "--expert-map-b", str(path))[0] == 2
    err = capsys.readouterr().err
    assert str(path) in err
    import re

    assert re.search(match, err), err


def test_npy_maps_must_hold_integers_and_files_must_be_json_or_npy(sides, capsys):
    tmp_path = sides[0]
    np.save(tmp_path / "f.npy", np.array(MAP, dtype=np.float64))
    (tmp_path / "m.txt").write_text(json.dumps(MAP))
    for path, match in (
        (tmp_path / "f.npy", "dtype float64 is not an integer dtype"),
        (tmp_path / "m.txt", "an expert map is a .json or .npy file"),
        (tmp_path / "absent.json", "expert map not found"),
    ):
        capsys.readouterr()
        assert _diff(tmp_path, "--expert-map-b", str(path))[0] == 2
        assert match in capsys.readouterr().err


def test_two_replicas_of_one_logical_expert_in_a_token_are_a_finding_not_deduplicated(sides, capsys):
    tmp_path, logical, physical = sides
    ids = physical.get(2, 1).clone()
    ids[5] = torch.tensor([3, 10])  # layer 2 maps slot 10 to logical 3: the token routes to expert 3 twice
    record.save(
        tmp_path / "dup", physical.replace(2, 1, ids), order="router", seq_len=SEQ, batch=BATCH, num_layers=NUM_LAYERS
    )
    for engine in ([], ["--in-memory"]):
        capsys.readouterr()
        assert _diff(tmp_path, "--expert-map-b", str(tmp_path / "map.json"), *engine, b="dup")[0] == 2
        err = capsys.readouterr().err
        # router row 5 = s 1, b 1: sequence-order token 1 * SEQ + 1
        assert (
            f"layer 2 micro-batch 1 token {SEQ + 1} (sequence 1 of the micro-batch, position 1): top-2 physical "
            f"slots [3, 10] map through {tmp_path / 'map.json'} to logical experts [3, 3]: two replicas"
        ) in err
    emap = expert_map.load(tmp_path / "map.json", moe_layers=LAYERS, physical_experts=P)
    with pytest.raises(expert_map.ExpertMapError, match=r"1 such token\(s\)"):
        emap.apply(2, torch.tensor([[0, 1], [3, 10]]), where="x")
    assert emap.apply(0, torch.tensor([[0, 8], [9, 10]]), where="x").tolist() == [[0, 1], [4, 6]]


def test_ids_beyond_the_map_are_refused(sides, capsys):
    emap = expert_map.load(sides[0] / "map.json", moe_layers=LAYERS, physical_experts=P)
    with pytest.raises(
        expert_map.ExpertMapError,
        match=r"layer 0 micro-batch 0: expert id 11 is no slot of .*"
        r"\(expected \[0, 11\)\)",
    ):
        emap.apply(0, torch.tensor([[0, 11]]), where="x")


def test_convert_with_an_expert_map_writes_logical_ids(sides, capsys):
    tmp_path, logical, physical = sides
    dump = record.load(tmp_path / "physical")
    stacked = torch.stack([dump.routes().get(layer, 0) for layer in LAYERS], dim=1).numpy()
    np.save(tmp_path / "phys.npy", stacked)
    assert (
        main(
            [
                "dump",
                "convert",
                str(tmp_path / "phys.npy"),
                str(tmp_path / "conv"),
                "--moe-layers",
                "0,2",
                "--num-layers",
                "3",
                "--num-experts",
                str(P),
                "--expert-map",
                str(tmp_path / "map.json"),
            ]
        )
        == 0
    )
    conv = record.load(tmp_path / "conv")
    want = record.load(tmp_path / "logical").routes()
    assert conv.model.num_experts == E
    for layer in LAYERS:
        assert torch.equal(conv.routes().get(layer, 0).long(), want.get(layer, 0).long())
    assert (
        main(
            [
                "dump",
                "convert",
                str(tmp_path / "phys.npy"),
                str(tmp_path / "conv2"),
                "--moe-layers",
                "0,2",
                "--num-layers",
                "3",
                "--num-experts",
                "12",
                "--expert-map",
                str(tmp_path / "map.json"),
            ]
        )
        == 2
    )
    assert "11 slot(s) != " in capsys.readouterr().err and not (tmp_path / "conv2").exists()
    assert (
        main(
            [
                "dump",
                "convert",
                str(tmp_path / "physical"),
                str(tmp_path / "out.npz"),
                "--expert-map",
                str(tmp_path / "map.json"),
            ]
        )
        == 0
    )
    with np.load(tmp_path / "out.npz") as npz:
        assert npz["step0_mb1"].max() < E
        assert np.array_equal(npz["step0_mb1"][:, 1], want.get(2, 1).numpy())


def _requests(routes):
    """What a rollout engine returns for sequence-order routes: per request [SEQ - 1, L, K]."""
    out = []
    for mb in range(routes.microbatches):
        stacked = routes.stacked(mb).numpy()
        out.extend(stacked[b * SEQ : (b + 1) * SEQ - 1] for b in range(BATCH))
    return out


def test_rollout_in_physical_slots_against_logical_training(sides, capsys):
    tmp_path, logical, physical = sides
    requests = _requests(record.load(tmp_path / "physical").routes())
    requests[3] = requests[3].copy()
    requests[3][2] = -1  # a capture gap, set apart per request
    np.savez(tmp_path / "rollout.npz", **{f"r{i}": a for i, a in enumerate(requests)})
    train, rollout, out = str(tmp_path / "logical"), str(tmp_path / "rollout.npz"), tmp_path / "r.json"
    assert main(["dump", "diff", train, rollout, "--rollout"]) == 2
    assert (
        "is outside [0, 8) (and not -1, a capture gap); a rollout that records physical expert slots (an expert "
        "placement with redundant experts, EPLB) needs their map to logical ids: --expert-map-b FILE"
        in capsys.readouterr().err
    )
    assert (
        main(
            [
                "dump",
                "diff",
                train,
                rollout,
                "--rollout",
                "--expert-map-b",
                str(tmp_path / "map.json"),
                "--json",
                str(out),
                "--fail-on-diff",
                "--gaps-expected",  # the one capture gap below is this rollout's on purpose
            ]
        )
        == 0
    )
    result = json.loads(out.read_text())
    assert result["tokens_diverging_any_layer"] == 0.0 and result["expert_maps"]["b"]["physical_slots"] == P
    seqs = result["sequences"]
    assert len(seqs) == 2 * BATCH and [s["request"] for s in seqs] == list(range(2 * BATCH))
    assert [s["tokens"] for s in seqs] == [SEQ - 1] * 3 + [SEQ - 2] + [SEQ - 1] * 4
    assert [s["capture_gap_rows"] for s in seqs] == [0, 0, 0, 1, 0, 0, 0, 0]
    assert [s["uncaptured_tokens"] for s in seqs] == [1] * 2 * BATCH
    assert result["rollout"]["capture_gap_rows"] == 1
    # the training side in physical slots, the rollout in logical ids: --expert-map-a
    log_req = _requests(record.load(tmp_path / "logical").routes())
    np.savez(tmp_path / "rollout_logical.npz", **{f"r{i}": a for i, a in enumerate(log_req)})
    assert (
        main(
            [
                "dump",
                "diff",
                str(tmp_path / "physical"),
                str(tmp_path / "rollout_logical.npz"),
                "--rollout",
                "--expert-map-a",
                str(tmp_path / "map.json"),
                "--fail-on-diff",
            ]
        )
        == 0
    )


def test_npy_maps_of_three_dimensions_and_layers_without_a_map(sides, capsys):
    tmp_path = sides[0]
    np.save(tmp_path / "m3.npy", np.array([[MAP, MAP_L2]]))
    assert _diff(tmp_path, "--expert-map-b", str(tmp_path / "m3.npy"))[0] == 2
    assert "shape (1, 2, 11) is neither [slots] nor [layers, slots]" in capsys.readouterr().err
    emap = expert_map.load(tmp_path / "map.json", moe_layers=LAYERS, physical_experts=P)
    with pytest.raises(expert_map.ExpertMapError, match=r"no map for layer 1 \(maps layers \[0, 2\]\)"):
        emap.apply(1, torch.tensor([[0, 1]]), where="x")


def test_an_array_side_with_ids_beyond_the_maps_slots_is_refused(sides, capsys):
    tmp_path, logical, physical = sides
    stacked = torch.stack([physical.get(layer, 0) for layer in LAYERS], dim=1)  # the order of logical's mb 0
    np.save(tmp_path / "phys.npy", stacked.numpy())
    (tmp_path / "map10.json").write_text(json.dumps(MAP[:10]))
    (tmp_path / "rows.json").write_text(json.dumps([MAP, MAP_L2]))  # an array's layers are numbered 0, 1, ...
    one_mb = tmp_path / "one_mb"
    record.save(one_mb, Routes({i: [logical.get(la, 0)] for i, la in enumerate(LAYERS)}, num_experts=E, topk=K))
    args = ["dump", "diff", str(one_mb), str(tmp_path / "phys.npy"), "--order-b", "sequence", "--assume-same-order"]
    capsys.readouterr()
    assert main([*args, "--expert-map-b", str(tmp_path / "map10.json")]) == 2
    assert "map10.json: 10 slot(s), but " in capsys.readouterr().err
    assert main([*args, "--expert-map-b", str(tmp_path / "rows.json"), "--fail-on-diff"]) == 0
    assert main([*args, "--fail-on-diff"]) == 1  # unmapped: the array is widened to 11 experts, and disagrees
    capsys.readouterr()
    assert (
        main(
            [
                "dump",
                "convert",
                str(tmp_path / "phys.npy"),
                str(tmp_path / "c"),
                "--moe-layers",
                "0,2",
                "--num-layers",
                "3",
                "--expert-map",
                str(tmp_path / "map10.json"),
            ]
        )
        == 2
    )
    assert "map10.json: 10 slot(s), but " in capsys.readouterr().err and not (tmp_path / "c").exists()


def test_a_rollout_map_onto_another_logical_expert_count_is_refused(sides, capsys):
    tmp_path = sides[0]
    requests = _requests(record.load(tmp_path / "physical").routes())
    np.savez(tmp_path / "rollout.npz", **{f"r{i}": a for i, a in enumerate(requests)})
    (tmp_path / "nine.json").write_text(json.dumps([0, 1, 2, 3, 4, 5, 6, 7, 8, 4, 6]))
    assert (
        main(
            [
                "dump",
                "diff",
                str(tmp_path / "logical"),
                str(tmp_path / "rollout.npz"),
                "--rollout",
                "--expert-map-b",
                str(tmp_path / "nine.json"),
            ]
        )
        == 2
    )
    assert "nine.json: maps onto 9 logical experts, the training side has 8" in capsys.readouterr().err


@pytest.mark.parametrize(
    "name,array,match",
    [
        ("empty", np.zeros((0,), dtype=np.int64), r"layer 0: the map row is empty \(shape \(0,\)\)"),
        ("empty-rows", np.zeros((2, 0), dtype=np.int64), r"layer 0: the map row is empty \(shape \(0,\)\)"),
        ("no-rows", np.zeros((0, P), dtype=np.int64), r"0 row\(s\) fit neither the 2 MoE layers"),
        (
            "uint64",
            np.array(MAP[:-1] + [2**64 - 1], dtype=np.uint64),
            r"layer 0 slot 10: logical id 18446744073709551615 "
            r"out of range",
        ),
    ],
)
def test_bad_npy_maps_are_refused_not_raised_raw(sides, capsys, name, array, match):
    tmp_path = sides[0]
    np.save(tmp_path / f"{name}.npy", array)
    capsys.readouterr()
    assert _diff(tmp_path, "--expert-map-b", str(tmp_path / f"{name}.npy"))[0] == 2
    assert re.search(match, capsys.readouterr().err)


def test_json_map_id_beyond_int64_is_refused_not_raised_raw(sides, capsys):
    tmp_path = sides[0]
    (tmp_path / "big.json").write_text(json.dumps(MAP[:-1] + [2**70]))
    assert _diff(tmp_path, "--expert-map-b", str(tmp_path / "big.json"))[0] == 2
    assert "layer 0 slot 10: logical id 1180591620717411303424 out of range" in capsys.readouterr().err


def test_map_rows_fitting_two_layer_numberings_refused():
    # 3 rows for MoE layers [1, 2, 3] of a model of 3 decoder layers (+ MTP layer 3): one row per MoE layer or
    # one per decoder layer? Refused, never guessed; the layer-keyed form says which row is which.
    rows = [list(range(4)), [1, 0, 3, 2], [3, 2, 1, 0]]
    with pytest.raises(
        expert_map.ExpertMapError,
        match=r"3 rows fit both one row per MoE layer \[1, 2, 3\] and one "
        r"row per decoder layer \(3 decoder layers.*key the rows by "
        r"layer",
    ):
        expert_map.from_object(rows, moe_layers=[1, 2, 3], num_layers=3)
    keyed = expert_map.from_object(
        {str(layer): row for layer, row in zip([1, 2, 3], rows, strict=True)}, moe_layers=[1, 2, 3], num_layers=3
    )
    assert keyed.per_layer[2].tolist() == rows[1]
    assert expert_map.from_object(rows, moe_layers=[1, 2, 3], num_layers=4).per_layer[1].tolist() == rows[0]


def test_a_map_keyed_by_every_decoder_layer_takes_the_moe_layers_rows():
    # SGLang places experts per decoder layer: a layer-keyed map may name the dense layer (1) too, when the layer
    # count tells it is one; without the count it is refused, as a key past the layers always is.
    keyed = {"0": MAP, "1": list(range(P)), "2": MAP_L2}
    got = expert_map.from_object(keyed, moe_layers=LAYERS, physical_experts=P, num_layers=3, name="inline")
    want = expert_map.from_object({"0": MAP, "2": MAP_L2}, moe_layers=LAYERS, physical_experts=P, name="inline")
    assert got.per_layer.keys() == want.per_layer.keys()
    assert all(torch.equal(got.per_layer[la], want.per_layer[la]) for la in LAYERS)
    with pytest.raises(ExpertMapError, match=r"layer\(s\) \[1\] are not MoE layers of \[0, 2\]$"):
        expert_map.from_object(keyed, moe_layers=LAYERS, physical_experts=P, name="inline")
