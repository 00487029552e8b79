"""A verl-like RL step on a rollout engine's routes, unmodified (nothing of moeverify.patches in it), on 2 ranks.

Run under ``MOEVERIFY_ROUTER_REPLAY=r3:DIR MOEVERIFY_ROUTER_REPLAY_MODEL=0 torchrun ... -m moeverify.patches.autopatch
injob_r3_job.py LAYOUT DIR OUT`` with LAYOUT ``tp2sp`` (Layout(tp=2, sp=True): each router sees half of every
sequence) or ``ep2`` (Layout(ep=2)). qwen3_moe, full recompute. With DIR ``batch`` (and
``MOEVERIFY_ROUTER_REPLAY=r3``) every rank hands the routes over with the batch (``injob.add_routes``) instead of
rank 0 writing them.

The rollout: an "engine" model (the second one built, other weights, routing natively: autopatch binds model 0)
routes the eight sequences; its routes, pooled over the ranks that each saw a part, are written by rank 0 with
``moeverify.routing.rollout_writer.RolloutWriter`` as vLLM returns them (no row for each sequence's last token). Then
the actor runs the step as a trainer writes it: old log-probs under ``torch.no_grad()`` in micro-batches of 4, router
weights perturbed (native routing now picks other experts), 2 PPO epochs of 2 shuffled mini-batches (micro-batches of 2,
then grouped by token count), forward + backward + ``optimizer.step()``.

Forward hooks on the actor's routers note the experts each token used and what native top-k would pick now. Each
rank writes OUT.rank{R}: tokens checked against the rollout's route, mismatches, last tokens checked against native
routing, tokens where native routing would differ from the rollout, losses.
"""

import sys

import torch
from common import RouteLog, perturb_routers, routers_of, set_full_recompute, write_json
from injob_verl_job import LENGTHS, batch_of, plan_of

from moeverify import models, runtime
from moeverify.routing.rollout_writer import RolloutWriter
from moeverify.spec.layout import Layout

LAYOUTS = {"tp2sp": Layout(tp=2, sp=True), "ep2": Layout(ep=2)}


def local_tokens(sequences, uids, *, tp_rank, parts):
    """(uid, pos) or None (padding) for each token this rank's router sees, in router order s * B + b."""
    ids, pad = batch_of(sequences, uids)
    part = ids.shape[1] // parts
    return [
        None if pad[b, s] else (uids[b], s)
        for s in range(tp_rank * part, (tp_rank + 1) * part)
        for b in range(len(uids))
    ]


def main(layout_name: str, directory: str, out: str) -> None:
    from megatron.core import parallel_state as ps

    layout = LAYOUTS[layout_name]
    parts = 2 if layout.sp else 1
    rt = runtime.init("cpu")
    with runtime.parallel(layout, seed=0):
        actor = models.build("qwen3_moe", layout, seed=0)
        engine = models.build("qwen3_moe", layout, seed=1)
        model = actor.model_chunks[0]
        model.train()
        set_full_recompute(actor.model_chunks, actor.config)
        tp_rank = ps.get_tensor_model_parallel_rank() if layout.sp else 0
        sp_params = [p for p in model.parameters() if getattr(p, "sequence_parallel", False)]
        g = torch.Generator().manual_seed(11)
        sequences = [torch.randint(0, actor.config.vocab_size, (n,), generator=g) for n in LENGTHS]
        uids = list(range(len(sequences)))

        def forward(chunk, micro):
            ids, pad = batch_of(sequences, micro)
            return chunk(ids, torch.arange(ids.shape[1]).expand_as(ids), None, padding_mask=pad), pad

        # the rollout engine
        engine_log = RouteLog(engine.model_chunks)
        engine_log.active = True
        with torch.no_grad():
            forward(engine.model_chunks[0], uids)
        where = local_tokens(sequences, uids, tp_rank=tp_rank, parts=parts)
        seen = {
            (layer, *w): ids_TK[t] for layer, (ids_TK,) in engine_log.forward.items() for t, w in enumerate(where) if w
        }
        pooled = [None] * rt.world_size
        torch.distributed.all_gather_object(pooled, seen)
        rollout = {k: v for part in pooled for k, v in part.items()}
        layers = sorted(engine_log.forward)
        routes = [
            torch.tensor([[rollout[(layer, u, s)] for layer in layers] for s in range(len(seq) - 1)])
            for u, seq in enumerate(sequences)
        ]
        if directory == "batch":  # MOEVERIFY_ROUTER_REPLAY=r3: the routes handed over with the batch, every rank
            from moeverify.patches import injob  # the lines a trainer adds where its batch is built

            injob.add_routes(version=0, sequences=sequences, routes=routes)
        elif rt.rank == 0:
            with RolloutWriter(directory, step=0) as w:
                for seq, rows in zip(sequences, routes, strict=True):
                    w.add(seq, rows)
        torch.distributed.barrier()

        log = RouteLog(actor.model_chunks)
        log.active = True
        with torch.no_grad():
            for i in range(0, len(uids), 4):
                forward(model, uids[i : i + 4])
        perturb_routers(routers_of(actor.model_chunks))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        checked, wrong, last, last_wrong, native_differs, losses = 0, [], 0, [], 0, []
        for minibatch in plan_of(uids, sequences):
            opt.zero_grad(set_to_none=True)
            for micro in minibatch:
                log.clear()
                output, pad = forward(model, micro)
                loss = output.float().square().mean(dim=-1).masked_fill(pad, 0.0).sum() / (~pad).sum()
                loss.backward()
                losses.append(loss.item())
                where = local_tokens(sequences, micro, tp_rank=tp_rank, parts=parts)
                for layer, (ids_TK,) in log.forward.items():
                    native_TK = log.native[layer][0]
                    for t, w in enumerate(where):
                        if w is None:
                            continue
                        if w[1] == len(sequences[w[0]]) - 1:  # no rollout row: routed natively
                            last += 1
                            if sorted(ids_TK[t]) != sorted(native_TK[t]):
                                last_wrong.append([layer, *w])
                            continue
                        checked += 1
                        want = sorted(rollout[(layer, *w)])
                        if sorted(ids_TK[t]) != want:
                            wrong.append([layer, *w])
                        native_differs += sorted(native_TK[t]) != want
            for p in sp_params:
                torch.distributed.all_reduce(p.grad, group=ps.get_tensor_model_parallel_group())
            opt.step()
        write_json(
            f"{out}.rank{rt.rank}",
            {
                "checked": checked,
                "wrong": wrong[:20],
                "last": last,
                "last_wrong": last_wrong[:20],
                "native_differs": native_differs,
                "losses": losses,
                "real_tokens": sum(LENGTHS),
                "sequences": len(LENGTHS),
                "layers": len(layers),
            },
        )


if __name__ == "__main__":
    main(*sys.argv[1:4])
