"""An unmodified RL-style training job, run under ``python -m moeverify.patches.autopatch`` by the tests.

Each step: a log-prob pass under ``torch.no_grad()`` with the model in train mode and full recompute on
(Megatron still checkpoints it), then the training pass: MICROBATCHES forwards, backward in reverse
order, ``optimizer.step()``. A reference model (same family, built first) runs a no-grad pass each step.
The routes every router chose in the training forwards are written to OUT as JSON (sorted ids per
layer and micro-batch), with the losses. ``PERTURB=1`` changes the actor's router weights first, so
native routing would differ from a recording of the unperturbed job.

``EP=2`` (under torchrun with 2 ranks) builds both models with expert parallelism 2, ``TP=2`` with tensor
parallelism 2 and sequence parallelism; each rank then writes OUT.rank{R} and feeds its data-parallel rank's
batches.

Usage: autopatch_job.py OUT STEPS MICROBATCHES
"""

import json
import os
import sys

import torch

from moeverify import models, runtime
from moeverify.spec.layout import Layout

B, S = 2, 8


def main(out: str, steps: int, microbatches: int) -> None:
    rt = runtime.init("cpu")
    tp = int(os.environ.get("TP", "1"))
    layout = Layout(ep=int(os.environ.get("EP", "1")), tp=tp, sp=tp > 1)
    if rt.world_size > 1:
        out = f"{out}.rank{rt.rank}"
    with runtime.parallel(layout, seed=0):
        from megatron.core import parallel_state

        dp_rank = parallel_state.get_data_parallel_rank()
        reference = models.build("qwen3_moe", layout, seed=0).model_chunks
        built = models.build("qwen3_moe", layout, seed=0)
        actor = built.model_chunks
        for chunk in actor:
            chunk.train()
            for m in chunk.modules():
                if hasattr(m, "config"):
                    m.config.recompute_granularity, m.config.recompute_method = "full", "uniform"
                    m.config.recompute_num_layers = 1
        if os.environ.get("PERTURB") == "1":
            with torch.no_grad():
                for m in actor[0].modules():
                    if type(m).__name__ == "TopKRouter":
                        m.weight.add_(torch.randn(m.weight.shape, generator=torch.Generator().manual_seed(3)) * 3)
        seen = []
        for m in actor[0].modules():
            if type(m).__name__ == "TopKRouter":
                m.register_forward_hook(lambda mod, a, o: seen.append(o[1].nonzero()[:, 1].view(o[1].shape[0], -1)))
        opt = torch.optim.SGD(actor[0].parameters(), lr=1e-3)
        pos_BS = torch.arange(S).expand(B, S)
        record = {"routes": [], "losses": []}
        for step in range(steps):
            batches = [
                torch.randint(
                    0,
                    built.config.vocab_size,
                    (B, S),
                    generator=torch.Generator().manual_seed(100 * step + 10 * dp_rank + mb),
                )
                for mb in range(microbatches)
            ]
            with torch.no_grad():
                reference[0](batches[0], pos_BS, None)
                for tokens in batches:  # old log-probs, train mode
                    actor[0](tokens, pos_BS, None)
            seen.clear()
            losses = [actor[0](tokens, pos_BS, None).float().square().mean() for tokens in batches]
            record["routes"].append([ids.tolist() for ids in seen])
            for loss in reversed(losses):
                loss.backward()
            record["losses"].append([loss.item() for loss in losses])
            opt.step()
            opt.zero_grad()
        with open(out, "w") as f:
            json.dump(record, f)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
