"""Router replay in a Megatron-LM style training loop (Megatron's pipeline schedule, any PP/VPP, recompute on).

Each iteration runs the old-log-prob pass forward only (recording the routes), then the training pass
with the same micro-batches replaying them, then the optimizer step. ``train`` is the loop; run this file
to try it on a tiny Qwen3-MoE on one CPU rank: ``python examples/megatron_loop.py``.
"""

from __future__ import annotations

import torch


# [doc:megatron-loop]
def train(model, optimizer, iterations, forward_step, *, seq_len: int, micro_batch_size: int):
    """``model``: the list of VPP chunks; ``iterations``: per iteration, the list of its micro-batches."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from moeverify.patches import router_replay as rr

    rr.apply()
    session = rr.ReplaySession(model)  # every TopKRouter of this model, keyed by global layer
    fwd_bwd = get_forward_backward_func()
    for batches in iterations:
        common = dict(
            forward_step_func=forward_step,
            model=model,
            num_microbatches=len(batches),
            seq_length=seq_len,
            micro_batch_size=micro_batch_size,
        )
        with torch.no_grad(), session.record():  # old log-probs: forward only, every micro-batch
            fwd_bwd(data_iterator=iter(batches), forward_only=True, **common)
        with session.replay(session.routes()):  # training: same micro-batches, same order
            fwd_bwd(data_iterator=iter(batches), forward_only=False, **common)
        session.check_consumed()  # every forward used, every recompute found its forward
        optimizer.step()
        optimizer.zero_grad()


# [/doc:megatron-loop]


def lm_forward_step(positions_BS):
    """A Megatron ``forward_step_func``: next-token cross entropy on the batch's own tokens."""
    from megatron.core import tensor_parallel

    def forward_step(data_iterator, model):
        tokens_BS = next(data_iterator)

        def loss_func(output_BSV):
            loss = tensor_parallel.vocab_parallel_cross_entropy(output_BSV.float(), tokens_BS.roll(-1, dims=1)).mean()
            return loss, {"loss": loss.detach()}

        return model(tokens_BS, positions_BS, None), loss_func

    return forward_step


def main() -> None:
    from moeverify import models, runtime
    from moeverify.layout import Layout

    runtime.init("cpu")
    with runtime.parallel(Layout(), seed=0):
        built = models.build("qwen3_moe", Layout(), seed=0)
        config = built.model_chunks[0].config
        config.recompute_granularity, config.recompute_method, config.recompute_num_layers = "full", "uniform", 1
        B, S = 2, 8
        iterations = [
            [
                torch.randint(0, built.config.vocab_size, (B, S), generator=torch.Generator().manual_seed(10 * it + mb))
                for mb in range(3)
            ]
            for it in range(2)
        ]
        optimizer = torch.optim.SGD([p for c in built.model_chunks for p in c.parameters()], lr=1e-2)
        train(
            built.model_chunks,
            optimizer,
            iterations,
            lm_forward_step(torch.arange(S).expand(B, S)),
            seq_len=S,
            micro_batch_size=B,
        )
        print("2 iterations of 3 micro-batches trained with replayed routes")


if __name__ == "__main__":
    main()
