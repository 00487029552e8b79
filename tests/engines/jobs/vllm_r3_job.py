"""In-job R3 on vLLM's own routes under a Megatron layout on 2 ranks (run by tests/engines/test_vllm_r3_ranks.py).

``MOEVERIFY_ROUTER_REPLAY=r3 MOEVERIFY_ROUTER_REPLAY_MODEL=0 torchrun --nproc-per-node 2 -m moeverify.patches.autopatch
vllm_r3_job.py ROLLOUT_DIR OUT LAYOUT``. ROLLOUT_DIR holds what the engine returned (``rollout.json``: the checkpoint,
each request's tokens and its routes file, as vLLM's process saved it). Each rank is a data-parallel rank: it takes
every other request, decodes its payloads with ``engine_routes.from_vllm`` and hands them over with its batch
(``injob.add_routes``), the lines a trainer adds; then the log-prob pass and the training pass. ``RouteLog`` reads
what each router really did; a second model of the same weights, not bound, runs the same step natively. Each rank
writes OUT.rank{R}: tokens checked against the engine's route, mismatches, last tokens against native routing, and
whether the loss and every gradient equal the native step's bit for bit.
"""

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "special_distributed" / "jobs"))
from common import RouteLog, grad_digest, write_json  # noqa: E402

from moeverify import models, runtime  # noqa: E402
from moeverify.routing import engine_routes as er  # noqa: E402
from moeverify.routing.npy_file import load_npy  # noqa: E402
from moeverify.spec.layout import Layout  # noqa: E402
from moeverify.spec.models.ref import ModelRef  # noqa: E402

LAYOUTS = {"ep2": Layout(ep=2), "tp2sp": Layout(tp=2, sp=True)}


def step(chunk, ids, pad):
    pos = torch.arange(ids.shape[1]).expand_as(ids)
    with torch.no_grad():
        chunk(ids, pos, None, padding_mask=pad)
    out = chunk(ids, pos, None, padding_mask=pad)
    loss = out.float().square().masked_fill(pad[..., None], 0).sum()
    loss.backward()
    return loss.detach()


def main(rollout_dir: str, out: str, layout_name: str) -> None:
    from moeverify.errors import RouteError
    from moeverify.patches import injob

    layout = LAYOUTS[layout_name]
    rollout = json.loads((Path(rollout_dir) / "rollout.json").read_text())
    rt = runtime.init("cpu")
    with runtime.parallel(layout, seed=0):
        actor = models.build(ModelRef.user(rollout["checkpoint"]), layout, seed=0)  # model 0: bound
        native = models.build(ModelRef.user(rollout["checkpoint"]), layout, seed=0)  # same weights, native
        dp = 1 if layout.tp > 1 else rt.world_size  # TP2: both ranks see every sequence
        rank = 0 if layout.tp > 1 else rt.rank
        mine = rollout["requests"][rank::dp]
        sequences = [torch.tensor(r["tokens"]) for r in mine]
        decoded = [
            er.from_vllm(
                load_npy(Path(rollout_dir) / r["routes"], error=RouteError),
                num_tokens=len(r["tokens"]),
                physical=False,
                numbering="decoder",
                request=r["id"],
            )
            for r in mine
        ]
        injob.add_routes(version=0, sequences=sequences, routes=decoded)  # the trainer's added lines

        width = max(len(s) for s in sequences) + 2
        width += width % 2  # sequence parallel splits the sequence dimension in two
        ids = torch.zeros(len(sequences), width, dtype=torch.long)
        pad = torch.ones(len(sequences), width, dtype=torch.bool)
        for b, seq in enumerate(sequences):
            ids[b, : len(seq)], pad[b, : len(seq)] = seq, False
        log = RouteLog(actor.model_chunks)
        log.active = True
        loss = step(actor.model_chunks[0], ids, pad)
        ref_loss = step(native.model_chunks[0], ids, pad)

        parts = layout.tp if layout.sp else 1
        tp_rank = rt.rank if layout.sp else 0
        part = width // parts
        where = [  # (request, position) of each token this rank's router sees, router order s * B + b
            None if pad[b, s] else (b, s) for s in range(tp_rank * part, (tp_rank + 1) * part) for b in range(len(mine))
        ]
        checked, wrong, last, last_wrong = 0, [], 0, []
        for layer, calls in log.forward.items():
            for call, native_TK in zip(calls, log.native[layer], strict=True):  # log-prob, then training
                for t, w in enumerate(where):
                    if w is None:
                        continue
                    b, s = w
                    if s == len(sequences[b]) - 1:
                        last += 1
                        if sorted(call[t]) != sorted(native_TK[t]):
                            last_wrong.append([layer, b, s])
                        continue
                    checked += 1
                    if sorted(call[t]) != sorted(decoded[b].routes[s, layer].tolist()):
                        wrong.append([layer, b, s, sorted(call[t]), decoded[b].routes[s, layer].tolist()])
        mine_grads, ref_grads = grad_digest(actor.model_chunks), grad_digest(native.model_chunks)
        write_json(
            f"{out}.rank{rt.rank}",
            {
                "checked": checked,
                "wrong": wrong[:10],
                "last": last,
                "last_wrong": last_wrong[:10],
                "rows": sum(len(s) - 1 for s in sequences),
                "sequences": len(sequences),
                "layers": len(log.forward),
                "calls": {str(k): len(v) for k, v in log.forward.items()},
                "loss_equal": bool(torch.equal(loss, ref_loss)),
                "grads_differ": [k for k in mine_grads if mine_grads[k] != ref_grads[k]][:10],
                "grads": len(mine_grads),
            },
        )


if __name__ == "__main__":
    main(*sys.argv[1:4])
