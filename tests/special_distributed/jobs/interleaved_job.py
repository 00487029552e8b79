"""A Megatron training job with pipeline parallelism 2 x virtual pipeline 2 (interleaved 1F1B), on 2 ranks.

qwen3_moe has 4 decoder layers, all MoE: each rank holds 2 model chunks of 1 layer (rank 0 layers 0 and 2, rank 1
layers 1 and 3). Each step: a log-prob pass through Megatron's pipeline schedule (``get_forward_backward_func``,
forward only, train mode, no_grad), then the training pass (interleaved 1F1B over MICROBATCHES micro-batches,
full recompute), then ``optimizer.step()``. ``batch_p2p_comm`` stays False, as ``models.build`` sets it on gloo.

MODE ``plain``: the job as written, nothing of moeverify.patches in it (what autopatch runs);
``PERTURB_FROM=K`` changes the router weights before step K (``PERTURB=1``: before step 0). Every rank writes
OUT.rank{R}: per step the training pass's routes (``common.RouteLog``: forward and recompute ids per layer, and
native top-k of the current weights), the per-parameter grad digests before ``optimizer.step()`` and, on the
last stage, the losses.

MODE ``session``: the same loop through the session API (``common.session_step``): each step computes the
native training pass (Megatron unpatched), records the log-prob pass, replays it in the training pass (also
with perturbed routers, and once with wrong routes), and steps the optimizer on the replayed grads.

Usage (torchrun, 2 ranks): interleaved_job.py MODE OUT STEPS MICROBATCHES
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
LAYOUT = Layout(pp=2, vpp=2)


def main(mode: str, out: str, steps: int, microbatches: int) -> None:
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel
    from megatron.core.pipeline_parallel import get_forward_backward_func

    rt = runtime.init("cpu")
    with runtime.parallel(LAYOUT, seed=0):
        built = models.build("qwen3_moe", LAYOUT, seed=0)
        chunks = built.model_chunks
        assert len(chunks) == LAYOUT.vpp, f"{len(chunks)} model chunks, expected {LAYOUT.vpp}"
        assert built.config.batch_p2p_comm is False  # gloo: batched p2p under PP x VPP mismatches messages
        set_full_recompute(chunks, built.config)
        log = RouteLog(chunks)
        perturb_at = perturb_step() if mode == "plain" else None
        opt = torch.optim.SGD([p for chunk in chunks for p in chunk.parameters()], lr=1e-3)
        pos_BS = torch.arange(S).expand(B, S)
        last_stage = ps.is_pipeline_last_stage(ignore_virtual=True)

        def forward_step(data_iterator, model):
            tokens = next(data_iterator)

            def loss(output_BSV):
                ce = tensor_parallel.vocab_parallel_cross_entropy(output_BSV.float(), tokens.roll(-1, dims=1))
                value = ce.mean()
                return value, {"loss": value.detach()}

            return model(tokens, pos_BS, None), loss

        def schedule(batches, *, forward_only):
            for chunk in chunks:
                chunk.train()
            return get_forward_backward_func()(
                forward_step_func=forward_step,
                data_iterator=[iter(batches) for _ in chunks],
                model=chunks,
                num_microbatches=len(batches),
                seq_length=S,
                micro_batch_size=B,
                forward_only=forward_only,
            )

        def logprob(batches):
            with torch.no_grad():  # old log-probs, train mode
                schedule(batches, forward_only=True)

        def train(batches):
            zero_grads(chunks)
            log.clear()
            log.active = True
            try:
                losses = schedule(batches, forward_only=False)
            finally:
                log.active = False
            return {
                "routes": log.snapshot(),
                "grads": grad_digest(chunks),
                "losses": [float(x["loss"]) for x in losses] if last_stage else [],
            }

        if mode == "session":
            from moeverify.patches import router_replay as rr

            rr.apply()
            session = rr.ReplaySession(chunks)
        record = {"mode": mode, "layers": sorted(r.layer_number - 1 for r in log.routers), "steps": []}
        for step in range(steps):
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
                        train=lambda: train(batches),
                        wrong=step == 0,
                    )
                )
            else:
                if step == perturb_at:
                    perturb_routers(log.routers)
                logprob(batches)
                record["steps"].append(train(batches))
            opt.step()
            opt.zero_grad()
        write_json(f"{out}.rank{rt.rank}", record)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
