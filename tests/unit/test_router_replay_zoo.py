"""Router replay inside ordinary training loops on a real tiny Qwen3-MoE (1 CPU rank): the loop shapes of RL jobs.

Each case records the routes natively (no grad), replays them in a training pass shaped as users write
it, and requires every gradient bitwise equal to Megatron's own routing under the same loop (same
recompute, same backward order): with unchanged weights the recorded routes are the native ones, so any
difference is replay's doing. Loops: forward-order, reverse and summed-loss backward; full recompute and
selective ``["moe"]`` recompute; a train-mode log-prob pass under no_grad before the training pass.
On one GPU (bf16 weights, deterministic kernels): ``MOEVERIFY_TEST_BACKEND=cuda pytest THIS_FILE``.
"""

from __future__ import annotations

import pytest
import torch

from moeverify.patches import router_replay as rr

pytestmark = pytest.mark.usefixtures("patched_megatron_world")
B, S, MB = 2, 8, 3


@pytest.fixture(scope="module")
def model(qwen3_moe_train):
    return qwen3_moe_train


def set_recompute(chunks, mode: str | None) -> None:
    for chunk in chunks:
        for m in chunk.modules():
            config = getattr(m, "config", None)
            if config is None:
                continue
            config.recompute_granularity = {"full": "full", "moe": "selective"}.get(mode)
            config.recompute_method = "uniform" if mode == "full" else None
            config.recompute_num_layers = 1 if mode == "full" else None
            config.recompute_modules = ["moe"] if mode == "moe" else ["core_attn"]
        for m in chunk.modules():
            if hasattr(m, "moe_layer_recompute"):  # MoELayer reads selective recompute once, at build
                m.moe_layer_recompute = mode == "moe"


class RecomputeCounter:
    """Counts router calls made inside backward (recomputes), so a case proves it exercised recompute."""

    def __init__(self, chunks):
        self.calls = 0
        self.handles = [
            m.register_forward_hook(self._hook) for c in chunks for m in c.modules() if type(m).__name__ == "TopKRouter"
        ]

    def _hook(self, *_):
        self.calls += torch._C._current_graph_task_id() != -1

    def remove(self):
        for h in self.handles:
            h.remove()


def device_of(chunks) -> torch.device:
    return next(chunks[0].parameters()).device


def positions(chunks) -> torch.Tensor:
    return torch.arange(S, device=device_of(chunks)).expand(B, S)


def batches(chunks, vocab: int):
    return [
        torch.randint(0, vocab, (B, S), generator=torch.Generator().manual_seed(40 + i)).to(device_of(chunks))
        for i in range(MB)
    ]


def training_pass(chunks, data, order: str) -> dict:
    pos_BS = positions(chunks)
    for p in chunks[0].parameters():
        p.grad = None
    losses = [chunks[0](tokens, pos_BS, None).float().square().mean() for tokens in data]
    if order == "summed":
        sum(losses).backward()
    else:
        for loss in reversed(losses) if order == "reverse" else losses:
            loss.backward()
    return {n: p.grad.clone() for n, p in chunks[0].named_parameters() if p.grad is not None}


@pytest.mark.parametrize("recompute", ["full", "moe"])
@pytest.mark.parametrize("order", ["forward", "reverse", "summed"])
def test_replay_training_loop_bitwise_native(model, recompute, order):
    chunks, data = model.model_chunks, batches(model.model_chunks, model.config.vocab_size)
    set_recompute(chunks, recompute)
    try:
        native = training_pass(chunks, data, order)
        session = rr.ReplaySession(chunks)
        pos_BS = positions(chunks)
        with torch.no_grad(), session.record():  # log-prob pass, train mode: Megatron still checkpoints it
            for tokens in data:
                chunks[0](tokens, pos_BS, None)
        counter = RecomputeCounter(chunks)
        with session.replay(session.routes()):
            replayed = training_pass(chunks, data, order)
        counter.remove()
        session.check_consumed()
    finally:
        set_recompute(chunks, None)
    assert counter.calls == MB * len(session.layers), f"{recompute}: {counter.calls} recomputed router calls"
    assert native.keys() == replayed.keys() and native
    diff = [n for n in native if not torch.equal(native[n], replayed[n])]
    assert not diff, f"{recompute}/{order}: gradients differ from native routing: {diff[:4]}"


def test_replay_log_prob_then_train_in_one_replay_context(model):
    # R3 shape: the rollout routes serve both the train-mode log-prob pass and the training pass.
    chunks, data = model.model_chunks, batches(model.model_chunks, model.config.vocab_size)
    set_recompute(chunks, "full")
    try:
        native = training_pass(chunks, data, "reverse")
        session = rr.ReplaySession(chunks)
        pos_BS = positions(chunks)
        with torch.no_grad(), session.record():
            for tokens in data:
                chunks[0](tokens, pos_BS, None)
        once = session.routes()
        both = rr.Routes(
            {layer: [once.get(layer, mb) for mb in list(range(MB)) * 2] for layer in once.layers},
            num_experts=once.num_experts,
            topk=once.topk,
        )
        with session.replay(both):
            with torch.no_grad():
                for tokens in data:
                    chunks[0](tokens, pos_BS, None)
            replayed = training_pass(chunks, data, "reverse")
        session.check_consumed()
    finally:
        set_recompute(chunks, None)
    assert native and [n for n in native if not torch.equal(native[n], replayed[n])] == []
