"""Router replay from the rollout engine (R3, as NeMo-RL and verl do it): train on the experts the inference
engine chose, not on what the training model would choose now.

The engine returns, per request, the routed experts of every token it processed, ``[S_i - 1, L, K]``
(vLLM's ``routed_experts``, SGLang's ``return_routed_experts``: the last sampled token is never fed back).
``Routes.from_rollout`` lines them up with the padded training batch (sequence-major), ``to_local`` cuts
this rank's share under any layout (TP/SP, CP, PP stage), and the training pass replays them.
Run this file to try it on a tiny Qwen3-MoE on one CPU rank: ``python examples/nemo_rl_r3_step.py``.
"""

from __future__ import annotations

import torch


def padded_batch(requests, seq_len: int):
    """Right-padded ``[B, S]`` tokens and the ``[B, S]`` mask of the positions that predict a real next token."""
    tokens_BS = torch.zeros(len(requests), seq_len, dtype=torch.int64)
    predicts_BS = torch.zeros(len(requests), seq_len, dtype=torch.bool)
    for b, request in enumerate(requests):
        tokens_BS[b, : len(request)] = torch.as_tensor(request)
        predicts_BS[b, : len(request) - 1] = True
    return tokens_BS, predicts_BS


# [doc:r3-step]
def r3_update(model, optimizer, requests, routed_experts, *, moe_layers, seq_len: int):
    """One training step on ``requests`` (token lists, prompt + response) replaying the engine's routes."""
    from moeverify.patches import router_replay as rr
    from moeverify.routes import Routes
    from moeverify.views import job_layout

    rr.apply()
    session = rr.ReplaySession(model)
    tokens_BS, predicts_BS = padded_batch(requests, seq_len)
    routes = Routes.from_rollout(
        routed_experts,
        layers=moe_layers,
        num_experts=session.num_experts,
        lengths=[len(r) for r in requests],
        seq_len=seq_len,
        num_layers=model.config.num_layers,
    )  # capture gaps refused
    layout, coords, _ = job_layout(sp=model.config.sequence_parallel)
    local = routes.to_local(
        layout, coords=coords, seq_len=seq_len, batch=len(requests), num_layers=model.config.num_layers
    )  # this rank's layers and tokens
    with session.replay(local):
        positions_BS = torch.arange(seq_len).expand_as(tokens_BS)
        logits_BSV = model(tokens_BS, positions_BS, None).float()
        nll_BS = torch.nn.functional.cross_entropy(
            logits_BSV.transpose(1, 2), tokens_BS.roll(-1, dims=1), reduction="none"
        )
        loss = nll_BS[predicts_BS].mean()
        loss.backward()
    session.check_consumed()
    optimizer.step()
    optimizer.zero_grad()
    return loss.detach()


# [/doc:r3-step]


def engine_stand_in(model, requests):
    """What an engine serving ``model``'s weights returns: per request its native routes, ``[len - 1, L, K]``."""
    from moeverify.patches import router_replay as rr

    rr.apply()
    session = rr.ReplaySession(model)
    with torch.no_grad(), session.record():
        for request in requests:
            model(torch.as_tensor(request)[None], torch.arange(len(request))[None], None)
    recorded = session.routes()  # one micro-batch per request, its tokens in order
    return [
        torch.stack([recorded.get(layer, i) for layer in recorded.layers], dim=1)[:-1].numpy()
        for i in range(len(requests))
    ]


def main() -> None:
    from moeverify import models, runtime
    from moeverify.layout import Layout

    runtime.init("cpu")
    with runtime.parallel(Layout(), seed=0):
        built = models.build("qwen3_moe", Layout(), seed=0)
        model, S = built.model_chunks[0], 8
        layers = built.config.num_layers
        g = torch.Generator().manual_seed(0)
        requests = [torch.randint(0, built.config.vocab_size, (n,), generator=g).tolist() for n in (8, 6)]
        # stand-in for the engine's output, one [len - 1, L, K] array of expert ids per request: an engine serving
        # these weights routes as the model does (routes of other weights would fail the agreement guard)
        routed = engine_stand_in(model, requests)
        loss = r3_update(
            model, torch.optim.SGD(model.parameters(), lr=1e-2), requests, routed, moe_layers=range(layers), seq_len=S
        )
        print(f"one step on 2 requests with the engine's routes replayed; loss {float(loss):.4f}")


if __name__ == "__main__":
    main()
