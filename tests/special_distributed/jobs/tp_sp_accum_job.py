"""A hand-written gradient-accumulation training job with tensor parallelism 2 + sequence parallel, on 2 ranks.

qwen3_moe under Layout(tp=2, sp=True): each TP rank's routers see its half of the sequence. Full recompute of
every layer. Each step: a log-prob pass (MICROBATCHES forwards, no_grad, train mode), then the training pass:
MICROBATCHES forwards of loss = vocab-parallel cross-entropy / MICROBATCHES, backward in the step's order,
then the sequence-parallel parameters' grads (layer norms, routers) all-reduced over the TP group (what
Megatron's finalize_model_grads does), then ``optimizer.step()``. Backward orders, step by step in turn:
  ``interleaved``: forward then backward of each micro-batch (classic accumulation);
  ``forward``: all forwards, then backward in forward order;
  ``reverse``: all forwards, then backward in reverse order;
  ``sum``: all forwards, then one backward of the summed losses.

MODE ``plain``: the job as written, nothing of moeverify.patches in it (what autopatch runs);
``PERTURB_FROM=K`` changes the router weights before step K (``PERTURB=1``: before step 0).
MODE ``session``: the same loop through the session API (``common.session_step``).
What each rank writes to OUT.rank{R}: see ``interleaved_job.py``.

Usage (torchrun, 2 ranks): tp_sp_accum_job.py MODE OUT STEPS MICROBATCHES
"""

import sys

import torch
from common import (
    RouteLog,
    grad_digest,
    perturb_routers,
    perturb_step,
    session_step,
    set_full_recompute,
    write_json,
    zero_grads,
)

from moeverify import models, runtime
from moeverify.spec.layout import Layout

B, S = 2, 8
LAYOUT = Layout(tp=2, sp=True)
ORDERS = ("interleaved", "forward", "reverse", "sum")


def main(mode: str, out: str, steps: int, microbatches: int) -> None:
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    rt = runtime.init("cpu")
    with runtime.parallel(LAYOUT, seed=0):
        built = models.build("qwen3_moe", LAYOUT, seed=0)
        chunks = built.model_chunks
        model = chunks[0]
        assert built.config.sequence_parallel and ps.get_tensor_model_parallel_world_size() == 2
        set_full_recompute(chunks, built.config)
        log = RouteLog(chunks)
        perturb_at = perturb_step() if mode == "plain" else None
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        tp_group = ps.get_tensor_model_parallel_group()
        sp_params = [p for p in model.parameters() if getattr(p, "sequence_parallel", False)]
        assert any(p is r.weight for r in log.routers for p in sp_params), "router weights are not marked SP"
        pos_BS = torch.arange(S).expand(B, S)

        def loss_of(tokens):
            output_BSV = model(tokens, pos_BS, None)
            ce = tensor_parallel.vocab_parallel_cross_entropy(output_BSV.float(), tokens.roll(-1, dims=1))
            return ce.mean() / microbatches

        def logprob(batches):
            model.train()
            with torch.no_grad():
                for tokens in batches:
                    model(tokens, pos_BS, None)

        def train(batches, order):
            model.train()
            zero_grads(chunks)
            log.clear()
            log.active = True
            try:
                if order == "interleaved":
                    losses = []
                    for tokens in batches:
                        loss = loss_of(tokens)
                        loss.backward()
                        losses.append(loss.detach())
                else:
                    losses = [loss_of(tokens) for tokens in batches]
                    if order == "forward":
                        for loss in losses:
                            loss.backward()
                    elif order == "reverse":
                        for loss in reversed(losses):
                            loss.backward()
                    else:
                        torch.stack(losses).sum().backward()
            finally:
                log.active = False
            for p in sp_params:
                torch.distributed.all_reduce(p.grad, group=tp_group)
            return {
                "order": order,
                "routes": log.snapshot(),
                "grads": grad_digest(chunks),
                "losses": [x.item() for x in losses],
            }

        if mode == "session":
            from moeverify.patches import router_replay as rr

            rr.apply()
            session = rr.ReplaySession(chunks)
        record = {"mode": mode, "layers": sorted(r.layer_number - 1 for r in log.routers), "steps": []}
        for step in range(steps):
            order = ORDERS[step % len(ORDERS)]
            batches = [
                torch.randint(
                    0, built.config.vocab_size, (B, S), generator=torch.Generator().manual_seed(100 * step + mb)
                )
                for mb in range(microbatches)
            ]
            if mode == "session":
                record["steps"].append(
                    session_step(
                        session,
                        log.routers,
                        logprob=lambda: logprob(batches),
                        train=lambda: train(batches, order),
                        wrong=step == 0,
                    )
                )
            else:
                if step == perturb_at:
                    perturb_routers(log.routers)
                logprob(batches)
                record["steps"].append(train(batches, order))
            opt.step()
            opt.zero_grad()
        write_json(f"{out}.rank{rt.rank}", record)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
