"""Finding F7 (README): Megatron-Bridge 0.6.2 loads Qwen3-Next's / Qwen3.5's gated delta net output norm
(``linear_attn.norm.weight``, HF scales by ``w``) into Megatron's zero-centered norm as ``w - 1`` and exports
``(w - 1) + 1`` (``RMSNorm2ZeroCenteredRMSNormMapping``). In bf16, ``w - 1`` is exact only for ``w`` in
[0.5, 2^k): a trained weight below 0.5 (or negative) reaches Megatron, and comes back to the rollout engine,
rounded. Run through the real mapping on a built tiny Qwen3-Next (1 rank)."""

import torch

from moeverify.spec.layout import Layout


def _bf16_values() -> torch.Tensor:
    every = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    return every[torch.isfinite(every)]


def test_gdn_output_norm_round_trips_only_from_one_half_up(patched_megatron_world):
    from moeverify import models, runtime

    built = models.build("qwen3_next", Layout(), seed=0)
    runtime.import_bridge()
    from megatron.bridge.models.conversion.param_mapping import RMSNorm2ZeroCenteredRMSNormMapping

    name = "decoder.layers.0.self_attention.out_norm"
    module = next(m for n, m in built.model_chunks[0].named_modules() if n.endswith(name))
    mapping = RMSNorm2ZeroCenteredRMSNormMapping(f"{name}.weight", "model.layers.0.linear_attn.norm.weight")
    values = _bf16_values()
    values = values[(values.float().abs() < 64)]
    back = mapping.megatron_to_hf(mapping.hf_to_megatron(values, module), module)
    (exported,) = back.values()
    same = exported.view(torch.int16) == values.view(torch.int16)
    w = values.float()
    assert bool(same[(w >= 0.5) & (w < 2)].all())  # trained weights near 1 come back bit for bit
    lost = ~same
    assert int(lost[(w >= 0.25) & (w < 0.5)].sum()) == 64  # half of the bf16 values in [0.25, 0.5)
    assert int(lost[(w >= 0) & (w < 0.25)].sum()) > 15000 and bool(lost[(w < 0) & (w > -1)].any())
    i = int((values == torch.tensor(0.1001, dtype=torch.bfloat16)).nonzero()[0])
    assert exported[i].item() == torch.tensor(0.1016, dtype=torch.bfloat16).item()  # 0.1001 comes back 0.1016
