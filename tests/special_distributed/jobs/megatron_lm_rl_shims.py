"""What Megatron-LM's training loop needs to start from megatron-core 0.19.2's wheel, and on CPU ranks.

megatron-core's own CUDA touch points are moeverify's CPU runtime's (``moeverify.runtime.cpu``); these are
Megatron-LM's ``megatron/training`` ones (shipped in the megatron-core wheel), each named with the line it stands
in for. ``install(backend)`` is called by the job before ``train_rl.py`` runs.
"""

from __future__ import annotations

import collections
import functools
import importlib.util

import torch


def _initialize_megatron_on_cpu(original):
    @functools.wraps(original)
    def initialize(*args, **kwargs):
        # initialize.py:66 asserts torch.cuda.is_available() unless allow_no_cuda; initialize.py:358 builds the
        # model-parallel groups and :447 seeds the model-parallel RNG tracker only where torch.cuda.device_count()
        # > 0. The world is already up (gloo), so the one device it then counts is never set or used.
        kwargs["allow_no_cuda"] = True
        count = torch.cuda.device_count
        torch.cuda.device_count = lambda: 1
        try:
            return original(*args, **kwargs)
        finally:
            torch.cuda.device_count = count

    return initialize


def _graphs_off_in_rollouts(rl_utils, original):
    @functools.wraps(original)
    def get_inference_interface(args, loop, model):
        # rl_utils.py:2155 megatron_rl_inference_mode writes cuda_graph_impl = "local" into the model's shared
        # TransformerConfig before every rollout, whatever --cuda-graph-impl says. With --cuda-graph-impl none the
        # layers were built without a CudaGraphManager (megatron/core/transformer/module.py:173) and
        # --inference-cuda-graph-scope none makes the engine capture nothing (dynamic_engine.py:422), so nothing is
        # captured; the drop-in reads the config and refuses. Called inside that block after the write: put it back.
        if args.cuda_graph_impl == "none" and str(args.inference_cuda_graph_scope).endswith("none"):
            model[0].config.cuda_graph_impl = "none"
        return original(args, loop, model)

    return get_inference_interface


def _fp32_output_dropped(original):
    @functools.wraps(original)
    def forward(self, *args, fp32_output=None, **kwargs):
        # rl_utils.py:814 get_logprobs passes fp32_output= to the model, which only megatron-core's Float16Module
        # (--bf16/--fp16) takes (transformer/module.py:477); an fp32 GPTModel refuses the keyword. Its output is
        # fp32 already.
        return original(self, *args, **kwargs)

    return forward


def install(backend: str, *, graphs_off_in_rollouts: bool = False) -> list[str]:
    """Apply the shims for ``backend``; returns one line per shim applied. ``graphs_off_in_rollouts``: keep the
    config's ``cuda_graph_impl`` at "none" in rollouts where nothing is captured (a workaround, off by default)."""
    from megatron.core.datasets import utils as dataset_utils  # lazy: megatron
    from megatron.core.models.gpt.gpt_model import GPTModel  # lazy: megatron
    from megatron.training import training  # lazy: megatron

    applied = []
    GPTModel.forward = _fp32_output_dropped(GPTModel.forward)
    applied.append("GPTModel.forward: takes fp32_output (an fp32 model's output is fp32)")
    if importlib.util.find_spec("megatron.core.datasets.helpers_cpp") is not None:
        # initialize.py:178 runs `make` in megatron/core/datasets, which the wheel ships compiled, without its
        # Makefile: make fails and compile_helpers exits the job. The compiled helper is there; nothing to build.
        dataset_utils.compile_helpers = lambda: None
        applied.append("compile_helpers: the wheel's compiled helpers_cpp")
    if backend == "cpu":
        training.initialize_megatron = _initialize_megatron_on_cpu(training.initialize_megatron)
        applied.append("initialize_megatron: allow_no_cuda, one device counted")
        # dynamic_engine.py:811 (suspend/resume after every rollout) reads "allocated_bytes.all.current" and
        # "reserved_bytes.all.current" from torch.cuda.memory_stats(), which is {} without CUDA: no bytes on a GPU.
        torch.cuda.memory_stats = lambda *args, **kwargs: collections.defaultdict(int)
        applied.append("torch.cuda.memory_stats: zero GPU bytes")
    if graphs_off_in_rollouts:
        from megatron.rl import rl_utils  # lazy: Megatron-LM

        rl_utils.get_inference_interface = _graphs_off_in_rollouts(rl_utils, rl_utils.get_inference_interface)
        applied.append("get_inference_interface: cuda_graph_impl kept 'none' in rollouts (nothing captures)")
    return applied
