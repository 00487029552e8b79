"""The ``vllm`` receivers: the export loaded into a real vLLM, running as its own process (``moeverify.engines``).

The first ``load`` writes the streamed tensors as a checkpoint (the model's config beside them) and starts the engine
from it: vLLM's own first-load path. Every later ``load`` is a weight sync into the running engine the way RL
frameworks do it: the tensors pushed through ``model_runner.reload_weights`` with their HF names (``vllm``), or with
finding V2's workaround first (``vllm_repack``: docs/engines.md), then the prefix cache reset. After each load the
engine reads back every weight **as its kernels read it**, in the checkpoint's layout (``read_held`` in
``vllm_child.py``): tensors it keeps as they are; linear layers it packs into oneDNN handles applied to the identity
(exact in fp32); the CPU experts backend's packed experts unpacked with that backend's own layout. So experts held in
any other layout than the kernel reads (a reload that skipped the repacking) read back scrambled and fail bit for
bit. The held names (vLLM 0.32: ``...mlp.experts.routed_experts.w13_weight``) map onto the fused layout the ``fused``
receiver declares (``qkv_proj``, ``w13_weight`` per expert cat(gate, up), ``w2_weight``).

Needs the engine's python (``MOEVERIFY_VLLM_PYTHON``; ``make engine-setup``) and a model vLLM serves on this host
(CPU attention: head_dim 32 or more). vLLM's sleep mode is not supported on CPU: no ``sleep``/``wake_up`` here.
"""

from __future__ import annotations

import atexit
import json
import shutil
import tempfile
from collections.abc import Iterable
from pathlib import Path

import torch

from moeverify.engines import vllm_process
from moeverify.errors import UsageError
from moeverify.oracles.export.receiver import Held, fused_layout

LLM = {"max_model_len": 64, "enforce_eager": True, "block_size": 32}  # eager: finding V1
_VLLM_NAMES = ((".mlp.experts.routed_experts.", ".mlp.experts."),)  # vLLM 0.32's module path -> the fused layout's


class VllmReceiver:
    def __init__(self, *, hf_path, repack: bool, rank: int = 0) -> None:
        if hf_path is None or not (Path(hf_path) / "config.json").is_file():
            raise UsageError(
                f"receiver vllm: the model's config.json is needed to start the engine (hf_path {hf_path})"
            )
        self.hf_path = Path(hf_path)
        self.repack = repack
        self.dir = Path(tempfile.mkdtemp(prefix=f"moeverify-vllm-rank{rank}-"))
        self.engine: vllm_process.Engine | None = None
        self.loads = 0
        atexit.register(self.close)

    def load(self, stream: Iterable[tuple[str, torch.Tensor]]) -> Held:
        from safetensors.torch import load_file, save_file  # lazy: safetensors

        tensors = {name: t.detach().cpu().contiguous() for name, t in stream}
        self.loads += 1
        sent = self.dir / f"load{self.loads}.safetensors"
        save_file(tensors, str(sent))
        if self.engine is None:
            model = self.dir / "model"
            model.mkdir()
            for f in self.hf_path.iterdir():  # the config, generation config, tokenizer files: all but weights
                if f.is_file() and not f.name.endswith((".safetensors", ".bin", ".safetensors.index.json")):
                    shutil.copy(f, model / f.name)
            (model / "model.safetensors").hardlink_to(sent)
            config = json.loads((self.hf_path / "config.json").read_text())
            dtype = config.get("dtype") or config.get("torch_dtype") or "auto"  # vLLM's "auto" serves fp32 as bf16
            self.engine = vllm_process.Engine(model, workdir=self.dir / "engine", llm=dict(LLM, dtype=dtype))
        else:
            self.engine.step({"op": "reload_weights", "file": str(sent), "repack": self.repack})
        self.engine.step({"op": "reset_prefix_cache"})  # finding V3: a sync keeps the cache
        read = self.dir / f"held{self.loads}.safetensors"
        report = self.engine.step({"op": "read_held", "file": str(read)})
        held = load_file(str(read))
        for name in report["unread"]:
            held.pop(name, None)
        return _as_held(held, {n: (tuple(t.shape), t.dtype) for n, t in tensors.items()})

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()
            self.engine = None
        shutil.rmtree(self.dir, ignore_errors=True)


def _as_held(engine: dict[str, torch.Tensor], shapes: dict) -> Held:
    """The engine's tensors under the fused layout's names, each with the HF parts it is made of."""
    tensors = {}
    for name, t in engine.items():
        for theirs, ours in _VLLM_NAMES:
            name = name.replace(theirs, ours)
        tensors[name] = t
    _, parts = fused_layout(shapes)
    return Held(tensors=tensors, parts={n: p for n, p in parts.items() if n in tensors})


def vllm(*, hf_path=None, rank: int = 0, **_options) -> VllmReceiver:
    """A running vLLM, synced with ``reload_weights`` as vLLM offers it."""
    return VllmReceiver(hf_path=hf_path, repack=False, rank=rank)


def vllm_repack(*, hf_path=None, rank: int = 0, **_options) -> VllmReceiver:
    """A running vLLM, synced with finding V2's workaround (each MoE layer's kernel forgotten before the reload)."""
    return VllmReceiver(hf_path=hf_path, repack=True, rank=rank)
