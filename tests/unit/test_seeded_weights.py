"""Seeded weights made per tensor on demand (``moeverify.models.seeded``): the names, shapes and dtypes
``save_pretrained`` writes, values that depend on (seed, name) alone, and the readers that use them."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from waiting import CHILD_S

from moeverify.errors import MoEVerifyError
from moeverify.models import FAMILIES, seeded
from moeverify.models.checkpoint import checkpoint_shapes, open_tensors
from moeverify.models.families import hf_checkpoint, hf_config_dict, saved_specs


def _written(family: str) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    files = sorted(hf_checkpoint(family).glob("*.safetensors"))
    assert files, family
    out = {}
    for path in files:
        with safe_open(str(path), "pt") as f:
            for name in f.keys():
                t = f.get_slice(name)
                out[name] = (
                    tuple(t.get_shape()),
                    getattr(torch, {"BF16": "bfloat16", "F32": "float32"}[t.get_dtype()]),
                )
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_names_shapes_and_dtypes_are_what_save_pretrained_writes(family):
    """Every family, tied embeddings, fused experts, fp32 expert bias and MTP tensors included."""
    assert saved_specs(hf_config_dict(family)) == _written(family)


@pytest.fixture
def seeded_dir(tmp_path):
    cfg = hf_config_dict("qwen3_moe")
    return seeded.make(tmp_path / "m", 3, describe=lambda to: saved_specs(cfg, config_to=to))


def test_a_tensor_depends_on_seed_and_name_only(seeded_dir, tmp_path):
    a, b = seeded.SeededWeights(seeded_dir), seeded.SeededWeights(seeded_dir)
    names = a.names()
    assert len(names) > 20
    first = {n: a.get_tensor(n) for n in names[:5]}
    for name in reversed(names[:5]):  # another reader, another order: the same bits
        assert torch.equal(
            b.get_tensor(name).view(torch.int16 if first[name].dtype == torch.bfloat16 else torch.int32),
            first[name].view(torch.int16 if first[name].dtype == torch.bfloat16 else torch.int32),
        )
    other = seeded.make(
        tmp_path / "other", 4, describe=lambda to: saved_specs(hf_config_dict("qwen3_moe"), config_to=to)
    )
    assert not torch.equal(seeded.SeededWeights(other).get_tensor(names[0]), first[names[0]])
    assert not torch.equal(a.get_tensor(names[1]).flatten()[:8].float(), first[names[0]].flatten()[:8].float())


def test_shapes_and_dtypes_match_the_specs_and_readers_agree(seeded_dir):
    weights = seeded.SeededWeights(seeded_dir)
    specs = saved_specs(hf_config_dict("qwen3_moe"))
    assert checkpoint_shapes(seeded_dir) == {n: s for n, (s, _) in specs.items()}
    reader = open_tensors(seeded_dir)
    assert sorted(reader.names()) == sorted(specs)
    for name, (shape, dtype) in specs.items():
        t = reader.get_tensor(name)
        assert (tuple(t.shape), t.dtype) == (shape, dtype), name
    assert torch.equal(reader.get_tensor("model.norm.weight"), weights.get_tensor("model.norm.weight"))
    assert not list(seeded_dir.glob("*.safetensors"))  # no weights file, ever


def test_a_marker_of_another_recipe_is_refused_naming_the_file(seeded_dir):
    marker = seeded_dir / seeded.MARKER
    data = json.loads(marker.read_text())
    marker.write_text(json.dumps({**data, "recipe": "per-tensor-0"}))
    with pytest.raises(
        MoEVerifyError,
        match=r"moeverify-seeded\.json: seeded-weights recipe 'per-tensor-0', "
        r"expected 'per-tensor-2'",
    ):
        seeded.SeededWeights(seeded_dir)
    marker.write_text("{not json")
    with pytest.raises(MoEVerifyError, match="unreadable seeded-weights marker"):
        seeded.SeededWeights(seeded_dir)


def test_an_unknown_name_is_a_key_error(seeded_dir):
    with pytest.raises(KeyError, match="no seeded tensor 'model.nope'"):
        seeded.SeededWeights(seeded_dir).get_tensor("model.nope")


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3_mtp", "qwen2_tied", "kimi_k2"])
def test_config_files_are_what_save_pretrained_writes(family, tmp_path):
    """The bridge builds its params in the config's ``dtype``: the file must carry it as save_pretrained does."""
    saved_specs(hf_config_dict(family), config_to=tmp_path)
    written = hf_checkpoint(family)
    for name in ("config.json", "generation_config.json"):
        assert json.loads((tmp_path / name).read_text()) == json.loads((written / name).read_text()), name
    assert json.loads((tmp_path / "config.json").read_text())["dtype"] == "bfloat16"


def test_a_config_without_a_dtype_is_written_with_the_stored_one(tmp_path):
    """A production config.json may carry no dtype: save_pretrained records the dtype it stored (bf16)."""
    cfg = {k: v for k, v in hf_config_dict("qwen3_moe").items() if k not in ("dtype", "torch_dtype")}
    saved_specs(cfg, config_to=tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["dtype"] == "bfloat16"


@pytest.mark.parametrize("numel", [1, 5, (1 << 22) + 3])
def test_noise_cpu_and_gpu_paths_equal_the_reference_bit_for_bit(numel):
    """The numpy path (CPU) and the torch int64 path (run on the GPU; here on the CPU, and on the GPU when the test
    backend is cuda) are the same function: both equal the pure-Python reference at sampled elements and each other
    everywhere."""
    import os

    import numpy as np

    from moeverify.models.seeded import _noise_torch, noise, noise_reference, tensor_seed

    key = tensor_seed(7, "model.layers.0.mlp.gate.weight")
    cpu = noise(key, numel)
    device = torch.device("cuda" if os.environ.get("MOEVERIFY_TEST_BACKEND") == "cuda" else "cpu")
    other = _noise_torch(key, numel, device).cpu()
    assert cpu.dtype == other.dtype == torch.float32 and cpu.shape == other.shape == (numel,)
    assert torch.equal(cpu.view(torch.int32), other.view(torch.int32))
    picks = sorted({0, numel // 2, numel - 1, min(numel - 1, 1 << 22)})
    assert [np.float32(cpu[i].item()) for i in picks] == [np.float32(noise_reference(key, i)) for i in picks]
    if numel > 1000:
        assert abs(cpu.mean().item()) < 0.01 and abs(cpu.std().item() - 1) < 0.01
        assert cpu.abs().max().item() < 3**0.5


@pytest.mark.timing
def test_noise_in_a_forked_child_does_not_wait_on_the_parents_threads():
    """The CPU path runs blocks on a thread pool; a child forked after the parent used it must make its own."""
    import multiprocessing

    from moeverify.models.seeded import noise

    big = (1 << 22) * 2 + 1  # more than one block: the pool is used
    parent = noise(11, big)
    ctx = multiprocessing.get_context("fork")
    with ctx.Pool(1) as pool:
        child = pool.apply_async(_child_noise, (11, big)).get(timeout=CHILD_S)
    assert child == parent[-4:].tolist()


def _child_noise(key: int, numel: int) -> list[float]:
    from moeverify.models.seeded import noise

    return noise(key, numel)[-4:].tolist()
