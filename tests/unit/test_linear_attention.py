"""The CPU gated delta net's torch kernels and zero-centered norm against independent references
(moeverify/models/linear_attention.py, norms.ZeroCenteredRMSNorm); the whole layer is checked against
transformers' Qwen3-Next/Qwen3.5 by hf_parity in scenarios/families_ci.yaml."""

import pytest
import torch

from moeverify.errors import UsageError
from moeverify.models import linear_attention as la
from moeverify.models.norms import ZeroCenteredRMSNorm


def test_causal_conv1d_sees_only_the_last_width_tokens_then_silu():
    gen = torch.Generator().manual_seed(0)
    x_BSD = torch.randn(2, 7, 5, generator=gen)
    w_DW, bias_D = torch.randn(5, 3, generator=gen), torch.randn(5, generator=gen)
    y_BSD, state = la.causal_conv1d(x_BSD, w_DW, bias_D, activation="silu")
    want = torch.empty_like(x_BSD)
    for t in range(7):  # token by token: weight[:, -1] meets x[t], weight[:, -2] x[t-1], zeros before the start
        acc = bias_D.clone()
        for i in range(3):
            if t - i >= 0:
                acc = acc + w_DW[:, 2 - i] * x_BSD[:, t - i]
        want[:, t] = torch.nn.functional.silu(acc)
    torch.testing.assert_close(y_BSD, want, rtol=1e-6, atol=1e-6)
    assert state is None


def test_causal_conv1d_refuses_packed_sequences_and_state():
    x, w = torch.randn(1, 4, 2), torch.randn(2, 3)
    with pytest.raises(UsageError, match="no packed sequences"):
        la.causal_conv1d(x, w, activation="silu", cu_seqlens=torch.tensor([0, 4]))
    with pytest.raises(ValueError, match="activation 'gelu'"):
        la.causal_conv1d(x, w, activation="gelu")


def test_l2norm_unit_rows_in_input_dtype():
    x = torch.randn(3, 4, 16, dtype=torch.bfloat16)
    y = la.l2norm(x)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.float().norm(dim=-1), torch.ones(3, 4), rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(
        la.l2norm(x.float()), torch.nn.functional.normalize(x.float(), dim=-1, eps=0), rtol=1e-5, atol=1e-6
    )


def test_torch_kernels_are_scoped_to_the_cpu_module():
    from megatron.core.ssm.gated_delta_net import common, gdn

    before = (common.HAVE_FLA, common.l2norm, gdn.causal_conv1d)
    with la._torch_kernels():
        assert (common.HAVE_FLA, common.l2norm, gdn.causal_conv1d) == (True, la.l2norm, la.causal_conv1d)
    assert (common.HAVE_FLA, common.l2norm, gdn.causal_conv1d) == before


def test_zero_centered_rms_norm_is_qwen3_nexts_hf_norm():
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextRMSNorm

    hf = Qwen3NextRMSNorm(16, eps=1e-6)
    ours = ZeroCenteredRMSNorm(16, eps=1e-6, dtype=torch.float32)
    with torch.no_grad():
        weight = 0.1 * torch.randn(16)
        hf.weight.copy_(weight)
        ours.weight.copy_(weight)
    x = torch.randn(3, 5, 16, dtype=torch.bfloat16)
    assert torch.equal(ours(x), hf(x))
