"""An unmodified Megatron-style training job with pipeline parallelism 2, run under autopatch by the tests.

Each step: a log-prob pass through Megatron's pipeline schedule (forward only), then the training pass (1F1B,
MICROBATCHES micro-batches, full recompute), then ``optimizer.step()``. Every rank writes OUT.rank{R}: the
routes its routers chose in the training forwards (sorted ids per layer and micro-batch) and, on the last
stage, the losses. ``PERTURB=1`` changes the router weights first, so native routing would differ from a
recording of the unperturbed job.

Usage (2 ranks): pipeline_job.py OUT STEPS MICROBATCHES
"""

import json
import os
import sys

import torch

from moeverify import models, runtime
from moeverify.spec.layout import Layout

B, S = 2, 8


def main(out: str, steps: int, microbatches: int) -> None:
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel
    from megatron.core.pipeline_parallel import get_forward_backward_func

    rt = runtime.init("cpu")
    layout = Layout(pp=2)
    with runtime.parallel(layout, seed=0):
        built = models.build("qwen3_moe", layout, seed=0)
        model = built.model_chunks[0]
        model.config.recompute_granularity, model.config.recompute_method = "full", "uniform"
        model.config.recompute_num_layers = 1
        routers = [m for m in model.modules() if type(m).__name__ == "TopKRouter"]
        if os.environ.get("PERTURB") == "1":
            with torch.no_grad():
                for r in routers:
                    r.weight.add_(torch.randn(r.weight.shape, generator=torch.Generator().manual_seed(3)) * 3)
        seen = []
        training = [False]
        for r in routers:
            r.register_forward_hook(
                lambda mod, a, o: (
                    seen.append((mod.layer_number, o[1].nonzero()[:, 1].view(o[1].shape[0], -1).tolist()))
                    if training[0] and torch.is_grad_enabled()
                    else None
                )
            )
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        pos_BS = torch.arange(S).expand(B, S)
        record = {"routes": [], "losses": []}

        def forward_step(data_iterator, model_):
            tokens = next(data_iterator)

            def loss(output_BSV):
                ce = tensor_parallel.vocab_parallel_cross_entropy(output_BSV.float(), tokens.roll(-1, dims=1))
                value = ce.mean()
                return value, {"loss": value.detach()}

            return model_(tokens, pos_BS, None), loss

        for step in range(steps):
            batches = [
                torch.randint(
                    0, built.config.vocab_size, (B, S), generator=torch.Generator().manual_seed(100 * step + mb)
                )
                for mb in range(microbatches)
            ]
            model.train()
            common = dict(
                forward_step_func=forward_step,
                model=model,
                num_microbatches=microbatches,
                seq_length=S,
                micro_batch_size=B,
            )
            with torch.no_grad():  # old log-probs, train mode
                get_forward_backward_func()(data_iterator=iter(batches), forward_only=True, **common)
            seen.clear()
            training[0] = True
            losses = get_forward_backward_func()(data_iterator=iter(batches), forward_only=False, **common)
            training[0] = False
            record["routes"].append(seen[:])
            if ps.is_pipeline_last_stage():
                record["losses"].append([float(x["loss"]) for x in losses])
            opt.step()
            opt.zero_grad()
        with open(f"{out}.rank{rt.rank}", "w") as f:
            json.dump(record, f)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
