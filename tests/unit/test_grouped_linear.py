"""The CPU grouped expert linears (``TEGroupedMLP``'s fc1/fc2 without Transformer Engine) and the builder's
choice between them and ``SequentialMLP``."""

from types import SimpleNamespace as NS

import pytest
import torch

from moeverify.errors import UsageError
from moeverify.models.grouped_linear import CpuColumnParallelGroupedLinear, CpuRowParallelGroupedLinear
from moeverify.spec.layout import Layout


def _config(*, ep=1, etp=1, tp=1):
    return NS(
        params_dtype=torch.float32,
        perform_initialization=False,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp,
        tensor_model_parallel_size=tp,
    )


def _linear(cls, *, bias=False, skip_bias_add=False, experts=3, ep=1):
    layer = cls(
        experts,
        8,
        6,
        config=_config(ep=ep),
        init_method=None,
        bias=bias,
        skip_bias_add=skip_bias_add,
        is_expert=True,
        pg_collection=NS(expt_tp=None, tp=None),
    )
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in layer.parameters():
            param.copy_(torch.randn(param.shape, generator=gen))
    return layer


@pytest.mark.parametrize("bias", [False, True])
def test_grouped_linear_applies_each_expert_to_its_own_tokens(bias):
    layer = _linear(CpuColumnParallelGroupedLinear, bias=bias)
    splits = [3, 0, 5]
    x_TI = torch.randn(8, 8, generator=torch.Generator().manual_seed(1))
    out_TO, out_bias = layer(x_TI, splits)
    owner = [0] * 3 + [2] * 5  # the expert of each token, from the splits
    for t, e in enumerate(owner):  # token by token, against the expert's own weight
        want = x_TI[t] @ getattr(layer, f"weight{e}").t() + (getattr(layer, f"bias{e}") if bias else 0)
        torch.testing.assert_close(out_TO[t], want, rtol=1e-6, atol=1e-6)
    assert out_bias is None and out_TO.shape == (8, 6)


def test_grouped_linear_returns_biases_apart_with_skip_bias_add():
    layer = _linear(CpuRowParallelGroupedLinear, bias=True, skip_bias_add=True)
    x_TI = torch.randn(4, 8)
    out_TO, biases = layer(x_TI, [1, 1, 2])
    assert [b is getattr(layer, f"bias{i}") for i, b in enumerate(biases)] == [True] * 3
    torch.testing.assert_close(out_TO[0], x_TI[0] @ layer.weight0.t())


def test_grouped_linear_parameters_are_laid_out_as_transformer_engines():
    fc1 = _linear(CpuColumnParallelGroupedLinear, bias=True, ep=2)
    fc2 = _linear(CpuRowParallelGroupedLinear, bias=True, ep=2)
    assert [n for n, _ in fc1.named_parameters()] == ["weight0", "bias0", "weight1", "bias1", "weight2", "bias2"]
    assert fc1.weight0.shape == (6, 8) and fc2.weight0.shape == (6, 8)
    # under EP the expert grads reduce over expert-DP (allreduce False); fc1 splits rows, fc2 columns
    assert (fc1.weight0.allreduce, fc1.weight0.partition_dim, fc1.bias0.tensor_model_parallel) == (False, 0, True)
    assert (fc2.weight0.partition_dim, fc2.bias0.tensor_model_parallel) == (1, False)
    assert _linear(CpuColumnParallelGroupedLinear).weight0.allreduce is True


def test_grouped_linear_refuses_splits_that_do_not_fit():
    layer = _linear(CpuColumnParallelGroupedLinear)
    with pytest.raises(ValueError, match=r"m_splits \[2, 2\] do not fit 3 experts and 4 tokens"):
        layer(torch.randn(4, 8), [2, 2])
    with pytest.raises(ValueError, match=r"m_splits \[1, 1, 1\] do not fit 3 experts and 4 tokens"):
        layer(torch.randn(4, 8), [1, 1, 1])


class _Registry:
    def __init__(self, mapped):
        self.mapped = mapped

    def megatron_to_hf_lookup(self, name):
        return "hf" if any(m in name for m in self.mapped) else None


def test_builder_builds_grouped_experts_only_where_the_bridge_maps_them_for_grouped_gemm_alone():
    from moeverify.models.builder import cpu_grouped_experts

    provider = NS(num_moe_experts=8, moe_layer_freq=[0, 1, 1, 1], num_layers=4, add_bias_linear=False)
    assert cpu_grouped_experts(provider, "f", _Registry(["local_experts.0", "weight0"])) is False
    assert cpu_grouped_experts(provider, "f", _Registry(["weight0"])) is True
    biased = NS(**vars(provider) | {"add_bias_linear": True})  # SequentialMLP with biases fails in backward
    assert cpu_grouped_experts(biased, "f", _Registry(["local_experts.0", "weight0"])) is True
    assert cpu_grouped_experts(biased, "f", _Registry(["local_experts.0"])) is False
    with pytest.raises(
        UsageError,
        match=r"f: Megatron-Bridge maps its routed experts neither as SequentialMLP "
        r"\(no mapping for decoder\.layers\.1\.mlp\.experts\.local_experts\.0\."
        r"linear_fc1\.weight.*nor as grouped GEMM \(no mapping for "
        r"decoder\.layers\.1\.mlp\.experts\.linear_fc1\.weight0",
    ):
        cpu_grouped_experts(provider, "f", _Registry([]))


def test_grouped_experts_give_the_logits_of_sequential_experts(patched_megatron_world):
    """The same checkpoint built with TEGroupedMLP over the CPU grouped linears and with megatron-core's
    SequentialMLP: the bridge loads the same weights into both, and a forward gives the same logits."""
    from megatron.core.transformer.moe.experts import SequentialMLP, TEGroupedMLP

    from moeverify import models

    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    position_ids = torch.arange(16).expand(2, 16)
    logits = {}
    for grouped in (False, True):
        built = models.build("qwen3_moe", Layout(), seed=0, overrides={"moe_grouped_gemm": grouped})
        (model,) = built.model_chunks
        experts = [m for m in model.modules() if isinstance(m, (SequentialMLP, TEGroupedMLP))]
        assert experts and all(isinstance(m, TEGroupedMLP if grouped else SequentialMLP) for m in experts)
        with torch.no_grad():
            logits[grouped] = model.eval()(tokens, position_ids, None)
    assert torch.equal(logits[True], logits[False])  # bitwise: the same per-expert matmuls on the same tokens
