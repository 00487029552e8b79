"""An unmodified RL-style step under in-job R2 with context or pipeline parallelism.

Run under ``MOEVERIFY_ROUTER_REPLAY=r2 MOEVERIFY_ROUTER_REPLAY_MODEL=0 torchrun ... -m moeverify.patches.autopatch
injob_layouts_job.py LAYOUT OUT`` with LAYOUT ``cp2``, ``pp2`` or ``pp2-vpp2`` (interleaved 1F1B, one layer per
model chunk) on 2 ranks, or ``tp2-sp-cp2`` on 4 (a TP rank routes a slice of its CP rank's halves). Two qwen3_moe
models with the same seed: the actor (built first: autopatch binds it) and its twin (built second: routes
natively), both driven through Megatron's own schedule (``get_forward_backward_func``), full recompute, every
stage's forward given ``input_ids`` (as verl does). Eight sequences of lengths up to 8, right-padded
(``padding_mask``):

- the log-prob pass (no_grad, forward only): micro-batches of 4 sequences in order, width 8;
- the training pass: micro-batches of 2 sequences in a shuffled order, width 12 (under CP2 the zigzag chunks are
  3 tokens, not 2: a token moves to the other CP rank), forward + backward of actor and twin on the same batches;
- the same training pass again after the actor's router weights are perturbed (native routing would now differ).

Under CP each rank feeds its zigzag halves (megatron-core's ``get_batch_on_this_cp_rank``: chunks ``r`` and
``2 * cp - 1 - r`` of ``2 * cp``) of ids, positions and padding mask. Forward hooks on the routers (``RouteLog``,
apart from autopatch) note what each router used; a token is known by (sequence, position) from the job's own
batching (log-prob routes pooled over the ranks that split sequences). Each rank writes OUT.rank{R}: tokens
checked, tokens not on their log-prob route, perturbed-pass tokens where native routing would differ, per training
mini-batch whether actor and twin routed alike and whether their gradients are bitwise equal, and (PP, stages past
the first) the error a stage fed no input_ids raised.

Usage (torchrun, 2 ranks; 4 for tp2-sp-cp2): injob_layouts_job.py cp2|pp2|pp2-vpp2|tp2-sp-cp2 OUT
"""

import sys

import torch
from common import RouteLog, grad_digest, perturb_routers, routers_of, set_full_recompute, write_json, zero_grads

from moeverify import models, runtime
from moeverify.spec.layout import Layout

LAYOUTS = {
    "cp2": Layout(cp=2),
    "pp2": Layout(pp=2),
    "pp2-vpp2": Layout(pp=2, vpp=2),
    "tp2-sp-cp2": Layout(tp=2, sp=True, cp=2),
}  # 4 ranks
LENGTHS = [6, 3, 8, 5, 7, 2, 8, 4]
LOGPROB_WIDTH, TRAIN_WIDTH = 8, 12


def cp_split(val_BS: torch.Tensor, *, cp: int, rank: int) -> torch.Tensor:
    """megatron-core 0.19.2's per-sequence zigzag split of one ``[B, S]`` tensor."""
    if cp == 1:
        return val_BS
    val = val_BS.view(val_BS.shape[0], 2 * cp, val_BS.shape[1] // (2 * cp))
    return val.index_select(1, torch.tensor([rank, 2 * cp - 1 - rank])).reshape(val_BS.shape[0], -1)


class Batches:
    def __init__(self, sequences, *, cp: int, cp_rank: int, sp_tp: int = 1, tp_rank: int = 0):
        self.sequences, self.cp, self.cp_rank = sequences, cp, cp_rank
        self.sp_tp, self.tp_rank = sp_tp, tp_rank  # under sequence parallel a TP rank routes a slice of the CP halves

    def full(self, uids, width):
        ids = torch.zeros(len(uids), width, dtype=torch.long)
        pad = torch.ones(len(uids), width, dtype=torch.bool)
        for b, u in enumerate(uids):
            ids[b, : len(self.sequences[u])], pad[b, : len(self.sequences[u])] = self.sequences[u], False
        return ids, pad

    def local(self, uids, width):
        """This rank's (ids, positions, padding) ``[B, width / cp]``."""
        ids, pad = self.full(uids, width)
        pos = torch.arange(width).expand_as(ids)
        return tuple(cp_split(t, cp=self.cp, rank=self.cp_rank).contiguous() for t in (ids, pos, pad))

    def tokens(self, uids, width):
        """(uid, position) or None (padding) of each token this rank's routers see, in router order s * B + b."""
        _, pos, pad = self.local(uids, width)
        part = pos.shape[1] // self.sp_tp
        return [
            None if pad[b, s] else (uids[b], int(pos[b, s]))
            for s in range(self.tp_rank * part, (self.tp_rank + 1) * part)
            for b in range(len(uids))
        ]


def main(layout_name: str, out: str) -> None:
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel
    from megatron.core.pipeline_parallel import get_forward_backward_func

    layout = LAYOUTS[layout_name]
    rt = runtime.init("cpu")
    with runtime.parallel(layout, seed=0):
        actor = models.build("qwen3_moe", layout, seed=0)
        twin = models.build("qwen3_moe", layout, seed=0)
        for built in (actor, twin):
            set_full_recompute(built.model_chunks, built.config)
        cp, cp_rank = ps.get_context_parallel_world_size(), ps.get_context_parallel_rank()
        last_stage = ps.is_pipeline_last_stage(ignore_virtual=True)
        log, twin_log = RouteLog(actor.model_chunks), RouteLog(twin.model_chunks)
        g = torch.Generator().manual_seed(11)
        sequences = [torch.randint(0, actor.config.vocab_size, (n,), generator=g) for n in LENGTHS]
        sp_tp = ps.get_tensor_model_parallel_world_size() if layout.sp else 1
        batches = Batches(sequences, cp=cp, cp_rank=cp_rank, sp_tp=sp_tp, tp_rank=ps.get_tensor_model_parallel_rank())
        uids = list(range(len(sequences)))

        def schedule(built, micro, *, width, forward_only):
            def forward_step(data_iterator, model):
                ids, pos, pad = batches.local(next(data_iterator), width)

                def loss(output_BSV):
                    ce = tensor_parallel.vocab_parallel_cross_entropy(output_BSV.float(), ids.roll(-1, dims=1))
                    value = ce.masked_fill(pad, 0.0).sum() / (~pad).sum().clamp(min=1)
                    return value, {"loss": value.detach()}

                return model(ids, pos, None, padding_mask=pad), loss

            chunks = built.model_chunks
            for chunk in chunks:
                chunk.train()
            get_forward_backward_func()(
                forward_step_func=forward_step,
                data_iterator=[iter(micro) for _ in chunks] if len(chunks) > 1 else iter(micro),
                model=chunks,
                num_microbatches=len(micro),
                seq_length=width,
                micro_batch_size=len(micro[0]),
                forward_only=forward_only,
            )

        # the log-prob pass: what each (layer, uid, position) routed to, pooled over the CP ranks
        log.active, logp = True, {}
        log.clear()
        logprob_micro = [uids[:4], uids[4:]]
        with torch.no_grad():
            schedule(actor, logprob_micro, width=LOGPROB_WIDTH, forward_only=True)
        for layer, calls in log.forward.items():
            for micro, ids_TK in zip(logprob_micro, calls, strict=False):
                where = batches.tokens(micro, LOGPROB_WIDTH)
                logp.update({(layer, *w): sorted(ids_TK[t]) for t, w in enumerate(where) if w})
        if cp * sp_tp > 1:
            group = ps.get_tensor_and_context_parallel_group() if sp_tp > 1 else ps.get_context_parallel_group()
            pooled = [None] * (cp * sp_tp)
            torch.distributed.all_gather_object(pooled, logp, group=group)
            logp = {k: v for part in pooled for k, v in part.items()}

        order = torch.randperm(len(uids), generator=torch.Generator().manual_seed(3)).tolist()
        minibatches = [[order[0:2], order[2:4]], [order[4:6], order[6:8]]]
        result = {"checked": 0, "wrong": [], "native_differs": 0, "minibatches": []}

        def check(micro_list, *, perturbed: bool):
            for layer, calls in log.forward.items():
                for micro, ids_TK in zip(micro_list, calls, strict=False):
                    for t, w in enumerate(batches.tokens(micro, TRAIN_WIDTH)):
                        if w is None:
                            continue
                        result["checked"] += 1
                        if sorted(ids_TK[t]) != logp[(layer, *w)]:
                            result["wrong"].append([layer, *w, int(perturbed)])
                        if perturbed:
                            native = log.native[layer][micro_list.index(micro)][t]
                            result["native_differs"] += sorted(native) != logp[(layer, *w)]

        for micro_list in minibatches:  # training, actor replayed vs twin native, same weights and batches
            runs = {}
            for name, built, spy in (("actor", actor, log), ("twin", twin, twin_log)):
                zero_grads(built.model_chunks)
                spy.active = True
                spy.clear()
                schedule(built, micro_list, width=TRAIN_WIDTH, forward_only=False)
                spy.active = False
                runs[name] = grad_digest(built.model_chunks)
            log.active = True
            check(micro_list, perturbed=False)
            same_routes = log.forward == twin_log.forward and log.recompute == twin_log.recompute
            result["minibatches"].append(
                {
                    "same_routes": same_routes,
                    "grads_equal": runs["actor"] == runs["twin"],
                    "grads": sum(v is not None for v in runs["actor"].values()),
                }
            )
        perturb_routers(routers_of(actor.model_chunks))
        for micro_list in minibatches:  # the step's table still serves: replay on other weights
            log.clear()
            schedule(actor, micro_list, width=TRAIN_WIDTH, forward_only=False)
            check(micro_list, perturbed=True)
        log.active = False
        result["wrong"] = result["wrong"][:20]
        result["real_tokens"] = sum(LENGTHS)
        result["layers"] = sorted(log.forward)
        if layout.pp > 1 and not ps.is_pipeline_first_stage():
            result["no_input_ids"] = refused_without_input_ids(actor, width=TRAIN_WIDTH)
        result["last_stage"] = last_stage
        write_json(f"{out}.rank{rt.rank}", result)


def refused_without_input_ids(actor, *, width: int) -> str:
    """A stage past the first fed hidden states only (as Megatron-LM's get_batch leaves it): the error text."""
    from moeverify.errors import RouteError

    chunk = actor.model_chunks[0]
    hidden_SBH = torch.randn(width, 2, actor.config.hidden_size, dtype=next(chunk.parameters()).dtype)
    chunk.set_input_tensor(hidden_SBH)
    try:
        chunk(None, None, None)
    except RouteError as e:
        return str(e)
    return ""


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
