"""The ``hf_parity`` check: the Megatron model the bridge built computes what the HF model computes.

``roundtrip`` and ``export`` prove that weights travel HF -> Megatron -> HF bit for bit. They cannot see a
conversion that is wrong both ways (a weight transposed on import and transposed back on export), a
config the bridge translates into other semantics (another routing score function), or a layer the CPU
path builds otherwise than the bridge means. This check runs the same tokens through both models, from the
same checkpoint, in fp32 on one rank, with transformers' eager attention as the independent reference:

- ``layers``: every decoder layer's output hidden states (residual stream) against the HF layer's; the
  first layer beyond tolerance is named, with its error, so a finding points at the layer that differs;
- ``logits``: the output logits of every token.

Tolerance: ``max|megatron - hf| <= RTOL * max|hf|`` per compared tensor. fp32 on CPU, the two
implementations differ by op order only (measured 3e-7 .. 5e-7 relative on every passing family); one
changed expert choice or a transposed weight moves a layer by 1e-2 .. 1 relative.
Runs at world size 1 (the scenario's layout must be the default one), Megatron on the run's backend and the
reference on CPU; the weights are upcast from the checkpoint's dtype exactly, so both models hold the same values.
Multi-token-prediction layers (``deepseek_v3_mtp``, ``qwen3_next_mtp``) are not compared: transformers 5.12.1's
models have no MTP module (it ignores the checkpoint's MTP tensors), so there is no reference for them; the decoder
layers and the logits are compared as for any family (Megatron's logits without labels are the main head's).
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from moeverify import models
from moeverify.oracles.results import Tally
from moeverify.spec.checks import CHECKS
from moeverify.spec.layout import Layout

RTOL = 1e-4
SUBCHECKS = CHECKS["hf_parity"].subchecks  # layers, logits (moeverify.spec.checks)
SEQ_LEN, BATCH = 32, 2  # longer than the tiny families' sliding windows (8)
_FP32 = dict(bf16=False, fp16=False)


def run(ctx) -> dict[str, Tally]:
    import torch  # lazy: torch

    tallies = {name: Tally() for name in SUBCHECKS}
    if ctx.world_size != 1 or ctx.scenario.layout != Layout():
        message = (
            f"hf_parity runs on one rank with the default layout; scenario {ctx.scenario.name} has "
            f"world size {ctx.world_size}: put hf_parity in a world_size 1 scenario"
        )
        for t in tallies.values():
            t.fail(message)
        return tallies
    built = models.build(
        ctx.scenario.model,
        ctx.scenario.layout,
        seed=ctx.scenario.seed,
        overrides=dict(_FP32, params_dtype=torch.float32, pipeline_dtype=torch.float32, autocast_dtype=torch.float32),
    )
    (model,) = built.model_chunks
    hf = _hf_model(built.hf_path)
    tokens_BS = torch.randint(
        3, built.config.vocab_size, (BATCH, SEQ_LEN), generator=torch.Generator().manual_seed(ctx.scenario.seed)
    )
    ours, theirs = _layer_outputs(model, hf, tokens_BS)
    _compare_layers(tallies["layers"], ours, theirs)
    _compare(tallies["logits"], "logits", ours["logits"], theirs["logits"])
    return tallies


def _hf_model(path):
    import torch  # lazy: torch
    import transformers  # lazy: transformers
    from safetensors.torch import save_file  # lazy: safetensors

    from moeverify.models import seeded  # lazy: torch

    with tempfile.TemporaryDirectory(prefix="moeverify-hf-parity-") as tmp:
        if seeded.is_seeded(path):  # weights made on demand: written out for transformers (hf_parity's tiny models)
            weights = seeded.SeededWeights(path)
            save_file(
                {name: weights.get_tensor(name) for name in weights.names()},
                f"{tmp}/model.safetensors",
                metadata={"format": "pt"},
            )
            (Path(tmp) / "config.json").write_text((Path(path) / "config.json").read_text())
            path = tmp
        model = transformers.AutoModelForCausalLM.from_pretrained(
            str(path), dtype=torch.float32, attn_implementation="eager"
        )
    return model.eval()


def _layer_outputs(model, hf, tokens_BS):
    """Per decoder layer hidden states ``[B, S, H]`` and the logits ``[B, S, V]`` of both models."""
    import torch  # lazy: torch

    ours: dict = {}
    theirs: dict = {}

    def keep(store, key, *, sbh: bool):
        def hook(_module, _args, out):
            out = out[0] if isinstance(out, tuple) else out
            store[key] = (out.transpose(0, 1) if sbh else out).detach().float().cpu()

        return hook

    inner = model.module if hasattr(model, "module") and not hasattr(model, "decoder") else model
    handles = [layer.register_forward_hook(keep(ours, i, sbh=True)) for i, layer in enumerate(inner.decoder.layers)]
    handles += [layer.register_forward_hook(keep(theirs, i, sbh=False)) for i, layer in enumerate(hf.model.layers)]
    try:
        model.eval()
        device = next(model.parameters()).device  # the HF reference runs on CPU; Megatron where it was built
        positions_BS = torch.arange(tokens_BS.shape[1]).expand_as(tokens_BS)
        with torch.no_grad():
            ours["logits"] = model(tokens_BS.to(device), positions_BS.to(device), None).float().cpu()
            theirs["logits"] = hf(input_ids=tokens_BS).logits.float()
    finally:
        for handle in handles:
            handle.remove()
    return ours, theirs


def _compare_layers(t: Tally, ours: dict, theirs: dict) -> None:
    layers = sorted(k for k in ours if k != "logits")
    if len(layers) != len([k for k in theirs if k != "logits"]):
        t.fail(f"decoder layers: Megatron ran {len(layers)}, HF ran {len(theirs) - 1}")
        return
    first = None
    for layer in layers:
        if not _compare(t, f"layer {layer}", ours[layer], theirs[layer]) and first is None:
            first = layer
    if first is not None:
        t.failures.insert(0, f"first divergent layer: {first} (global layer number, 0-based)")


def _compare(t: Tally, what: str, ours, theirs) -> bool:
    if ours.shape != theirs.shape:
        return t.check(False, f"{what}: shape {tuple(ours.shape)} (Megatron) != {tuple(theirs.shape)} (HF)")
    scale = theirs.abs().max().item()
    err = (ours - theirs).abs().max().item()
    return t.check(
        err <= RTOL * scale,
        f"{what}: max|Megatron - HF| {err:.3e} > {RTOL:g} x max|HF| "
        f"{scale:.3e} ({err / scale if scale else float('inf'):.2e} relative)",
    )
