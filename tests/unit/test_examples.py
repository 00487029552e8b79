"""The integration examples (examples/*.py) run as shown in docs/router_replay.md and are right.

Each example's loop is run twice from the same weights: as written, and with replay taken out (a session
stand-in that records and replays nothing, so Megatron routes natively in the identical loop). With
unchanged weights the recorded routes are the native ones, so the parameters after the steps must be
bitwise equal; any difference is replay's doing. The docs show the examples' marked regions verbatim.
"""

from __future__ import annotations

import contextlib
import importlib.util
import re
from pathlib import Path

import pytest
import torch

from moeverify.patches import router_replay as rr

pytestmark = pytest.mark.usefixtures("patched_megatron_world")
ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "router_replay.md"
B, S, MB = 2, 8, 3


def example(name: str):
    spec = importlib.util.spec_from_file_location(f"example_{name}", ROOT / "examples" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def region(path: Path, tag: str) -> str:
    found = re.search(rf"^# \[doc:{tag}\]\n(.*?)^# \[/doc:{tag}\]\n", path.read_text(), re.S | re.M)
    assert found, f"{path.name}: no [doc:{tag}] region"
    return found.group(1).strip("\n")


@pytest.mark.parametrize(
    "name,tag", [("megatron_loop", "megatron-loop"), ("verl_step", "verl-step"), ("nemo_rl_r3_step", "r3-step")]
)
def test_docs_show_the_example_verbatim(name, tag):
    blocks = re.findall(rf"<!-- example: examples/{name}.py {tag} -->\n```python\n(.*?)```", DOC.read_text(), re.S)
    assert len(blocks) == 1, f"docs/router_replay.md: expected one block marked examples/{name}.py {tag}"
    assert blocks[0].strip("\n") == region(ROOT / "examples" / f"{name}.py", tag)


_REAL_SESSION = rr.ReplaySession


class NativeSession:
    """Replay taken out: the same loop, routed natively by Megatron."""

    def __init__(self, model_chunks, **_):
        self.real = _REAL_SESSION(model_chunks)
        self.num_experts, self.layers = self.real.num_experts, self.real.layers

    def record(self):
        return contextlib.nullcontext()

    def replay(self, routes):
        return contextlib.nullcontext()

    def routes(self):
        return None

    def check_consumed(self):
        pass


def params(chunks) -> dict:
    return {f"{i}.{n}": p.detach().clone() for i, c in enumerate(chunks) for n, p in c.named_parameters()}


def restore(chunks, state: dict) -> None:
    with torch.no_grad():
        for i, c in enumerate(chunks):
            for n, p in c.named_parameters():
                p.copy_(state[f"{i}.{n}"])


def replayed_vs_native(chunks, run, monkeypatch) -> tuple[dict, dict, int]:
    """Parameters after ``run()`` with replay, and after it routed natively, from the same start; recomputes."""
    start = params(chunks)
    recomputes = []
    hooks = [
        m.register_forward_hook(lambda *_: recomputes.append(torch._C._current_graph_task_id() != -1))
        for c in chunks
        for m in c.modules()
        if type(m).__name__ == "TopKRouter"
    ]
    try:
        run()
        replayed = params(chunks)
        restore(chunks, start)
        with monkeypatch.context() as m:
            m.setattr(rr, "ReplaySession", NativeSession)
            run()
        native = params(chunks)
    finally:
        for h in hooks:
            h.remove()
        restore(chunks, start)
    return replayed, native, sum(recomputes)


def assert_bitwise(replayed: dict, native: dict, where: str) -> None:
    moved = [n for n in native if not torch.equal(native[n], replayed[n])]
    assert not moved, f"{where}: parameters differ from native routing after the step: {moved[:4]}"


@pytest.fixture(scope="module")
def built(qwen3_moe_train):
    return qwen3_moe_train


def data(vocab: int, count: int, seed: int = 0) -> list:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (B, S), generator=g) for _ in range(count)]


def test_megatron_loop_with_full_recompute_equals_native_routing(built, monkeypatch):
    ex = example("megatron_loop")
    chunks = built.model_chunks
    config = chunks[0].config
    saved = config.recompute_granularity, config.recompute_method, config.recompute_num_layers
    config.recompute_granularity, config.recompute_method, config.recompute_num_layers = "full", "uniform", 1
    iterations = [data(built.config.vocab_size, MB, seed) for seed in (1, 2)]
    step = ex.lm_forward_step(torch.arange(S).expand(B, S))
    opt = torch.optim.SGD([p for c in chunks for p in c.parameters()], lr=1e-2)
    try:
        replayed, native, recomputes = replayed_vs_native(
            chunks, lambda: ex.train(chunks, opt, iterations, step, seq_len=S, micro_batch_size=B), monkeypatch
        )
    finally:
        config.recompute_granularity, config.recompute_method, config.recompute_num_layers = saved
    assert recomputes >= 2 * MB, f"full recompute ran {recomputes} router recomputes"
    assert_bitwise(replayed, native, "megatron_loop")


def test_verl_step_actor_and_reference_equals_native_routing(built, monkeypatch):
    from moeverify import models
    from moeverify.spec.layout import Layout

    ex = example("verl_step")
    actor = built.model_chunks[0]
    reference = models.build("qwen3_moe", Layout(), seed=1).model_chunks[0]
    reference.train()
    micro_batches = data(built.config.vocab_size, MB, seed=3)
    opt = torch.optim.SGD(actor.parameters(), lr=1e-2)
    ref_before = params([reference])
    replayed, native, _ = replayed_vs_native(
        [actor], lambda: ex.ppo_update(actor, reference, opt, micro_batches, torch.arange(S).expand(B, S)), monkeypatch
    )
    assert_bitwise(replayed, native, "verl_step")
    assert_bitwise(params([reference]), ref_before, "verl_step reference (must not change)")


def engine_routes(model, tokens_BS, lengths, *, rows_short: bool):
    """What a rollout engine running this very model returns: per request ``[len (- 1), L, K]`` native ids."""
    session = rr.ReplaySession(model)
    with torch.no_grad(), session.record():
        model(tokens_BS, torch.arange(S).expand_as(tokens_BS), None)
    routes = session.routes()  # router order: row s * B + b
    stacked_SBLK = torch.stack([routes.get(layer, 0).view(S, len(lengths), -1) for layer in routes.layers], dim=2)
    return [stacked_SBLK[: n - rows_short, b].numpy() for b, n in enumerate(lengths)], routes


def test_r3_step_with_the_engines_routes_equals_native_routing(built, monkeypatch):
    ex = example("nemo_rl_r3_step")
    model = built.model_chunks[0]
    requests = [t.tolist() for t in data(built.config.vocab_size, 1, seed=5)[0]]  # two full-length requests
    tokens_BS, _ = ex.padded_batch(requests, S)
    routed, _ = engine_routes(model, tokens_BS, [S, S], rows_short=False)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    layers = range(built.config.num_layers)
    replayed, native, _ = replayed_vs_native(
        [model], lambda: ex.r3_update(model, opt, requests, routed, moe_layers=layers, seq_len=S), monkeypatch
    )
    assert_bitwise(replayed, native, "nemo_rl_r3_step")


def test_r3_step_replays_the_engines_routes_on_every_token_it_returned(built, monkeypatch):
    # the drift below is far beyond a real job's (replay must follow the engine wherever native routing goes): the
    # agreement guard's chance floor, which session replay of an engine's routes runs by default, would refuse it
    monkeypatch.setenv("MOEVERIFY_AGREEMENT_FLOOR", "off")
    ex = example("nemo_rl_r3_step")
    model = built.model_chunks[0]
    lengths = [S, S - 2]
    requests = [t.tolist()[:n] for t, n in zip(data(built.config.vocab_size, 1, seed=6)[0], lengths, strict=True)]
    tokens_BS, _ = ex.padded_batch(requests, S)
    routed, _ = engine_routes(model, tokens_BS, lengths, rows_short=True)
    g = torch.Generator().manual_seed(9)
    with torch.no_grad():  # the training model has drifted from the engine: native routing would differ
        for m in model.modules():
            if type(m).__name__ == "TopKRouter":
                m.weight.add_(torch.randn(m.weight.shape, generator=g) * 3)
    used = {}

    def keep_forward_map(router, _args, out) -> None:  # the routing map of each router's forward call
        if torch._C._current_graph_task_id() == -1:
            used[router.layer_number - 1] = out[1].clone()

    hooks = [m.register_forward_hook(keep_forward_map) for m in model.modules() if type(m).__name__ == "TopKRouter"]
    start = params([model])
    try:
        ex.r3_update(
            model,
            torch.optim.SGD(model.parameters(), lr=0.0),
            requests,
            routed,
            moe_layers=range(built.config.num_layers),
            seq_len=S,
        )
    finally:
        for h in hooks:
            h.remove()
        restore([model], start)
    checked = 0
    for layer, map_TE in used.items():
        for b, n in enumerate(lengths):
            for s in range(n - 1):
                got = map_TE[s * len(lengths) + b].nonzero().flatten().tolist()
                assert got == sorted(routed[b][s, layer].tolist()), f"layer {layer} request {b} token {s}"
                checked += 1
    assert checked == len(used) * sum(n - 1 for n in lengths) and len(used) == built.config.num_layers
