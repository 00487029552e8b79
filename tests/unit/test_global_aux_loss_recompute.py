"""Finding F6 (README): megatron-core 0.19.2's ``global_aux_loss`` under full recompute depends on the backward
order. The router averages tokens per expert over the forwards run with grad in the step; under full recompute
the first forward runs without grad and the recompute, in backward order, is the forward that counts. A loop
with every forward first and a reverse backward (hand-written gradient accumulation) so gets other router
grads with recompute than without. Pinned on the tiny Qwen3-Next (whose bridge sets ``global_aux_loss``), with
the aux loss off as the control: then recompute changes nothing, bit for bit."""

import pytest
import torch

from moeverify.spec.layout import Layout


def _grads_reverse_loop(chunk, batches, *, recompute: bool) -> dict[str, torch.Tensor]:
    import contextlib

    from moeverify.oracles.replay import toggles
    from moeverify.oracles.replay.drive import _new_step

    with toggles.recompute([chunk], "full") if recompute else contextlib.nullcontext():
        _new_step([chunk])
        losses = [chunk(tokens, torch.arange(tokens.shape[1])[None], None).float().pow(2).mean() for tokens in batches]
        for loss in reversed(losses):
            loss.backward()
    return {n: p.grad.clone() for n, p in chunk.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("aux_coeff", [None, 0.0])
def test_global_aux_loss_router_grads_change_under_full_recompute(patched_megatron_world, aux_coeff):
    from moeverify import models

    overrides = dict(
        bf16=False, params_dtype=torch.float32, pipeline_dtype=torch.float32, hidden_dropout=0.0, attention_dropout=0.0
    )
    if aux_coeff is not None:
        overrides["moe_aux_loss_coeff"] = aux_coeff
    built = models.build("qwen3_next", Layout(), seed=0, overrides=overrides)
    (chunk,) = built.model_chunks
    chunk.train()
    assert built.config.moe_router_load_balancing_type == "global_aux_loss"
    gen = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, 256, (1, 16), generator=gen) for _ in range(2)]
    plain = _grads_reverse_loop(chunk, batches, recompute=False)
    recomputed = _grads_reverse_loop(chunk, batches, recompute=True)
    routers = [n for n in plain if n.endswith("mlp.router.weight")]
    assert len(routers) == 4
    differ = [n for n in routers if not torch.equal(plain[n], recomputed[n])]
    if aux_coeff is None:
        assert differ == routers  # every router's grad moved with the aux loss's running average
    else:
        assert differ == [] and all(torch.equal(plain[n], recomputed[n]) for n in plain)
