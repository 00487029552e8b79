"""The replay plugin contract (docs/replay_plugins.md): the recording plugin of ``examples/`` is shown verbatim, lays
each log-prob pass out by sequence at any batch size with nothing hard-coded (decided by ``views.token_index``, the
layout math the dump format is tested on), and runs as a ``--replay-impl`` plugin; ``PassGeometry`` names the
positions a rank's routers see under CP and SP as ``views.sequence_positions`` does, and refuses what is not one."""

from __future__ import annotations

import dataclasses
import re
import types
from pathlib import Path

import pytest
import torch
from test_examples import example, region

from moeverify.errors import UsageError
from moeverify.oracles.replay import drive as rd
from moeverify.oracles.replay.impls import PassGeometry
from moeverify.routing import views
from moeverify.spec.layout import Layout

pytestmark = pytest.mark.usefixtures("patched_megatron_world")
ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "replay_plugins.md"
S, M = 8, 2


def test_replay_plugins_doc_shows_the_example_verbatim():
    blocks = re.findall(
        r"<!-- example: examples/recording_replay_plugin.py recording-plugin -->\n```python\n(.*?)```",
        DOC.read_text(),
        re.S,
    )
    assert len(blocks) == 1, "docs/replay_plugins.md: expected one block marked recording-plugin"
    assert blocks[0].strip("\n") == region(ROOT / "examples" / "recording_replay_plugin.py", "recording-plugin")


@pytest.fixture(scope="module")
def qwen3_moe_chunks(patched_megatron_world):
    from moeverify import models

    return models.build("qwen3_moe", Layout(), seed=0).model_chunks


@pytest.mark.parametrize("batch", [2, 3])
def test_recording_plugin_lays_routes_out_by_sequence_at_any_batch(qwen3_moe_chunks, batch):
    plugin = example("recording_replay_plugin").factory()
    plugin.apply()
    plugin.bind(qwen3_moe_chunks)
    batches = rd.Batches(seq_len=S, batch=batch, microbatches=M, dp=1, vocab_size=64, seed=1)
    items = rd.local_microbatches(batches, Layout(), dp_rank=0, cp_rank=0)
    routes = rd.record_pass(qwen3_moe_chunks, items, seq_len=S, impl=plugin).routes
    g_T = views.token_index(Layout(), tp_rank=0, cp_rank=0, seq_len=S, batch=batch)  # row i is token b * S + s
    assert plugin.geometry == PassGeometry(
        seq_len=S, batch=batch, microbatches=M, positions=tuple(range(S)), forward_only=True
    )
    assert len(plugin.by_sequence) == M and plugin.layers == list(routes.layers)
    for mb, laid_BSLK in enumerate(plugin.by_sequence):
        assert tuple(laid_BSLK.shape) == (batch, S, len(routes.layers), routes.topk)
        for l, layer in enumerate(routes.layers):
            ids_TK = routes.get(layer, mb)
            for i in range(ids_TK.shape[0]):
                b, s = divmod(int(g_T[i]), S)
                assert torch.equal(laid_BSLK[b, s, l], ids_TK[i]), (mb, layer, i)


def test_recording_plugin_runs_as_a_replay_implementation():
    from test_replay_minimal_mutants import _run

    tallies = _run("unused", ["equivalence"], replay_impl="examples/recording_replay_plugin.py:factory")
    assert tallies["equivalence"].passed and tallies["equivalence"].checked > 0, tallies["equivalence"].failures[:3]


def test_pass_geometry_positions_under_cp_and_sp(monkeypatch):
    from megatron.core import parallel_state

    batches = rd.Batches(seq_len=S, batch=2, microbatches=1, dp=1, vocab_size=64)
    items = rd.local_microbatches(batches, Layout(cp=2), dp_rank=0, cp_rank=1)
    plain = types.SimpleNamespace(config=types.SimpleNamespace(sequence_parallel=False))
    got = rd.geometry([plain], items, seq_len=S, forward_only=False)
    cp = views.sequence_positions(Layout(cp=2), tp_rank=0, cp_rank=1, seq_len=S)
    assert got.positions == tuple(cp.tolist()) and got.tokens == 2 * len(cp)
    monkeypatch.setattr(parallel_state, "get_tensor_model_parallel_world_size", lambda: 2)
    monkeypatch.setattr(parallel_state, "get_tensor_model_parallel_rank", lambda: 1)
    sp = types.SimpleNamespace(config=types.SimpleNamespace(sequence_parallel=True))
    got = rd.geometry([sp], items, seq_len=S, forward_only=False)
    want = views.sequence_positions(Layout(tp=2, sp=True, cp=2), tp_rank=1, cp_rank=1, seq_len=S)
    assert got.positions == tuple(want.tolist())


def test_pass_geometry_refuses_what_is_not_one():
    good = PassGeometry(seq_len=4, batch=2, microbatches=1, positions=(0, 1, 2, 3), forward_only=True)
    with pytest.raises(UsageError, match=r"positions \[0, 4\] outside 0 \.\. 3"):
        dataclasses.replace(good, positions=(0, 4))
    with pytest.raises(UsageError, match="batch 0, microbatches 1 and 4 position"):
        dataclasses.replace(good, batch=0)
    with pytest.raises(UsageError, match=r"routes of shape \(7, 2\), expected \[T=8, K\]"):
        good.by_sequence(torch.zeros(7, 2, dtype=torch.int64))
    assert torch.equal(
        good.by_sequence(torch.arange(8).view(8, 1))[:, :, 0], torch.tensor([[0, 2, 4, 6], [1, 3, 5, 7]])
    )
