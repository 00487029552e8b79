"""Router replay in a verl-style PPO update: actor and reference model in one process (R2: replay what the
actor's own log-prob pass chose).

The reference model routes natively: only the actor's session is bound. The log-prob passes run with
the models in train mode under ``no_grad``, as RL engines do. ``ppo_update`` is the step; run this file to
try it on tiny Qwen3-MoE models on one CPU rank: ``python examples/verl_step.py``.
"""

from __future__ import annotations

import torch


def token_log_probs(model, tokens_BS, positions_BS):
    """Log-probability of each next token under ``model`` (one micro-batch), ``[B, S]``."""
    logits_BSV = model(tokens_BS, positions_BS, None).float()
    return torch.log_softmax(logits_BSV, dim=-1).gather(-1, tokens_BS.roll(-1, dims=1).unsqueeze(-1)).squeeze(-1)


# [doc:verl-step]
def ppo_update(actor, reference, optimizer, micro_batches, positions_BS, *, kl_coef=0.1, clip=0.2):
    """One actor update over ``micro_batches`` (token tensors ``[B, S]``) with advantages of 1."""
    from moeverify.patches import router_replay as rr

    rr.apply()
    session = rr.ReplaySession(actor)  # the reference model is not bound: it routes natively
    with torch.no_grad():
        ref_lp = [token_log_probs(reference, mb, positions_BS) for mb in micro_batches]
        with session.record():  # old log-probs: the routes the actor chose
            old_lp = [token_log_probs(actor, mb, positions_BS) for mb in micro_batches]
    with session.replay(session.routes()):
        for mb, old, ref in zip(micro_batches, old_lp, ref_lp):
            new = token_log_probs(actor, mb, positions_BS)
            ratio = torch.exp(new - old)
            policy = -torch.min(ratio, ratio.clamp(1 - clip, 1 + clip)).mean()
            loss = (policy + kl_coef * (new - ref).mean()) / len(micro_batches)
            loss.backward()  # gradient accumulation over micro-batches
    session.check_consumed()
    optimizer.step()
    optimizer.zero_grad()


# [/doc:verl-step]


def main() -> None:
    from moeverify import models, runtime
    from moeverify.layout import Layout

    runtime.init("cpu")
    with runtime.parallel(Layout(), seed=0):
        built = models.build("qwen3_moe", Layout(), seed=0)
        actor, reference = built.model_chunks[0], models.build("qwen3_moe", Layout(), seed=1).model_chunks[0]
        B, S = 2, 8
        micro_batches = [
            torch.randint(0, built.config.vocab_size, (B, S), generator=torch.Generator().manual_seed(mb))
            for mb in range(3)
        ]
        ppo_update(
            actor, reference, torch.optim.SGD(actor.parameters(), lr=1e-2), micro_batches, torch.arange(S).expand(B, S)
        )
        print("one PPO update of 3 micro-batches with replayed actor routes; the reference routed natively")


if __name__ == "__main__":
    main()
