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
        use_cpu_initialization=True,
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


def test_an_expert_form_override_is_refused_where_the_bridge_cannot_load_it():
    """``replay_experts: grouped`` (``moe_grouped_gemm`` overridden) builds a form the bridge maps, never one it
    does not, and never SequentialMLP with expert biases; each refusal names the model and the parameters."""
    from moeverify.models.builder import _check_expert_form

    provider = NS(num_moe_experts=8, moe_layer_freq=[0, 1, 1, 1], num_layers=4, add_bias_linear=False)
    both = _Registry(["local_experts.0", "weight0"])
    for grouped in (True, False):
        _check_expert_form(NS(**vars(provider), moe_grouped_gemm=grouped), "f", both)
    with pytest.raises(
        UsageError,
        match=r"f: routed experts built grouped .*maps no decoder\.layers\.1\.mlp\.experts"
        r"\.linear_fc1\.weight0",
    ):
        _check_expert_form(NS(**vars(provider), moe_grouped_gemm=True), "f", _Registry(["local_experts.0"]))
    with pytest.raises(UsageError, match=r"f: routed experts built as SequentialMLP .*local_experts\.0"):
        _check_expert_form(NS(**vars(provider), moe_grouped_gemm=False), "f", _Registry(["weight0"]))
    with pytest.raises(UsageError, match=r"f: routed experts with biases built as SequentialMLP"):
        _check_expert_form(NS(**vars(provider) | {"add_bias_linear": True}, moe_grouped_gemm=False), "f", both)


def test_replay_experts_grouped_builds_grouped_unless_a_later_setting_says_otherwise():
    from moeverify.oracles.replay.setup import build_settings
    from moeverify.spec.checks import ReplayOptions
    from moeverify.spec.router_variants import select

    variant = select(None)[0]
    auto = build_settings(ReplayOptions.from_options({}), variant, {})
    grouped = build_settings(ReplayOptions.from_options({"replay_experts": "grouped"}), variant, {})
    assert "moe_grouped_gemm" not in auto and grouped["moe_grouped_gemm"] is True
    assert (
        build_settings(
            ReplayOptions.from_options({"replay_experts": "grouped"}), variant, {}, {"moe_grouped_gemm": False}
        )["moe_grouped_gemm"]
        is False
    )
    with pytest.raises(Exception, match="replay_experts"):
        ReplayOptions.from_options({"replay_experts": "sequential"})


def test_grouped_experts_give_the_logits_of_sequential_experts(patched_megatron_world):
    """The same checkpoint built with TEGroupedMLP over the CPU grouped linears and with megatron-core's
    SequentialMLP: the bridge loads the same weights into both, and a forward gives the same logits."""
    from megatron.core.transformer.moe.experts import SequentialMLP, TEGroupedMLP

    from moeverify import models

    logits = {}
    for grouped in (False, True):
        built = models.build("qwen3_moe", Layout(), seed=0, overrides={"moe_grouped_gemm": grouped})
        (model,) = built.model_chunks
        device = next(model.parameters()).device  # the test backend's (MOEVERIFY_TEST_BACKEND=cuda: the GPU)
        tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0)).to(device)
        position_ids = torch.arange(16, device=device).expand(2, 16)
        experts = [m for m in model.modules() if isinstance(m, (SequentialMLP, TEGroupedMLP))]
        assert experts and all(isinstance(m, TEGroupedMLP if grouped else SequentialMLP) for m in experts)
        with torch.no_grad():
            logits[grouped] = model.eval()(tokens, position_ids, None)
    assert torch.equal(logits[True], logits[False])  # bitwise: the same per-expert matmuls on the same tokens


sm90 = pytest.mark.skipif(
    not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)),
    reason="one grouped GEMM serves the experts on an H100/H200 in bf16 (MOEVERIFY_TEST_BACKEND=cuda)",
)


def _experts_step(layer, x_TI, m_splits):
    """Output, input gradient and weight gradients of one forward + backward of ``layer``."""
    x_TI = x_TI.detach().clone().requires_grad_()
    layer.zero_grad(set_to_none=True)
    out_TO, _ = layer(x_TI, m_splits)
    (out_TO.float() * torch.linspace(-1, 1, out_TO.numel(), device=out_TO.device).view_as(out_TO)).sum().backward()
    return out_TO.detach(), x_TI.grad, [p.grad for p in layer.parameters()]


@sm90
def test_grouped_gemm_is_the_per_expert_loop_and_repeats_bitwise():
    """The grouped GEMM (bf16 on sm90) gives each expert's ``x_i @ weight_i.T`` and its gradients (bf16 rounding
    apart, against the per-expert loop it replaces), experts with no token included, and repeats bit for bit."""
    from moeverify.models import grouped_linear as gl

    torch.manual_seed(0)
    layer = CpuColumnParallelGroupedLinear(
        8,
        256,
        384,
        config=_config(),
        init_method=None,
        bias=False,
        skip_bias_add=False,
        is_expert=True,
        pg_collection=NS(expt_tp=None, tp=None),
    ).to("cuda", torch.bfloat16)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, 0.05)
    m_splits = [5, 0, 17, 1, 0, 40, 3, 62]  # experts 1 and 4 get no token
    x_TI = torch.randn(sum(m_splits), 256, device="cuda", dtype=torch.bfloat16)
    assert gl._one_grouped_gemm(x_TI, 256, 384, 8)
    first, again = _experts_step(layer, x_TI, m_splits), _experts_step(layer, x_TI, m_splits)
    for a, b in zip([first[0], first[1], *first[2]], [again[0], again[1], *again[2]], strict=True):
        assert torch.equal(a, b)  # one pass repeats bit for bit: the replay check compares passes bitwise
    original = gl._one_grouped_gemm
    gl._one_grouped_gemm = lambda *args: False  # the per-expert loop
    try:
        loop = _experts_step(layer, x_TI, m_splits)
    finally:
        gl._one_grouped_gemm = original
    for got, want in zip([first[0], first[1], *first[2]], [loop[0], loop[1], *loop[2]], strict=True):
        torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)
    assert not first[2][1].any() and not first[2][4].any()  # no token: no gradient
