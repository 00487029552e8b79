"""``dump diff --rollout`` and ``dump convert``: what a rollout array's layer axis holds (``--layer-numbering``).

A model of 3 decoder layers, layer 0 dense: the engine may write one column per MoE layer (2) or one per decoder
layer (3, the dense one included). Legend: N = positions, L = layer columns, K = top-k.
"""

import json

import numpy as np
import pytest
import torch

from moeverify import record
from moeverify.cli import main
from moeverify.routing.routes import Routes

S, B, K, E, MOE, NUM_LAYERS = 5, 2, 2, 8, (1, 2), 3


@pytest.fixture
def train(tmp_path):
    gen = torch.Generator().manual_seed(0)
    routes = Routes(
        {layer: [torch.rand(S * B, E, generator=gen).topk(K, dim=1).indices] for layer in MOE}, num_experts=E, topk=K
    )
    record.save(tmp_path / "train", routes, order="sequence", seq_len=S, batch=B, num_layers=NUM_LAYERS)
    per_router = [routes.stacked(0).numpy()[b * S : (b + 1) * S - 1] for b in range(B)]
    dense = np.random.default_rng(1).permutation(E)[:K]
    per_decoder = [np.concatenate([np.broadcast_to(dense, (r.shape[0], 1, K)), r], axis=1) for r in per_router]
    for name, arrays in (("routers", per_router), ("decoder", per_decoder)):
        np.savez(tmp_path / f"{name}.npz", **{f"r{i}": a for i, a in enumerate(arrays)})
    return tmp_path


def _diff(tmp_path, name, *extra):
    out = tmp_path / f"{name}.json"
    code = main(
        [
            "dump",
            "diff",
            str(tmp_path / "train"),
            str(tmp_path / f"{name}.npz"),
            "--rollout",
            "--json",
            str(out),
            "--fail-on-diff",
            *extra,
        ]
    )
    return code, (json.loads(out.read_text()) if code in (0, 1) else None)


@pytest.mark.parametrize(
    "name, numbering", [("routers", None), ("routers", "routers"), ("decoder", None), ("decoder", "decoder")]
)
def test_rollout_columns_read_by_their_numbering(train, name, numbering):
    code, report = _diff(train, name, *(["--layer-numbering", numbering] if numbering else []))
    assert code == 0 and report["rollout"]["compared_tokens"] == B * (S - 1)


def test_rollout_numbering_that_does_not_fit_refused(train, capsys):
    assert _diff(train, "decoder", "--layer-numbering", "routers")[0] == 2
    assert (
        "hold 3 layer column(s), not one per router: --layer-numbering routers needs 2 ([1, 2])"
        in capsys.readouterr().err
    )
    assert _diff(train, "routers", "--layer-numbering", "decoder")[0] == 2
    assert "not one per decoder layer: --layer-numbering decoder needs 3" in capsys.readouterr().err
    assert main(["dump", "diff", str(train / "train"), str(train / "train"), "--layer-numbering", "routers"]) == 2
    assert "--layer-numbering: does not apply: it says what a rollout's layer axis holds" in capsys.readouterr().err


def test_convert_takes_the_moe_columns_of_a_decoder_numbered_array(train, capsys):
    arr_NLK = np.concatenate([np.load(train / "decoder.npz")[f"r{b}"] for b in range(B)])
    np.save(train / "dec.npy", arr_NLK)
    assert (
        main(["dump", "convert", str(train / "dec.npy"), str(train / "d"), "--moe-layers", "1,2", "--num-layers", "3"])
        == 0
    )
    got = record.load(train / "d").routes()
    assert np.array_equal(got.get(2, 0).numpy(), arr_NLK[:, 2])
    # 3 columns for MoE layers [1, 2, 3] with --num-layers 3: one per router or one per decoder layer? refused
    assert (
        main(
            ["dump", "convert", str(train / "dec.npy"), str(train / "e"), "--moe-layers", "1,2,3", "--num-layers", "3"]
        )
        == 2
    )
    err = capsys.readouterr().err
    assert "3 layer columns fit two numberings" in err and not (train / "e").exists()
    assert "say which, --layer-numbering routers or --layer-numbering decoder" in err
    assert main(["dump", "convert", str(train / "dec.npy"), str(train / "f"), "--layer-numbering", "decoder"]) == 2
    assert "--layer-numbering decoder needs --moe-layers" in capsys.readouterr().err
