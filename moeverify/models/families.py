"""Tiny HF model families made in code: seeded weights, safetensors checkpoints in a cache dir (their configs:
``configs.py``, re-exported here).

No hub access. For a given (family, seed) the checkpoint bytes are deterministic. Weights are stored
in bf16 like real checkpoints, except DeepSeek-V3's ``e_score_correction_bias``, which real checkpoints
keep in fp32 (a tiny model stored all-bf16 would hide fp32 bugs).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from moeverify import files
from moeverify.models import mtp_weights, seeded
from moeverify.models.seeded import seeded_value
from moeverify.runtime import dtypes
from moeverify.spec.models import kimi, user
from moeverify.spec.models.configs import (
    FAMILIES,
    check_family,
    family_shape,
    family_traits,
    hf_config_dict,
    prepare_hook,
)
from moeverify.spec.models.ref import PREFIX, ModelRef

if TYPE_CHECKING:  # annotations only: transformers is imported where a model is built
    from transformers import PreTrainedModel

__all__ = [
    "FAMILIES",
    "cache_dir",
    "family_shape",
    "family_traits",
    "hf_checkpoint",
    "hf_config_dict",
    "seeded_value",
    "written_checkpoint",
]


def cache_dir() -> Path:
    """Where seeded checkpoints are written: ``models/`` of ``MOEVERIFY_CACHE_DIR`` (else ``~/.cache/moeverify``),
    created here; ``UsageError`` naming the variable when it cannot be."""
    return files.cache_dir("models")


def _fingerprint(cfg: dict, seed: int) -> str:
    import transformers  # lazy: transformers

    versions = [_WEIGHTS_VERSION] + ([mtp_weights.RECIPE_VERSION] if mtp_weights.mtp_depth(cfg) else [])
    blob = json.dumps([cfg, seed, transformers.__version__, *versions], sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


_WEIGHTS_VERSION = 1  # bump when the weight recipe below changes


def _seeded_weights(model: torch.nn.Module, seed: int) -> None:
    """Overwrite every parameter and float buffer with seeded values (independent of HF's init order)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, tensor in sorted(list(model.named_parameters()) + list(model.named_buffers())):
            if not tensor.is_floating_point() or "rotary" in name or "inv_freq" in name:
                continue
            noise = torch.randn(tensor.shape, generator=gen, dtype=torch.float32)
            value = seeded_value(name, noise)
            tensor.copy_(value.to(tensor.dtype))


def _fp32_expert_bias(model: torch.nn.Module) -> None:
    """Real DeepSeek-V3 checkpoints keep the router's correction bias in fp32 (a buffer; Ernie-4.5's is a parameter)."""
    for module in model.modules():
        bias = getattr(module, "e_score_correction_bias", None)
        if isinstance(bias, torch.nn.Parameter):
            module.e_score_correction_bias = torch.nn.Parameter(
                bias.detach().to(torch.float32), requires_grad=bias.requires_grad
            )
        elif isinstance(bias, torch.Tensor):
            module.e_score_correction_bias = bias.to(torch.float32)


def _hf_model(cfg: dict) -> PreTrainedModel:
    """transformers' model of ``cfg`` in its stored dtype (on the current default device: ``meta`` for names and
    shapes only), the expert-correction bias in fp32 as real checkpoints keep it."""
    import transformers  # lazy: transformers

    if (prepare := prepare_hook(cfg)) is not None:
        prepare()  # e.g. transformers 5.12.1 has no kimi_k2: the in-code config (kimi.py)
    config = transformers.AutoConfig.for_model(**{k: v for k, v in cfg.items() if k != "architectures"})
    config.architectures = cfg["architectures"]
    model_cls = kimi.model_class(cfg["architectures"][0])
    stored = cfg.get("dtype") or cfg.get("torch_dtype")
    dtype = dtypes.BY_NAME.get(stored) if isinstance(stored, str) else None
    if dtype not in (torch.float32, torch.float16, torch.bfloat16):  # the float dtype the config names, else bf16
        dtype = torch.bfloat16
    # Built in the stored dtype, not in fp32 then cast: every saved tensor is overwritten by _seeded_weights, so
    # the file is the same, without a transient fp32 copy of the whole model (2x its bytes; docs/memory.md).
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        model = model_cls(config)
    finally:
        torch.set_default_dtype(previous)
    model = model.to(dtype)
    _fp32_expert_bias(model)
    return model


def _write_checkpoint(cfg: dict, seed: int, dst: Path) -> None:
    torch.manual_seed(seed)
    model = _hf_model(cfg)
    _seeded_weights(model, seed)
    model.save_pretrained(dst, safe_serialization=True)
    mtp_weights.add_mtp_tensors(cfg, seed, dst, value=seeded_value)  # transformers' models hold no MTP layers


def saved_specs(cfg: dict, config_to: Path | None = None) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """``{name: (shape, dtype)}`` of every tensor ``save_pretrained`` (and the MTP recipe) would write for
    ``cfg``, from the model built on the ``meta`` device: no memory, no file (transformers 5.12.1's three saving
    steps: ignored keys dropped, tied duplicates removed, fused weights converted back to the checkpoint's names).
    With ``config_to``, the config files ``save_pretrained`` writes are written there (``dtype`` included)."""
    from transformers.core_model_loading import revert_weight_conversion  # lazy: transformers
    from transformers.modeling_utils import remove_tied_weights_from_state_dict  # lazy: transformers

    with torch.device("meta"):
        model = _hf_model(cfg)
    if config_to is not None:  # as save_pretrained writes them: the stored dtype and the class name recorded
        model.config.dtype = str(model.dtype).split(".")[1]
        model.config.architectures = [type(model).__name__]
        model.config.save_pretrained(config_to)
        if model.can_generate():
            model.generation_config.save_pretrained(config_to)
    state = model.state_dict()
    for key in model._keys_to_ignore_on_save or ():
        state.pop(key, None)
    params = dict(model.named_parameters(remove_duplicate=False))
    kept = remove_tied_weights_from_state_dict({k: v for k, v in state.items() if k in params}, model)
    state = {k: v for k, v in state.items() if k in kept or k not in params}  # buffers (the expert bias) stay
    saved = {name: (tuple(t.shape), t.dtype) for name, t in revert_weight_conversion(model, state).items()}
    saved.update(mtp_weights.mtp_specs(cfg, saved))
    return saved


def hf_checkpoint(model: str | ModelRef, seed: int = 0) -> Path:
    """Path of the HF checkpoint of ``model`` (a family by name or reference, or a user model's reference;
    created once, atomically, in the cache dir).

    A user model with real weights is its own directory; one without gets seeded weights like a family.
    """
    ref = check_family(model)
    cfg = hf_config_dict(ref)
    if ref.is_user:
        real = user.load(ref).weights_dir
        if real is not None:
            return real
    label = ref.key.removeprefix(PREFIX).replace("+", "-")
    dst = cache_dir() / f"{label}-seed{seed}-{_fingerprint(cfg, seed)}"
    if ref.is_user:  # a config alone: its weights are made per tensor when read (no file)
        return seeded.make(
            dst.with_name(dst.name + "-" + seeded.RECIPE), seed, describe=lambda to: saved_specs(cfg, config_to=to)
        )
    return _written(cfg, seed, dst)


def written_checkpoint(family: str, seed: int = 0, **changes) -> Path:
    """A family's checkpoint with ``changes`` to its config (e.g. ``head_dim=32, dtype="float32"`` for an engine
    whose kernels refuse the family's shape), written to files like a family's (a rollout engine reads files,
    never weights made when read), once per config and seed, in the cache dir."""
    cfg = dict(hf_config_dict(check_family(family)), **changes)
    changed = "-".join(f"{k}{v}" for k, v in sorted(changes.items()))
    return _written(cfg, seed, cache_dir() / f"{family}-{changed}-seed{seed}-{_fingerprint(cfg, seed)}")


def _written(cfg: dict, seed: int, dst: Path) -> Path:
    if (dst / "config.json").exists():
        return dst
    tmp = files.cache_tempdir(dst.parent, prefix=f".{dst.name}.")
    try:
        _write_checkpoint(cfg, seed, tmp)
        try:
            os.rename(tmp, dst)  # atomic; another rank may have won the race, which is fine
        except OSError:
            if not (dst / "config.json").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dst
