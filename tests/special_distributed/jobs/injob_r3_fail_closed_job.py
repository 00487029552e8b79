"""An RL step on a rollout engine's routes handed over with the batch, 2 data-parallel ranks, where the engine's
expert ids may be renumbered on one rank: the agreement guard must stop both ranks before the optimizer updates.

Run under ``MOEVERIFY_ROUTER_REPLAY=r3 MOEVERIFY_ROUTER_REPLAY_MODEL=0 torchrun --nproc-per-node 2 -m
moeverify.patches.autopatch injob_r3_fail_closed_job.py CASE OUT`` with CASE ``healthy`` (every rank's routes are
the engine's) or ``renumbered`` (rank 1's engine ids pass through ``[1, 4, 2, 3, 7, 5, 6, 0]``: 4 of 8 experts keep
their number, a renumbering the chance floor alone lets through).

The engine is a second qwen3_moe built with the actor's seed (autopatch binds model 0, the actor): its routes are
the ones native routing picks. Each rank: a log-prob forward under ``torch.no_grad()``, a training forward and
backward, Adam's ``step()``. Each rank writes OUT.rank{R}: the error the step raised (or None), whether every
parameter still holds its value from before the step, bit for bit.
"""

import sys

import torch
from common import RouteLog, write_json
from injob_verl_job import batch_of

from moeverify import models, runtime
from moeverify.errors import RouteError
from moeverify.spec.layout import Layout

PERM = torch.tensor([1, 4, 2, 3, 7, 5, 6, 0])  # trainer expert f is engine id PERM[f]
LENGTHS = [9, 7, 12, 10, 8, 11, 6, 12]


def main(case: str, out: str) -> None:
    rt = runtime.init("cpu")
    with runtime.parallel(Layout(), seed=0):
        actor = models.build("qwen3_moe", Layout(), seed=0)
        engine = models.build("qwen3_moe", Layout(), seed=0)
        model = actor.model_chunks[0]
        model.train()
        g = torch.Generator().manual_seed(100 + rt.rank)  # each data-parallel rank trains its own sequences
        sequences = [torch.randint(0, actor.config.vocab_size, (n,), generator=g) for n in LENGTHS]
        uids = list(range(len(sequences)))

        def forward(chunk):
            ids, pad = batch_of(sequences, uids)
            return chunk(ids, torch.arange(ids.shape[1]).expand_as(ids), None, padding_mask=pad), pad

        log = RouteLog(engine.model_chunks)  # the rollout engine: what it routed, per (sequence, position)
        log.active = True
        with torch.no_grad():
            forward(engine.model_chunks[0])
        batch = len(uids)
        layers = sorted(log.forward)
        routes = [
            torch.tensor([[log.forward[layer][0][s * batch + b] for layer in layers] for s in range(len(seq) - 1)])
            for b, seq in enumerate(sequences)
        ]
        if case == "renumbered" and rt.rank == 1:
            routes = [PERM[r] for r in routes]
        from moeverify.patches import injob  # the lines a trainer adds where its batch is built

        injob.add_routes(version=0, sequences=sequences, routes=routes)
        with torch.no_grad():
            forward(model)  # the log-prob pass
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        output, pad = forward(model)
        output.float().square().mean(dim=-1).masked_fill(pad, 0.0).sum().backward()
        before = {name: p.detach().clone() for name, p in model.named_parameters()}
        error = None
        try:
            opt.step()
        except RouteError as exc:
            error = str(exc)
        unchanged = all(torch.equal(before[name], p.detach()) for name, p in model.named_parameters())
        write_json(f"{out}.rank{rt.rank}", {"error": error, "unchanged": unchanged})


if __name__ == "__main__":
    main(*sys.argv[1:3])
