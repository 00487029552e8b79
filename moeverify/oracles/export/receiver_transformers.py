"""The ``transformers`` receiver: the export loaded by transformers' own model class, as a rollout engine built
on it would (``from_pretrained`` on CPU, the dtype of the HF config), and its ``state_dict`` read back.

It catches what transformers' loader does to an export: dtype casts to the config's dtype, tied embeddings
(``lm_head.weight`` held as the embedding when the export sends none), per-expert tensors fused into
``experts.gate_up_proj`` ``[E, 2I, H]`` (per expert cat(gate, up)) and ``experts.down_proj`` ``[E, H, I]``, and
tensors the model has no place for (the reference tensors no part covers: ``dropped``)."""

from __future__ import annotations

import re
import shutil
import tempfile
from collections.abc import Iterable
from pathlib import Path

import torch

from moeverify.errors import UsageError
from moeverify.oracles.export.receiver import Held, Part

_FUSED = re.compile(r"^(?P<pre>.*\.experts)\.(?P<which>gate_up_proj|down_proj)$")


def parts_of(state: dict[str, torch.Tensor], sent: set[str], *, tied: bool) -> dict[str, tuple[Part, ...]]:
    """Engine name -> HF parts for transformers' state dict ``state`` loaded from the HF names ``sent``."""
    parts: dict[str, tuple[Part, ...]] = {}
    for name, tensor in state.items():
        m = _FUSED.match(name)
        if m and f"{m['pre']}.0.down_proj.weight" in sent:
            n_experts = tensor.shape[0]
            if m["which"] == "down_proj":
                parts[name] = tuple(Part(hf_name=f"{m['pre']}.{e}.down_proj.weight", index=e) for e in range(n_experts))
            else:
                half = tensor.shape[1] // 2
                parts[name] = tuple(
                    Part(hf_name=f"{m['pre']}.{e}.{w}_proj.weight", index=e, start=i * half, length=half)
                    for e in range(n_experts)
                    for i, w in enumerate(("gate", "up"))
                )
        elif name == "lm_head.weight" and tied and name not in sent:
            parts[name] = (Part(hf_name="model.embed_tokens.weight"),)
        else:
            parts[name] = (Part(hf_name=name),)
    return parts


class TransformersReceiver:
    def __init__(self, hf_path: Path) -> None:
        self.config = Path(hf_path) / "config.json"
        if not self.config.is_file():
            raise UsageError(f"receiver transformers: no HF config at {self.config}")

    def load(self, stream: Iterable[tuple[str, torch.Tensor]]) -> Held:
        import safetensors.torch  # lazy: safetensors
        from transformers import AutoModelForCausalLM  # lazy: transformers

        folder = Path(tempfile.mkdtemp(prefix="moeverify-receiver-"))
        try:
            shutil.copyfile(self.config, folder / "config.json")
            sent = {n: t.detach().cpu().contiguous() for n, t in stream}  # save_file only reads them
            safetensors.torch.save_file(sent, str(folder / "model.safetensors"), metadata={"format": "pt"})
            names = set(sent)
            del sent  # the model loads from the file: the stream's tensors are not held beside it
            model = AutoModelForCausalLM.from_pretrained(folder, dtype="auto")
        finally:
            shutil.rmtree(folder, ignore_errors=True)
        state = {n: t.detach() for n, t in model.state_dict().items()}
        tied = bool(getattr(model.config.get_text_config(), "tie_word_embeddings", False))
        return Held(tensors=state, parts=parts_of(state, names, tied=tied))


def transformers_receiver(*, hf_path: Path, **_options) -> TransformersReceiver:
    """The built-in ``transformers`` receiver."""
    return TransformersReceiver(hf_path)


__all__ = ["TransformersReceiver", "parts_of", "transformers_receiver"]
