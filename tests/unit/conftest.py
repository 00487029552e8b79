"""Shared unit-test fixtures."""

import os
import sys

import pytest
import torch

from moeverify.spec.layout import Layout


@pytest.fixture(scope="module")
def patched_megatron_world():
    """A 1-rank world with megatron's parallel state set and the router-replay patch applied.

    cpu+gloo; ``MOEVERIFY_TEST_BACKEND=cuda`` runs the tests that support it on one GPU (NCCL, deterministic
    kernels), as docs/gpu/ records."""
    from moeverify import runtime
    from moeverify.patches import router_replay as rr

    backend = os.environ.get("MOEVERIFY_TEST_BACKEND", "cpu")
    if backend == "cuda":
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
    runtime.init(backend)
    with runtime.parallel(Layout(), seed=0):
        rr.apply()
        try:
            yield
        finally:
            rr.revert()


@pytest.fixture(scope="module")
def qwen3_moe_train(patched_megatron_world):
    """A tiny Qwen3-MoE built on the patched 1-rank world, in train mode (the model of the training-loop tests)."""
    from moeverify import models

    built = models.build("qwen3_moe", Layout(), seed=0)
    for chunk in built.model_chunks:
        chunk.train()
    return built


@pytest.fixture(autouse=True)
def _fresh_aux_loss_scale():
    """megatron-core 0.19.2 keeps the aux-loss gradient scale on a class (``MoEAuxLossAutoScaler.
    main_loss_backward_scale``): a backward outside Megatron's schedule makes it a 0-d tensor, and a later schedule's
    ``set_loss_scale`` copies a [1] tensor into it and raises. One process runs many tests: each starts unset, as a
    fresh trainer process does."""
    yield
    moe_utils = sys.modules.get("megatron.core.transformer.moe.moe_utils")  # only when a test imported megatron
    if moe_utils is not None:
        moe_utils.MoEAuxLossAutoScaler.main_loss_backward_scale = None
