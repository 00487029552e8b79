"""Grouped expert linears for ``TEGroupedMLP`` without Transformer Engine (every CPU rank, GPU nodes without TE).

Several Megatron-Bridge 0.6.2 bridges (GLM-4.5, MiniMax-M2, OLMoE) map routed experts for grouped GEMM only:
``decoder.layers.*.mlp.experts.linear_fc1.weight*``, the per-expert parameters ``weight0 .. weight{E-1}`` of
TE's ``GroupedLinear``. Building those experts as ``SequentialMLP`` (megatron-core's local spec) would leave
them unmapped, so these families could not be verified at all. This module rebuilds what the bridge converts:
megatron-core 0.19.2's own ``TEGroupedMLP`` (its forward, activation, probs and bias handling unchanged) over
two small grouped linears whose parameters are laid out as TE's are:
- ``CpuColumnParallelGroupedLinear`` (fc1): ``weight{i}`` of shape ``[out / tp, in]``, split on dim 0;
- ``CpuRowParallelGroupedLinear`` (fc2): ``weight{i}`` of shape ``[out, in / tp]``, split on dim 1;
- ``bias{i}`` beside each weight when the config has linear biases (split with fc1's rows, whole for fc2).

``tp`` is the expert tensor-parallel group for experts. As with TE under expert parallelism (megatron-core's
``TEGroupedLinear``: ``explicit_expert_comm``), the linears do no communication: the token dispatcher gathers
and reduce-scatters around them. Each expert is a plain ``x_i @ weight_i.T`` on its slice of the permuted
tokens (on an H100/H200 in bf16, one ``torch._grouped_mm`` for all of them each way: ``_GroupedGemm``).
Parameter attributes follow megatron-core's ``TEGroupedLinear`` (``allreduce`` is false for experts on the expert
groups, ``tensor_model_parallel``/``partition_dim``/``partition_stride``), so gradient reduction and the bridge's
parallelism detection (registered by class name, ``AutoMapping.register_module_type``) treat them as they treat
TE's (``local_spec._register_with_bridge``).
Legend: T = tokens routed to this rank's experts, I = input features, O = output features (this rank's).
"""

from __future__ import annotations

import functools

import torch
from megatron.core.tensor_parallel.random import get_cuda_rng_tracker, get_expert_parallel_rng_tracker_name
from megatron.core.transformer.moe.experts import GroupedMLPSubmodules, TEGroupedMLP


class _CpuGroupedLinear(torch.nn.Module):
    """One linear per local expert, applied to consecutive token slices (``m_splits``)."""

    partition_dim: int  # 0 for column-parallel, 1 for row-parallel

    def __init__(
        self,
        num_gemms: int,
        input_size: int,
        output_size: int,
        /,
        *,
        config,
        init_method,
        bias: bool,
        skip_bias_add: bool,
        is_expert: bool,
        tp_comm_buffer_name=None,
        pg_collection=None,
        name=None,
    ):
        super().__init__()
        if pg_collection is None:
            raise ValueError(
                f"{type(self).__name__}: pg_collection is required (megatron-core 0.19's TEGroupedMLP passes it)"
            )
        group = pg_collection.expt_tp if is_expert else pg_collection.tp
        tp_size = group.size() if group is not None else 1
        split = output_size if self.partition_dim == 0 else input_size
        if split % tp_size:
            raise ValueError(
                f"{type(self).__name__} {name or ''}: size {split} is not divisible by the "
                f"{'expert ' if is_expert else ''}tensor-parallel size {tp_size}"
            )
        self.num_gemms = num_gemms
        self.in_features = input_size // tp_size if self.partition_dim == 1 else input_size
        self.out_features = output_size // tp_size if self.partition_dim == 0 else output_size
        self.use_bias = bias
        self.skip_bias_add = skip_bias_add
        self.is_expert = is_expert
        # Attributes megatron-core's TEGroupedMLP reads on the fused path only (never taken without TE).
        self.single_grouped_weight = self.single_grouped_bias = False
        self.delay_wgrad_compute = self.fuse_wgrad_accumulation = False
        # megatron-core 0.19.2 TEGroupedLinear: experts use the expert groups (EDP grads) under EP, or where
        # the expert TP size differs from TP.
        expert_pgs = is_expert and (
            config.expert_model_parallel_size > 1
            or config.expert_tensor_parallel_size != config.tensor_model_parallel_size
        )
        # where megatron-core's own linears allocate: on the GPU unless the config asks for CPU initialization (a
        # host copy of every expert would be held until the model moves, the whole model's experts at once)
        device = "cpu" if config.use_cpu_initialization else torch.cuda.current_device()
        for i in range(num_gemms):
            weight = torch.nn.Parameter(
                torch.empty(self.out_features, self.in_features, dtype=config.params_dtype, device=device)
            )
            self._init(weight, init_method, config, is_expert)
            self._mark(weight, partitioned=True, expert_pgs=expert_pgs)
            self.register_parameter(f"weight{i}", weight)
            if bias:
                bias_i = torch.nn.Parameter(torch.zeros(self.out_features, dtype=config.params_dtype, device=device))
                self._mark(bias_i, partitioned=self.partition_dim == 0, expert_pgs=expert_pgs)
                self.register_parameter(f"bias{i}", bias_i)

    @staticmethod
    def _init(weight, init_method, config, is_expert: bool) -> None:
        if not config.perform_initialization:
            return
        tracker = get_cuda_rng_tracker()
        if is_expert and get_expert_parallel_rng_tracker_name() in tracker.get_states():
            with tracker.fork(get_expert_parallel_rng_tracker_name()):
                init_method(weight)
        else:
            init_method(weight)

    def _mark(self, param, *, partitioned: bool, expert_pgs: bool) -> None:
        # As megatron-core 0.19.2's _set_expert_parameter_attributes marks TE's grouped parameters.
        param.allreduce = not expert_pgs
        param.tensor_model_parallel = partitioned
        if partitioned:
            param.partition_dim = self.partition_dim
            param.partition_stride = 1

    def forward(self, x_TI: torch.Tensor, m_splits: list[int], /):
        if len(m_splits) != self.num_gemms or sum(m_splits) != x_TI.shape[0]:
            raise ValueError(
                f"{type(self).__name__}: m_splits {list(m_splits)} do not fit {self.num_gemms} experts "
                f"and {x_TI.shape[0]} tokens"
            )
        if not self.use_bias and _one_grouped_gemm(x_TI, self.in_features, self.out_features, self.num_gemms):
            weights = [getattr(self, f"weight{i}") for i in range(self.num_gemms)]
            empty = tuple(i for i, m in enumerate(m_splits) if not m)
            return _GroupedGemm.apply(x_TI, _offsets(m_splits, x_TI.device), empty, *weights), None
        outs, biases = [], []
        for i, x_i in enumerate(torch.split(x_TI, list(m_splits))):
            out_i = torch.matmul(x_i, getattr(self, f"weight{i}").t())
            if self.use_bias and not self.skip_bias_add:
                out_i = out_i + getattr(self, f"bias{i}")
            outs.append(out_i)
            if self.use_bias:
                biases.append(getattr(self, f"bias{i}"))
        out_TO = torch.cat(outs) if outs else x_TI.new_empty(0, self.out_features)
        return out_TO, (biases if self.use_bias and self.skip_bias_add else None)

    def backward_dw(self) -> None:
        """Delayed weight gradients are a TE feature; nothing is delayed here."""


def _one_grouped_gemm(x_TI: torch.Tensor, in_features: int, out_features: int, num_gemms: int) -> bool:
    """Whether one ``torch._grouped_mm`` serves every expert: a CUDA device of compute capability 9.0 (its
    bf16 grouped GEMM), bf16, rows of 16-byte multiples; elsewhere one ``matmul`` per expert.

    Version assumption: ``torch._grouped_mm(a, b, offs=)`` as torch 2.8-2.14 have it (a private op: 2D x 3D groups
    the rows of ``a``, 2D x 2D groups the shared dimension; ``offs`` int32 end offsets); measured with torch
    2.11.0+cu130 on an H100. A torch without it takes the loop; one whose op changed raises in the forward."""
    return (
        x_TI.is_cuda
        and x_TI.dtype == torch.bfloat16
        and num_gemms > 1
        and x_TI.shape[0] > 0
        and in_features % 8 == 0
        and out_features % 8 == 0
        and hasattr(torch, "_grouped_mm")
        and torch.cuda.get_device_capability(x_TI.device) == (9, 0)
    )


def _offsets(m_splits: list[int], device: torch.device) -> torch.Tensor:
    """Each expert's end row in the permuted tokens (``torch._grouped_mm``'s ``offs``): int32 on the device."""
    ends, total = [], 0
    for m in m_splits:
        total += int(m)
        ends.append(total)
    return torch.tensor(ends, dtype=torch.int32).to(device, non_blocking=True)


class _GroupedGemm(torch.autograd.Function):
    """``out_i = x_i @ weight_i.T`` for every expert ``i`` in one grouped GEMM each way.

    The weights are stacked for the call and again in the backward (a ``[G, O, I]`` copy at a time, never
    kept across the pass: keeping it would hold every layer's experts twice until its backward); the weight
    gradients come out of one grouped GEMM over the token dimension and are handed to each ``weight{i}`` (zero for
    an expert given no token). A pass repeats bit for bit (``tests/unit/test_grouped_linear.py`` on an H100; the
    replay check's bitwise comparisons of Qwen3-30B-A3B's width at 16 layers passed with it)."""

    @staticmethod
    def forward(ctx, x_TI, offs, empty, *weights):
        ctx.empty = empty  # experts given no token: their weight gradient is zero, not what a GEMM of no rows left
        ctx.save_for_backward(x_TI, offs, *weights)
        stacked_GIO = torch.stack(weights).transpose(1, 2)
        return torch._grouped_mm(x_TI, stacked_GIO, offs=offs)

    @staticmethod
    def backward(ctx, grad_TO):
        x_TI, offs, *weights = ctx.saved_tensors
        grad_TO = grad_TO.contiguous()
        grad_x = None
        if ctx.needs_input_grad[0]:
            grad_x = torch._grouped_mm(grad_TO, torch.stack(weights), offs=offs)
        grads_w = [None] * len(weights)
        if any(ctx.needs_input_grad[3:]):
            grad_GOI = torch._grouped_mm(grad_TO.t(), x_TI, offs=offs)
            if ctx.empty:
                grad_GOI[list(ctx.empty)] = 0
            grads_w = list(grad_GOI.unbind(0))
        return grad_x, None, None, *grads_w


class CpuColumnParallelGroupedLinear(_CpuGroupedLinear):
    """Grouped fc1: output features split across the (expert) tensor-parallel group."""

    partition_dim = 0


class CpuRowParallelGroupedLinear(_CpuGroupedLinear):
    """Grouped fc2: input features split across the (expert) tensor-parallel group."""

    partition_dim = 1


def grouped_experts_spec():
    """``TEGroupedMLP`` (megatron-core 0.19.2) over the CPU grouped linears, as the experts of a ``MoELayer``."""

    return functools.partial(
        TEGroupedMLP,
        submodules=GroupedMLPSubmodules(
            linear_fc1=CpuColumnParallelGroupedLinear, linear_fc2=CpuRowParallelGroupedLinear
        ),
    )
