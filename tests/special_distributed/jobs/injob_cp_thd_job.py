"""In-job R2 on packed (THD) sequences under context parallel 2, at the router (2 ranks).

CPU attention cannot run packed sequences, so this drives a megatron-core ``TopKRouter`` the way the ``GPTModel``
pre-hook drives it (``injob.ChunkForward`` around the call), as ``tests/unit/test_injob_replay.py`` does on one
rank. Each CP rank holds its per-slot zigzag halves of the packed batch (Transformer Engine's
``thd_partition_indices_kernel``, written out in ``te_reference.py``); a token's hidden state depends on its
(sequence, position) only. The log-prob pass packs A|B in slots of 8 and 4; the router weights then move (native
routing would differ); the training pass packs B|A in slots of 8 and 12, so tokens change CP rank; a last pass
packs B|C (C never scored) and must be refused on the rank holding C's tokens.

Each rank writes OUT.rank{R}: real tokens checked, real tokens not on their log-prob route, real tokens where native
routing would differ, padding (every slot's) not routed natively, the error text of the last pass, and that of a
batch with tokens past its last slot.

Usage (torchrun, 2 ranks): injob_cp_thd_job.py OUT
"""

import sys

import torch
from common import write_json
from te_reference import te_thd_indices

from moeverify import runtime
from moeverify.spec.layout import Layout

HIDDEN, EXPERTS = 16, 8


def main(out: str) -> None:
    from megatron.core import parallel_state as ps
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer.moe.moe_utils import get_default_pg_collection
    from megatron.core.transformer.moe.router import TopKRouter
    from megatron.core.transformer.transformer_config import TransformerConfig

    from moeverify.errors import RouteError
    from moeverify.patches import injob
    from moeverify.patches import router_replay as rr

    rt = runtime.init("cpu")
    with runtime.parallel(Layout(cp=2), seed=0):
        cp, cp_rank = ps.get_context_parallel_world_size(), ps.get_context_parallel_rank()
        config = TransformerConfig(
            num_layers=2,
            hidden_size=HIDDEN,
            num_attention_heads=2,
            num_moe_experts=EXPERTS,
            moe_router_topk=2,
            use_cpu_initialization=True,
            moe_aux_loss_coeff=0.0,
            context_parallel_size=cp,
        )
        torch.manual_seed(0)
        router = TopKRouter(config, pg_collection=get_default_pg_collection())
        router.set_layer_number(1)
        chunk = torch.nn.ModuleList([router])
        g = torch.Generator().manual_seed(7)
        seqs = {u: torch.randint(0, 100, (n,), generator=g) for u, n in (("A", 5), ("B", 3), ("C", 4))}
        hidden = {u: torch.randn(len(s), HIDDEN, generator=g) for u, s in seqs.items()}

        def packed_pass(order, slots):
            cu = torch.tensor([0] + [len(seqs[u]) for u in order]).cumsum(0).int()
            cu_pad = torch.tensor([0] + slots).cumsum(0).int()
            n = int(cu_pad[-1])
            ids, h = torch.zeros(n, dtype=torch.long), torch.randn(n, HIDDEN, generator=g)  # padding: any state
            where = []  # (uid, position), or ("pad", uid, position) for a slot's padding
            for i, u in enumerate(order):
                at = int(cu_pad[i])
                ids[at : at + len(seqs[u])], h[at : at + len(seqs[u])] = seqs[u], hidden[u]
                where += [(u, p) if p < len(seqs[u]) else ("pad", u, p) for p in range(slots[i])]
            mine = te_thd_indices(cu_pad.tolist(), cp=cp, rank=cp_rank)
            packed = PackedSeqParams(
                qkv_format="thd",
                cu_seqlens_q=cu,
                cu_seqlens_kv=cu,
                cu_seqlens_q_padded=cu_pad,
                cu_seqlens_kv_padded=cu_pad,
            )  # global, as megatron-core leaves them under CP
            fwd = injob.ChunkForward(chunk, (ids[mine][None], None, None), {"packed_seq_params": packed})
            h_T1H = h[mine][:, None]
            injob._CURRENT.append(fwd)
            try:
                ids_TK = torch.topk(router(h_T1H)[1].int(), 2).indices.sort().values
            finally:
                injob._CURRENT.pop()
            if fwd.check is not None:
                fwd.check()
            return ids_TK, [where[i] for i in mine], h_T1H

        rr.apply()
        state = injob.InJobState(original=rr.original_routing(), num_experts=EXPERTS)
        rr._ACTIVE[id(router)] = (state, 0)
        result = {"checked": 0, "wrong": [], "native_differs": 0, "padding_not_native": 0, "padding": 0}
        try:
            with torch.no_grad():
                recorded, where, _ = packed_pass(["A", "B"], [8, 4])
            logp = {w: recorded[t].tolist() for t, w in enumerate(where)}
            pooled = [None] * cp
            torch.distributed.all_gather_object(pooled, logp, group=ps.get_context_parallel_group())
            logp = {k: v for part in pooled for k, v in part.items()}
            with torch.no_grad():
                router.weight.add_(torch.randn(router.weight.shape, generator=torch.Generator().manual_seed(3)) * 3)
            replayed, where, h_T1H = packed_pass(["B", "A"], [8, 12])
            native_TK = torch.topk(h_T1H.view(-1, HIDDEN) @ router.weight.t(), 2).indices.sort().values
            for t, w in enumerate(where):
                if w[0] == "pad":  # a slot's padding routes natively, whatever the log-prob pass padded
                    result["padding"] += 1
                    result["padding_not_native"] += not torch.equal(replayed[t], native_TK[t])
                    continue
                assert w in logp, f"rank {rt.rank}: real token {w} not scored by the log-prob pass"
                result["checked"] += 1
                if replayed[t].tolist() != logp[w]:
                    result["wrong"].append([*w, t])
                result["native_differs"] += native_TK[t].tolist() != logp[w]
            try:
                packed_pass(["B", "C"], [4, 4])
                result["refused"] = ""
            except RouteError as e:
                result["refused"] = str(e)
            result["tail_refused"] = tail_refused(chunk, router)
        finally:
            del rr._ACTIVE[id(router)]
            rr.revert()
        write_json(f"{out}.rank{rt.rank}", result)


def tail_refused(chunk, router) -> str:
    """Tokens past the last slot (6 per CP rank, slots ending at 8): not Megatron's per-slot split, refused."""
    from megatron.core.packed_seq_params import PackedSeqParams

    from moeverify.errors import UsageError
    from moeverify.patches import injob

    cu = torch.tensor([0, 8], dtype=torch.int32)
    packed = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu)
    injob._CURRENT.append(
        injob.ChunkForward(chunk, (torch.zeros(1, 6, dtype=torch.long), None, None), {"packed_seq_params": packed})
    )
    try:
        router(torch.randn(6, 1, HIDDEN))
    except UsageError as e:
        return str(e)
    finally:
        injob._CURRENT.pop()
    return ""


if __name__ == "__main__":
    main(sys.argv[1])
