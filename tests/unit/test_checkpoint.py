"""The one HF checkpoint reader: the index's weight_map when there is one, else the files' own headers."""

import json

import pytest
import torch
from safetensors.torch import save_file

from moeverify.errors import MoEVerifyError
from moeverify.models.checkpoint import checkpoint_shapes, tensor_files


def test_tensor_files_single_file_lists_its_tensors(tmp_path):
    save_file({"a": torch.zeros(2, 3), "b": torch.zeros(4)}, str(tmp_path / "model.safetensors"))
    assert tensor_files(tmp_path) == {"a": tmp_path / "model.safetensors", "b": tmp_path / "model.safetensors"}
    assert checkpoint_shapes(tmp_path) == {"a": (2, 3), "b": (4,)}


def test_tensor_files_index_weight_map_decides(tmp_path):
    save_file({"a": torch.zeros(2)}, str(tmp_path / "model-00001-of-00002.safetensors"))
    save_file({"b": torch.zeros(1, 5)}, str(tmp_path / "model-00002-of-00002.safetensors"))
    weight_map = {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    assert tensor_files(tmp_path) == {name: tmp_path / f for name, f in weight_map.items()}
    assert checkpoint_shapes(str(tmp_path)) == {"a": (2,), "b": (1, 5)}


def test_tensor_files_empty_directory_refused(tmp_path):
    with pytest.raises(MoEVerifyError, match="no model.safetensors.index.json and no \\*.safetensors file"):
        tensor_files(tmp_path)


def test_tensor_reader_reads_every_tensor_bitwise_as_safe_open_does(tmp_path):
    from safetensors import safe_open

    from moeverify.models.checkpoint import TensorReader

    gen = torch.Generator().manual_seed(0)
    tensors = {
        "a": torch.randn(3, 5, generator=gen).to(torch.bfloat16),
        "b": torch.randn(7, generator=gen),
        "c": torch.arange(6, dtype=torch.int64).reshape(2, 3),
        "empty": torch.zeros(0, 4, dtype=torch.float16),
    }
    path = tmp_path / "model.safetensors"
    save_file(tensors, str(path))
    reader = TensorReader(path)
    try:
        with safe_open(str(path), "pt") as f:
            for name in tensors:
                got, want = reader.get_tensor(name), f.get_tensor(name)
                assert got.dtype == want.dtype and got.shape == want.shape, name
                assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), name
    finally:
        reader.close()
    path.write_bytes(path.read_bytes()[:-8])  # the last tensor's bytes cut short
    reader = TensorReader(path)
    try:
        last = max(tensors, key=lambda n: reader._header[n]["data_offsets"][1] if n in reader._header else -1)
        with pytest.raises(MoEVerifyError, match=f"{last!r} ends past the end of the file"):
            reader.get_tensor(last)
    finally:
        reader.close()
