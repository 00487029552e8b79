"""``--model DIR`` with real safetensors weights: what Megatron-Bridge could not read on the ranks is refused when
the model is read, before any rank starts (headers only)."""

from __future__ import annotations

import json
import shutil
import struct

import pytest

from moeverify import cli
from moeverify.errors import UsageError
from moeverify.models import families
from moeverify.spec.models import user


@pytest.fixture
def weights_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("MOEVERIFY_CACHE_DIR", str(tmp_path / "cache"))
    shutil.copytree(families.hf_checkpoint("qwen3_moe", seed=0), tmp_path / "mine")
    user._READ.clear()
    return tmp_path / "mine"


def _names(path) -> list[str]:
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    return [k for k in json.loads(data[8 : 8 + n]) if k != "__metadata__"]


def _index(directory, weight_map) -> None:
    (directory / user.INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def test_an_index_that_matches_its_shards_is_read(weights_dir):
    _index(weights_dir, dict.fromkeys(_names(weights_dir / "model.safetensors"), "model.safetensors"))
    assert user.read(weights_dir).weights_dir == weights_dir.resolve()


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (
            lambda wm: wm.update({"model.layers.7.mlp.gate.weight": "model.safetensors"}),
            r"^--model: .*model\.safetensors\.index\.json: weight_map names 'model\.layers\.7\.mlp\.gate\.weight' in "
            r"model\.safetensors, which does not hold it: expected it in the file's header, which lists \d+ tensors "
            r"\('lm_head\.weight', ",
        ),
        (
            lambda wm: wm.update({"lm_head.weight": "model-00002-of-00002.safetensors"}),
            r"weight_map names 'lm_head\.weight' in 'model-00002-of-00002\.safetensors', which is not a file in ",
        ),
        (lambda wm: wm.update({"lm_head.weight": "../model.safetensors"}), r"which is not a file in "),
        (lambda wm: wm.update({"lm_head.weight": 3}), r"expected a JSON object whose \"weight_map\" maps each tensor"),
        (lambda wm: wm.clear(), r"expected a JSON object whose \"weight_map\""),
    ],
)
def test_an_index_naming_what_no_shard_holds_is_refused(weights_dir, change, match):
    weight_map = dict.fromkeys(_names(weights_dir / "model.safetensors"), "model.safetensors")
    change(weight_map)
    _index(weights_dir, weight_map)
    with pytest.raises(UsageError, match=match):
        user.read(weights_dir)


@pytest.mark.parametrize(
    ("write", "match"),
    [
        (lambda d: (d / user.INDEX).write_text("{nope"), r"model\.safetensors\.index\.json: not valid JSON"),
        (lambda d: (d / user.INDEX).write_text("[1]"), r"expected a JSON object whose \"weight_map\""),
        (lambda d: (d / "model.safetensors").write_bytes(b"\x05"), r"model\.safetensors: not a safetensors file"),
        (
            lambda d: (d / "model.safetensors").write_bytes(struct.pack("<Q", 1 << 40) + b"{}"),
            r"not a safetensors file",
        ),
        (lambda d: (d / "model.safetensors").write_bytes(struct.pack("<Q", 4) + b"nope"), r"its header is not JSON"),
    ],
)
def test_unreadable_indexes_and_headers_are_refused(weights_dir, write, match):
    write(weights_dir)
    with pytest.raises(UsageError, match=match):
        user.read(weights_dir)


def test_run_refuses_the_index_before_any_rank_starts(weights_dir, tmp_path, capsys, monkeypatch):
    from moeverify.runner import launch

    def no_launch(*args, **kwargs):
        raise AssertionError("a group was launched")

    monkeypatch.setattr(launch, "run_group", no_launch)
    weight_map = dict.fromkeys(_names(weights_dir / "model.safetensors"), "model.safetensors")
    weight_map["model.norm.bias"] = "model.safetensors"
    _index(weights_dir, weight_map)
    (tmp_path / "s.yaml").write_text("scenarios:\n  - {model: mine, world_size: 1, checks: [roundtrip]}\n")
    code = cli.main(["run", str(tmp_path / "s.yaml"), "--backend", "cpu"])
    err = capsys.readouterr().err
    assert code == 2 and "weight_map names 'model.norm.bias' in model.safetensors, which does not hold it" in err, err
    assert "Traceback" not in err
