"""A verl-like PPO step, unmodified (nothing of moeverify.patches in it), on 2 ranks with TP2 + sequence parallel.

Run under ``MOEVERIFY_ROUTER_REPLAY=r2 torchrun ... -m moeverify.patches.autopatch injob_verl_job.py OUT``.
qwen3_moe under Layout(tp=2, sp=True), full recompute. Eight sequences of several lengths (the same on both TP
ranks), right-padded to an even width with Megatron's ``padding_mask``. The step: old log-probs under
``torch.no_grad()`` in micro-batches of 4; the router weights are then perturbed (a stand-in for weights that
moved since the rollout: native routing now picks other experts for many tokens); then 2 PPO epochs of 2
shuffled mini-batches each, in micro-batches of 2 sequences in the first epoch and grouped by token count
(dynamic batching) in the second, forward + backward + TP all-reduce of the SP grads + ``optimizer.step()``.

Forward hooks on the routers (the job's own observation, apart from autopatch) note the experts each token used
in the log-prob pass, keyed by (sequence, position) as the job knows them from its own batching and its TP
rank's half of the sequence (pooled over the TP ranks); then each training token's experts are compared with its
log-prob route, and with
what native top-k with the current weights would pick. Each rank writes OUT.rank{R}: tokens checked, mismatches,
tokens where native routing would differ, and the losses.

Usage (torchrun, 2 ranks): injob_verl_job.py OUT
"""

import sys

import torch
from common import RouteLog, perturb_routers, routers_of, set_full_recompute, write_json

from moeverify import models, runtime
from moeverify.spec.layout import Layout

LAYOUT = Layout(tp=2, sp=True)
LENGTHS = [6, 3, 8, 5, 7, 2, 8, 4]


def batch_of(sequences, uids):
    width = max(len(sequences[u]) for u in uids)
    width += width % 2  # sequence parallel splits the sequence over 2 TP ranks
    ids = torch.zeros(len(uids), width, dtype=torch.long)
    pad = torch.ones(len(uids), width, dtype=torch.bool)
    for b, u in enumerate(uids):
        ids[b, : len(sequences[u])], pad[b, : len(sequences[u])] = sequences[u], False
    return ids, pad


def local_tokens(sequences, uids, tp_rank):
    """(uid, pos) or None (padding) for each token a TP rank's router sees, in router order s * B + b."""
    ids, pad = batch_of(sequences, uids)
    half = ids.shape[1] // 2
    return [
        None if pad[b, s] else (uids[b], s)
        for s in range(tp_rank * half, (tp_rank + 1) * half)
        for b in range(len(uids))
    ]


def plan_of(uids, sequences, *, seed=3, max_tokens=24):
    g, plan = torch.Generator().manual_seed(seed), []
    for epoch in range(2):
        order = [uids[i] for i in torch.randperm(len(uids), generator=g).tolist()]
        for part in (order[:4], order[4:]):
            if epoch == 0:
                plan.append([part[:2], part[2:]])
                continue
            groups, current = [], []
            for u in part:  # verl's use_dynamic_bsz: micro-batches by token count
                if current and max(len(sequences[v]) for v in current + [u]) * (len(current) + 1) > max_tokens:
                    groups.append(current)
                    current = []
                current.append(u)
            plan.append(groups + [current])
    return plan


def main(out: str) -> None:
    from megatron.core import parallel_state as ps

    rt = runtime.init("cpu")
    with runtime.parallel(LAYOUT, seed=0):
        built = models.build("qwen3_moe", LAYOUT, seed=0)
        model = built.model_chunks[0]
        model.train()
        set_full_recompute(built.model_chunks, built.config)
        tp_rank, tp_group = ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_group()
        sp_params = [p for p in model.parameters() if getattr(p, "sequence_parallel", False)]
        log = RouteLog(built.model_chunks)
        g = torch.Generator().manual_seed(11)
        sequences = [torch.randint(0, built.config.vocab_size, (n,), generator=g) for n in LENGTHS]
        uids = list(range(len(sequences)))

        def forward(micro):
            ids, pad = batch_of(sequences, micro)
            return model(ids, torch.arange(ids.shape[1]).expand_as(ids), None, padding_mask=pad), pad

        log.active = True
        logp = {}
        with torch.no_grad():
            for i in range(0, len(uids), 4):
                log.clear()
                forward(uids[i : i + 4])
                where = local_tokens(sequences, uids[i : i + 4], tp_rank)
                for layer, (ids_TK,) in log.forward.items():
                    logp.update({(layer, *w): sorted(ids_TK[t]) for t, w in enumerate(where) if w})
        pooled = [None, None]  # each TP rank saw half of every sequence: pool what both saw
        torch.distributed.all_gather_object(pooled, logp, group=tp_group)
        logp = {k: v for part in pooled for k, v in part.items()}
        perturb_routers(routers_of(built.model_chunks))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        checked, wrong, native_differs, losses, sizes = 0, [], 0, [], set()
        for minibatch in plan_of(uids, sequences):
            opt.zero_grad(set_to_none=True)
            for micro in minibatch:
                sizes.add(len(micro))
                log.clear()
                output, pad = forward(micro)
                loss = output.float().square().mean(dim=-1).masked_fill(pad, 0.0).sum() / (~pad).sum()
                loss.backward()
                losses.append(loss.item())
                where = local_tokens(sequences, micro, tp_rank)
                for layer, (ids_TK,) in log.forward.items():
                    native_TK = log.native[layer][0]
                    for t, w in enumerate(where):
                        if w is None:
                            continue
                        checked += 1
                        if sorted(ids_TK[t]) != logp[(layer, *w)]:
                            wrong.append([layer, *w])
                        native_differs += sorted(native_TK[t]) != logp[(layer, *w)]
            for p in sp_params:
                torch.distributed.all_reduce(p.grad, group=tp_group)
            opt.step()
        write_json(
            f"{out}.rank{rt.rank}",
            {
                "checked": checked,
                "wrong": wrong[:20],
                "native_differs": native_differs,
                "losses": losses,
                "sizes": sorted(sizes),
                "real_tokens": sum(LENGTHS),
            },
        )


if __name__ == "__main__":
    main(sys.argv[1])
