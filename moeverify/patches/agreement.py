"""Live agreement guard: per step and global layer, the share of replayed tokens whose top-k expert set is the one
native routing would choose now.

Legend of shape suffixes: T = tokens of one router call, K = top-k.

On by default in in-job replay (r2, r3) and in a session's ``replay()`` of routes another process chose
(``Routes.from_rollout``, a dump's); elsewhere ``MOEVERIFY_AGREEMENT=PATH.jsonl`` turns it on (session ``replay()``,
autopatch ``replay:DIR``). ``MOEVERIFY_AGREEMENT_MIN=0.99`` fails a step whose agreement in some layer falls below
it; the chance floor (``MOEVERIFY_AGREEMENT_FLOOR``) one whose replayed ids do no better than random ids; the
numbering check (engine routes: on by default, ``MOEVERIFY_AGREEMENT_NUMBERING=off``) one where an engine expert id
routes like another trainer expert (a permutation, a swapped pair, a stale EPLB map: ``numbering_faults``). Code
users call ``agreement.guard(path=..., minimum=..., writer=..., floor=..., numbering=...)`` instead.

**Fail closed**: the step is decided *before* the update, in a pre-hook of ``optimizer.step()``: a failing step
raises ``RouteError`` before any parameter changes. Across ranks (torch.distributed initialized) every rank that ran
a counted or bound forward since the last decision takes part in one small all-reduce (bounded by
``MOEVERIFY_COLLECTIVE_TIMEOUT_S``), so a rank that fails stops every rank before its optimizer runs; a rank that
passed names the failing ranks. One line per step goes to the job's log (stderr, rank 0: per pass, the replayed
tokens and the lowest layer agreement over the ranks); ``MOEVERIFY_AGREEMENT_LOG=off`` (``log=False``) quiets it.

What is counted: each forward routing call served by a replay hook (never a log-prob or native call, never a
recompute inside backward), every token of the call: its replayed ids against megatron-core's own top-k of the
same selection scores (``default_compute_topk``: score function, expert bias, groups as the router has them),
compared as sets. Counts stay on the device; the host reads them once per step.

A step ends at each ``optimizer.step()`` of any torch optimizer in the process (a global pre-hook; Megatron's
optimizers step torch optimizers inside) that follows counted calls, or at ``Guard.end_step()``. Per step one
JSON line per layer goes to the rank's file (``PATH`` on one rank, ``STEM.rankR.jsonl`` beside it otherwise), and
one scalar per layer to the job's logger where one is found: the ``writer=`` given, else Megatron's TensorBoard
writer (``megatron.training.global_vars``) and an active wandb run, only if the job imported them.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import sys
from pathlib import Path
from typing import TextIO

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from moeverify.errors import SHOW_NAMES, RouteError, UsageError, more
from moeverify.spec import timeouts

ENV = "MOEVERIFY_AGREEMENT"
MIN_ENV = "MOEVERIFY_AGREEMENT_MIN"
FLOOR_ENV = "MOEVERIFY_AGREEMENT_FLOOR"
NUMBERING_ENV = "MOEVERIFY_AGREEMENT_NUMBERING"  # on / off
LOG_ENV = "MOEVERIFY_AGREEMENT_LOG"  # on / off: the guard's line per step in the job's log
OFF = "off"
CHANCE = "chance"  # the default floor of in-job replay: better than random expert ids (module docstring)
TAG = "moeverify/agreement/layer{layer}"
PASS_TAG = "moeverify/agreement/{kind}/layer{layer}"
PASSES = ("training", "log_prob", "replay")  # in-job passes; "replay": a session's or a whole-job replay's calls
Z = 3.0  # standard deviations above chance that a sample must show to pass the chance floor below its margin
# The numbering check (``numbering_faults``): an engine expert is judged on at least this many of its replayed
# tokens, and named when another trainer expert takes at least this share of them, more than the expert itself
# does, by ``Z`` standard deviations of a sign test between the two.
NUMBERING_MIN_TOKENS = 8
NUMBERING_SHARE = 0.5

ACTIVE: Guard | None = None  # read on the routing hot path: None costs one global load per call


def chance_floor(*, topk: int, num_experts: int, slots: int) -> tuple[float, float]:
    """``(chance, floor)``: the mean overlap random top-``topk`` ids of ``num_experts`` have with any top-k
    (``topk / num_experts``), and the overlap below which ``slots`` replayed slots are judged no better than random:
    below both a quarter of the way from chance to 1 and ``Z`` standard deviations of a random sample above chance."""
    chance = topk / num_experts
    margin = chance + (1.0 - chance) / 4
    noise = chance + Z * math.sqrt(chance * (1.0 - chance) / max(slots, 1))
    return chance, min(margin, noise)


def numbering_faults(pairs_EE: torch.Tensor, *, topk: int) -> list[tuple[int, int, int, int, int]]:
    """Engine experts that route like another trainer expert: ``[(engine e, trainer f, tokens, on f, on e)]``.

    ``pairs_EE[e, f]``: replayed tokens holding engine id ``e`` whose native top-k (the trainer's own routing of
    the same token) holds ``f``. In a healthy job, drifted or not, the tokens an engine sends to ``e`` are mostly
    the ones the trainer sends to ``e``: ``pairs[e, e]`` leads its row. Under another numbering (a permutation, a
    swapped pair, a stale EPLB map) engine id ``e`` means trainer expert ``f``: ``pairs[e, f]`` leads, and overall
    agreement can stay high where only some experts moved. ``e`` is named when it holds at least
    ``NUMBERING_MIN_TOKENS`` tokens and some ``f != e`` takes at least ``NUMBERING_SHARE`` of them, more than ``e``
    itself does and more than ``f``'s share of every token (half-way from it to 1: an expert the trainer picks
    for most tokens anyway is no evidence), each by ``Z`` standard deviations, while engine id ``f`` routes like
    trainer ``f`` in at most half that share (drift where trainer ``f`` took over ``e``'s tokens keeps ``f``'s own:
    not a numbering). Ids with no relation to the trainer's routing (another model's, random) spread a row as the
    trainer's shares go: the chance floor's case."""
    return numbering_faults_of(pairs_EE[None], topk=topk)[0]


def numbering_faults_of(pairs_PEE: torch.Tensor, *, topk: int) -> list[list[tuple[int, int, int, int, int]]]:
    """``numbering_faults`` of each ``[E, E]`` table of a stack ``[P, E, E]`` (one host read for all)."""
    pairs_PEE = pairs_PEE.to(torch.int64)
    tokens_PE = pairs_PEE.sum(dim=2) // topk  # a token holding e adds its K native ids to row e
    counted_P1 = (pairs_PEE.sum(dim=(1, 2)) // (topk * topk)).clamp(min=1)[:, None]
    base_PE = (pairs_PEE.sum(dim=1).double() / topk / counted_P1).clamp(max=1.0)  # tokens the trainer sends to f
    self_PE = pairs_PEE.diagonal(dim1=1, dim2=2)
    eye_EE = torch.eye(pairs_PEE.shape[1], dtype=torch.bool, device=pairs_PEE.device)
    best_PE, like_PE = pairs_PEE.masked_fill(eye_EE, -1).max(dim=2)
    n, best, own = tokens_PE.double(), best_PE.double(), self_PE.double()
    p = base_PE.gather(1, like_PE)
    # engine id f itself: in another numbering it means some other expert, so it rarely routes like trainer f; in
    # drift where trainer f took over e's tokens, f keeps its own as well
    f_self = (own / n.clamp(min=1)).gather(1, like_PE)
    flagged_PE = (
        (tokens_PE >= NUMBERING_MIN_TOKENS)
        & (2 * f_self * n <= best)
        & (best >= NUMBERING_SHARE * n)
        & (best >= n * (1.0 + p) / 2)
        & (best - own >= Z * (best + own).clamp(min=1).sqrt())
        & (best - n * p >= Z * (n * p * (1 - p)).clamp(min=1).sqrt())
    )
    found: list[list[tuple[int, int, int, int, int]]] = [[] for _ in range(pairs_PEE.shape[0])]
    at = flagged_PE.nonzero()
    if at.numel():
        i, e = at[:, 0], at[:, 1]
        read = torch.stack([i, e, like_PE[i, e], tokens_PE[i, e], best_PE[i, e], self_PE[i, e]], dim=1).tolist()
        for i_, *fault in read:
            found[i_].append((fault[0], fault[1], fault[2], fault[3], fault[4]))
    return [sorted(faults, key=lambda r: (r[4] - r[3], r[0])) for faults in found]


class Guard:
    """Per-pass, per-layer agreement counts of replayed router calls, flushed per step (see the module docstring).

    Args:
        path: the JSONL file of rows (None: rows kept in ``history`` only).
        minimum: fail a step whose agreement (exact top-k sets) falls below this share in some pass and layer.
        floor: ``"chance"``: fail a step whose replayed ids overlap native routing's no better than random ids would
            (``chance_floor``); a number: fail below that mean overlap; None: no floor.
        writer: a TensorBoard-like ``add_scalar`` logger.
        numbering: fail a step where an engine expert id routes like another trainer expert
            (``numbering_faults``): routes another process chose.
        log: one line per step on rank 0's stderr (module docstring).
        group: the process group deciding a step together (default: every rank, where torch.distributed is
            initialized).
    """

    def __init__(
        self,
        *,
        path: str | os.PathLike | None = None,
        minimum: float | None = None,
        writer=None,
        floor: str | float | None = None,
        numbering: bool = False,
        log: bool = True,
        group=None,
    ):
        for name, value in (("minimum", minimum), ("floor", None if floor == CHANCE else floor)):
            if value is not None and not (isinstance(value, (int, float)) and 0.0 <= value <= 1.0):
                raise UsageError(f"agreement {name} {value!r}: expected a share in [0, 1]")
        self.path = Path(path) if path is not None else None
        self.minimum = minimum
        self.floor = floor
        self.numbering = bool(numbering)
        self.log = bool(log)
        self.group = group
        self.writer = writer
        self.step = 0  # steps flushed with counted calls
        self.fresh = False  # new routes arrived since the last flush (``routes_changed``)
        self.pending = False  # a counted call or a bound forward since the last decision (``note_forward``)
        self.history: list[dict] = []  # every row written, for code users and tests
        # (pass, layer) -> [overlap histogram (device tensor, ``count``), calls' tokens, top-k, experts,
        # engine-id x native-id pairs (``numbering``; device tensor [E * E]) or None]
        self._counts: dict[tuple[str, int], list] = {}
        self._bins: dict[tuple, torch.Tensor] = {}  # (device, top-k) -> the histogram's bin numbers
        self._file: TextIO | None = None
        self._hook = register_optimizer_step_pre_hook(self._before_optimizer_step)

    def count(
        self,
        layer: int,
        replayed_TK: torch.Tensor,
        native_TK: torch.Tensor,
        *,
        kind: str = "replay",
        num_experts: int | None = None,
        pad_T: torch.Tensor | None = None,
        routed_natively_T: torch.Tensor | None = None,
    ) -> None:
        """Count one routing call. Tokens of ``pad_T`` (padding the model was told of) and ``routed_natively_T``
        (tokens the replay routed natively: padding, tokens with no route) are left out and counted apart.

        A handful of kernels and no host sync: each token's overlap (0..K replayed ids native also picks) goes
        into one histogram per call, ``K + 1`` bins for each of counted, padding and routed-natively tokens,
        added on the device to the step's; ``end_step`` reads every histogram of the step at once."""
        t, k = replayed_TK.shape
        device = replayed_TK.device
        with torch.no_grad():
            hits_T = (replayed_TK[:, :, None] == native_TK[:, None, :]).any(dim=2).sum(dim=1)
            if pad_T is not None or routed_natively_T is not None:
                other_T = torch.zeros(t, dtype=torch.int64, device=device)  # 0 counted, 1 padding, 2 native
                if routed_natively_T is not None:
                    other_T = other_T.masked_fill(routed_natively_T.to(device=device, dtype=torch.bool), 2)
                if pad_T is not None:
                    pad_T = pad_T.reshape(-1).to(device=device, dtype=torch.bool)
                    if pad_T.numel() != t:
                        raise RouteError(
                            f"agreement guard: layer {layer}: the router's padding mask holds "
                            f"{pad_T.numel()} tokens, the call routes {t}"
                        )
                    other_T = other_T.masked_fill(pad_T, 1)
                hits_T = hits_T + (k + 1) * other_T
            bins_B = self._bins.get((device, k))
            if bins_B is None:
                bins_B = self._bins[(device, k)] = torch.arange(3 * (k + 1), device=device)
            hist_B = (hits_T[:, None] == bins_B).sum(dim=0)
            pairs = None
            if self.numbering and num_experts:
                pairs = _pairs(replayed_TK, native_TK, hits_T < k + 1, num_experts)
        self.pending = True
        counts = self._counts.get((kind, layer))
        if counts is None:
            self._counts[(kind, layer)] = [hist_B, t, k, num_experts, pairs]
        else:
            counts[0] += hist_B
            counts[1] += t
            if pairs is not None:
                counts[4] = pairs if counts[4] is None else counts[4] + pairs

    def _before_optimizer_step(self, optimizer, args, kwargs) -> None:
        if self._counts or (self.pending and _world(self.group) > 1):
            self.end_step()

    def end_step(self) -> dict[int, float]:
        """Decide this step: ``{layer: agreement}`` of the training (or replay) pass; every pass's rows go to
        ``history``, the file and the logger. Raises ``RouteError`` below the minimum or the floor, or on an
        expert numbering fault, here or (distributed) on another rank of the group: before the optimizer's
        update when called from its pre-hook. Collective over the group where torch.distributed runs."""
        self.pending = False
        rows: list[dict] = []
        problem = None
        rank = _rank()
        if self._counts:
            self.step += 1
            entries = sorted(self._counts.items(), key=lambda item: (PASSES.index(item[0][0]), item[0][1]))
            device = entries[0][1][0].device
            read = torch.cat([counts[0].to(device) for _, counts in entries]).tolist()  # one host read a step
            at = 0
            for (kind, layer), (_, tokens, k, experts, _) in entries:
                hist, at = read[at : at + 3 * (k + 1)], at + 3 * (k + 1)
                counted = hist[: k + 1]
                values = [
                    counted[k],
                    sum(i * n for i, n in enumerate(counted)),
                    sum(counted),
                    sum(hist[k + 1 : 2 * (k + 1)]),
                    sum(hist[2 * (k + 1) :]),
                ]
                rows.append(self._row(kind, layer, [*values, tokens, k, experts], rank))
            faults = self._numbering(entries, rows)
            self._counts.clear()
            self.history.extend(rows)
            self._write(rows, rank)
            self._log(rows)
            problem = self._judge(rows, rank, faults)
        problem = self._decide(rows, rank, problem)
        if problem is not None:
            raise RouteError(problem)
        return {row["layer"]: row["agreement"] for row in rows if row["pass"] != "log_prob"}

    @staticmethod
    def _numbering(entries: list, rows: list[dict]) -> list[tuple[dict, list]]:
        """The numbering check of every (pass, layer) that counted pairs, grouped by shape: one read per group."""
        faults: list[tuple[dict, list]] = []
        groups: dict[tuple[int, int], list[int]] = {}
        for i, (_, counts) in enumerate(entries):
            if counts[4] is not None:
                groups.setdefault((counts[2], counts[3]), []).append(i)
        for (k, experts), at in groups.items():
            stack = torch.stack([entries[i][1][4].view(experts, experts) for i in at])
            for i, found in zip(at, numbering_faults_of(stack, topk=k), strict=True):
                if found:
                    rows[i]["numbering_faults"] = [list(f) for f in found]
                    faults.append((rows[i], found))
        return faults

    def _decide(self, rows: list[dict], rank: int, problem: str | None) -> str | None:
        """Every rank of the group learns whether any failed, and rank 0 logs the step's line: one all-reduce of a
        ``[world, 1 + 2 * passes]`` table (failed; per pass the replayed tokens and the lowest layer agreement)."""
        world = _world(self.group)
        table = [[0.0] * (1 + 2 * len(PASSES))]
        mine = table[0]
        mine[0] = 1.0 if problem is not None else 0.0
        for i, kind in enumerate(PASSES):
            judged = [r for r in rows if r["pass"] == kind and r["tokens"]]
            mine[1 + 2 * i] = float(sum(r["tokens"] for r in judged))
            mine[2 + 2 * i] = min((r["agreement"] for r in judged), default=2.0)
        if world > 1:
            table = self._gather(mine, world, rank)
        if self.log and (rank == 0 or world == 1) and any(row[1 + 2 * i] for row in table for i in range(len(PASSES))):
            print(_step_line(self.step, table), file=sys.stderr, flush=True)
        failed = [r for r, row in enumerate(table) if row[0]]
        if problem is None and failed:
            shown = ", ".join(map(str, failed[:SHOW_NAMES])) + more(len(failed), SHOW_NAMES)
            return (
                f"agreement guard: step {self.step} rank {rank}: rank(s) {shown} of {world} failed the guard "
                "(their error names pass, layer and figure); this rank stops before the optimizer's update too"
            )
        return problem

    def _gather(self, mine: list[float], world: int, rank: int) -> list[list[float]]:
        dist = torch.distributed
        group_rank = dist.get_rank(self.group) if self.group is not None else rank
        backend = dist.get_backend(self.group)
        device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
        table = torch.zeros(world, len(mine), dtype=torch.float64, device=device)
        table[group_rank] = torch.tensor(mine, dtype=torch.float64)
        wait_bounded(
            dist.all_reduce(table, group=self.group, async_op=True),
            f"agreement guard: step {self.step} rank {rank}: the ranks did not all reach the step's decision",
            "a rank ran no forward of the bound model this step, or another optimizer steps in between?",
        )
        return table.tolist()

    def _row(self, kind: str, layer: int, counts: list, rank: int) -> dict:
        agree, hits, counted, pad, native, calls_tokens, k, experts = counts
        counted = int(counted)
        row = {
            "step": self.step,
            "pass": kind,
            "layer": layer,
            "rank": rank,
            "agreement": int(agree) / counted if counted else None,
            "overlap": int(hits) / (counted * k) if counted else None,
            "tokens": counted,
            "padding": int(pad),
            "routed_natively": int(native),
            "routed": calls_tokens,
        }
        if experts:
            row["chance"], row["floor"] = chance_floor(topk=k, num_experts=experts, slots=counted * k)
        return row

    def _judge(self, rows: list[dict], rank: int, faults: list[tuple[dict, list]]) -> str | None:
        """The step's first failure (numbering, then minimum, then floor) as a message; None when it passes."""

        def fail(row: dict, what: str, got: float, want: float, setting: str, count: int) -> str:
            return (
                f"agreement guard: step {self.step} {row['pass']} pass layer {row['layer']} rank {rank}: "
                f"{what} {got:.4%} over {row['tokens']} replayed tokens (padding {row['padding']} and "
                f"tokens routed natively {row['routed_natively']} not counted), expected at least "
                f"{want:.4%} ({setting}); {count} pass-layer(s) below"
            )

        judged = [r for r in rows if r["tokens"]]
        fresh, self.fresh = self.fresh, False
        if faults:
            row, found = max(faults, key=lambda item: item[1][0][3] - item[1][0][4])
            e, f, tokens, on_f, on_e = found[0]
            others = more(len(found), 1, what="engine expert(s) of this layer")
            layers = {(r["pass"], r["layer"]) for r, _ in faults}
            return (
                f"agreement guard: step {self.step} {row['pass']} pass layer {row['layer']} rank {rank}: engine "
                f"expert {e} routes like trainer expert {f} in {on_f / tokens:.0%} of its {tokens} replayed tokens "
                f"(like trainer expert {e} in {on_e / tokens:.0%}){others}; {len(layers)} pass-layer(s) so: the "
                "engine's expert ids are in another numbering (EPLB physical slots without their map or with a "
                "stale one, a permuted or swapped expert order in the weight sync); give the engine's expert map "
                f"(expert_map=) or fix the sync. {NUMBERING_ENV}=off turns this check off"
            )
        if self.minimum is not None:
            below = [r for r in judged if r["agreement"] < self.minimum]
            if below:
                worst = min(below, key=lambda r: r["agreement"])
                return fail(
                    worst,
                    "agreement (top-k set equal to native routing's)",
                    worst["agreement"],
                    self.minimum,
                    MIN_ENV,
                    len(below),
                )
        if self.floor is not None:
            if self.floor == CHANCE:  # judged where the weights are those the routes were made for (docstring)
                judged = [r for r in judged if r["pass"] != "training" or fresh]
            floors: dict[int, float | None] = {
                id(r): r.get("floor") if isinstance(self.floor, str) else float(self.floor) for r in judged
            }
            below = [r for r in judged if floors[id(r)] is not None and r["overlap"] < floors[id(r)]]
            if below:
                worst = min(below, key=lambda r: r["overlap"] - floors[id(r)])
                what = (
                    (
                        "overlap (replayed experts native routing also picks; random ids give "
                        f"{worst.get('chance', 0):.4%}), no better than random ids: another expert numbering (EPLB "
                        "physical slots without their map), another model's or step's routes?"
                    )
                    if self.floor == CHANCE
                    else "overlap (replayed experts native routing also picks)"
                )
                return fail(
                    worst,
                    what,
                    worst["overlap"],
                    floors[id(worst)] or 0.0,
                    f"{FLOOR_ENV}={self.floor}"
                    if self.floor != CHANCE
                    else f"{FLOOR_ENV}={CHANCE}, the default of in-job replay; {FLOOR_ENV}={OFF} turns it off",
                    len(below),
                )
        return None

    def _write(self, rows: list[dict], rank: int) -> None:
        if self.path is None:
            return
        if self._file is None:
            path = self.path
            if _world() > 1:
                path = path.with_name(f"{path.stem}.rank{rank}{path.suffix or '.jsonl'}")
            path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(path, "a", encoding="utf-8")  # noqa: SIM115 (open for the job's lifetime)
        self._file.write("".join(json.dumps(row) + "\n" for row in rows))
        self._file.flush()

    def _log(self, rows: list[dict]) -> None:
        scalars = {
            (
                TAG.format(layer=r["layer"])
                if r["pass"] != "log_prob"
                else PASS_TAG.format(kind=r["pass"], layer=r["layer"])
            ): r["agreement"]
            for r in rows
            if r["agreement"] is not None
        }
        for writer in self._writers():
            for tag, share in scalars.items():
                writer.add_scalar(tag, share, self.step)
        wandb = sys.modules.get("wandb")  # only a job that imported wandb and started a run
        if self.writer is None and wandb is not None and getattr(wandb, "run", None) is not None:
            wandb.log(scalars, commit=False)

    def _writers(self) -> list:
        if self.writer is not None:
            return [self.writer]
        global_vars = sys.modules.get("megatron.training.global_vars")
        getter = getattr(global_vars, "get_tensorboard_writer", None)
        writer = getter() if getter is not None else None
        return [writer] if writer is not None else []

    def close(self) -> None:
        self._hook.remove()
        if self._file is not None:
            self._file.close()
            self._file = None


class Watched:
    """A replay hook (Megatron's ``router_replay`` protocol) whose replayed ids are counted against native's.

    The inner hook may say which pass it serves (``kind``) and which tokens it routed natively (``native_T``);
    ``pad_T`` is the padding mask the router was called with."""

    __slots__ = ("inner", "guard", "layer", "pad_T", "num_experts")

    def __init__(self, inner, guard: Guard, layer: int, pad_T=None, num_experts: int | None = None):
        self.inner, self.guard, self.layer, self.pad_T, self.num_experts = inner, guard, layer, pad_T, num_experts

    def get_replay_topk(self, scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
        values_TK, ids_TK = self.inner.get_replay_topk(scores, topk, num_groups, group_topk, default_compute_topk)
        native_TK = getattr(self.inner, "last_native_TK", None)
        if native_TK is None:
            with torch.no_grad():
                _, native_TK = default_compute_topk(scores.detach(), topk, num_groups=num_groups, group_topk=group_topk)
        self.guard.count(
            self.layer,
            ids_TK,
            native_TK,
            kind=getattr(self.inner, "kind", "replay"),
            num_experts=self.num_experts,
            pad_T=self.pad_T,
            routed_natively_T=getattr(self.inner, "native_T", None),
        )
        return values_TK, ids_TK


def watch(hook, router, pad_T=None):
    """``hook``, counted by the active guard when it replays and this is a forward (not a recompute in backward);
    ``pad_T``: the padding mask of the routing call."""
    guard = ACTIVE
    if guard is None or not getattr(hook, "REPLAYS", False) or torch._C._current_graph_task_id() != -1:
        return hook
    layer = router.layer_number - 1 + (router.config.num_layers if getattr(router, "is_mtp_layer", False) else 0)
    return Watched(hook, guard, layer, pad_T, router.num_experts)


def guard(
    *,
    path: str | os.PathLike | None = None,
    minimum: float | None = None,
    writer=None,
    floor: str | float | None = None,
    numbering: bool = False,
    log: bool = True,
    group=None,
) -> Guard:
    """Start the process's agreement guard (one at a time); ``stop()`` ends it. Arguments as ``Guard``'s."""
    global ACTIVE
    if ACTIVE is not None:
        raise UsageError("an agreement guard is already active in this process: call agreement.stop() first")
    ACTIVE = Guard(path=path, minimum=minimum, writer=writer, floor=floor, numbering=numbering, log=log, group=group)
    return ACTIVE


def note_forward() -> None:
    """A forward of the bound model ran (in-job replay's chunk hook): this rank takes part in the step's decision
    across ranks even where it counted no routing call (a pipeline stage of dense layers only)."""
    if ACTIVE is not None:
        ACTIVE.pending = True


def routes_changed() -> None:
    """In-job replay serves new routes (a rollout step or batch): the next step's training pass is judged by the
    chance floor (it runs on the weights the routes were made for, before this RL step's first optimizer step)."""
    if ACTIVE is not None:
        ACTIVE.fresh = True


def stop() -> None:
    global ACTIVE
    if ACTIVE is not None:
        ACTIVE.close()
        ACTIVE = None


def _share(name: str, value: str) -> float:
    try:
        share = float(value)
    except ValueError:
        share = math.nan
    if not 0.0 <= share <= 1.0:
        raise UsageError(f"{name}={value!r}: expected a share in [0, 1], e.g. 0.99")
    return share


def _check_writable(path: str) -> None:
    """The rows' file can be written (refused now, naming the variable, not at the first step)."""
    target = Path(path)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        writable = (
            not target.is_dir()
            and os.access(target.parent, os.W_OK)
            and (not target.exists() or os.access(target, os.W_OK))
        )
    except OSError as exc:
        raise UsageError(f"{ENV}={path[:80]!r}: not a file path this job can write ({exc.strerror})") from exc
    if not writable:
        raise UsageError(f"{ENV}={path[:80]!r}: not a writable file path (where the per-step agreement rows go)")


def _switch(name: str, default: bool) -> bool:
    value = os.environ.get(name) or None
    if value is None:
        return default
    if value not in ("on", OFF):
        raise UsageError(f"{name}={value[:40]!r}: expected 'on' or 'off'")
    return value == "on"


def from_env(
    *, in_job: bool = False, floor_default: str | None = None, numbering_default: bool = False
) -> Guard | None:
    """Start the guard from ``MOEVERIFY_AGREEMENT`` / ``_MIN`` / ``_FLOOR`` / ``_NUMBERING`` / ``_LOG`` (autopatch
    calls it).

    Args:
        in_job: in-job replay (r2, r3, routes from the batch): the guard is on unless ``MOEVERIFY_AGREEMENT=off``;
            elsewhere it is off unless ``MOEVERIFY_AGREEMENT=PATH.jsonl`` is set.
        floor_default: the floor when ``MOEVERIFY_AGREEMENT_FLOOR`` is unset (``"chance"`` for a rollout engine's
            routes).
        numbering_default: the numbering check when ``MOEVERIFY_AGREEMENT_NUMBERING`` is unset (on for a rollout
            engine's routes).
    """
    path, minimum, floor = (os.environ.get(name) or None for name in (ENV, MIN_ENV, FLOOR_ENV))
    numbering = _switch(NUMBERING_ENV, numbering_default)
    log = _switch(LOG_ENV, True)
    if in_job and ACTIVE is not None and path is minimum is floor is None:
        return None  # the job started its own guard (agreement.guard()): it counts in-job replay too
    if path == OFF:
        if minimum is not None or floor not in (None, OFF) or os.environ.get(NUMBERING_ENV) == "on":
            raise UsageError(
                f"{ENV}={OFF} turns the agreement guard off, but {MIN_ENV}, {FLOOR_ENV} or {NUMBERING_ENV} asks "
                "it to judge the job: unset one of them"
            )
        return None
    if not in_job:
        if path is None and minimum is None and floor is None:
            return None
        if path is None:
            name, value = (MIN_ENV, minimum) if minimum is not None else (FLOOR_ENV, floor)
            raise UsageError(f"{name}={value} needs {ENV}=PATH.jsonl (where the per-step agreement goes)")
    if path is not None:
        _check_writable(path)
    share = _share(MIN_ENV, minimum) if minimum is not None else None
    judged: str | float | None = floor
    if floor is None:
        judged = floor_default
    elif floor == OFF:
        judged = None
    elif floor != CHANCE:
        judged = _share(FLOOR_ENV, floor)
    return guard(path=path, minimum=share, floor=judged, numbering=numbering, log=log)


def _rank() -> int:
    dist = torch.distributed
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def wait_bounded(work, what: str, why: str) -> None:
    """Wait for an async collective at most ``timeouts.COLLECTIVE_S``; past it ``RouteError``: ``what`` did not
    finish within it, ``why`` (the likely cause)."""
    try:
        work.wait(timeout=datetime.timedelta(seconds=timeouts.COLLECTIVE_S))
    except RuntimeError as exc:
        raise RouteError(
            f"{what} within {timeouts.COLLECTIVE_S} s (MOEVERIFY_COLLECTIVE_TIMEOUT_S): {why} ({exc})"
        ) from exc


def _world(group=None) -> int:
    dist = torch.distributed
    return dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1


def _pairs(replayed_TK: torch.Tensor, native_TK: torch.Tensor, counted_T: torch.Tensor, experts: int) -> torch.Tensor:
    """``[E * E]``: per (engine id, native id) pair, the counted tokens holding both (``numbering_faults``)."""
    t, k = replayed_TK.shape
    pair_TKK = replayed_TK.long()[:, :, None] * experts + native_TK.long()[:, None, :]
    pair_TKK = pair_TKK.masked_fill(~counted_T[:, None, None], experts * experts)  # padding, native: one spare bin
    return torch.bincount(pair_TKK.reshape(-1), minlength=experts * experts + 1)[: experts * experts]


def _step_line(step: int, table: list[list[float]]) -> str:
    """The step's line in the job's log: per pass, replayed tokens over the ranks and the lowest layer agreement."""
    parts = []
    for i, kind in enumerate(PASSES):
        tokens = int(sum(row[1 + 2 * i] for row in table))
        if not tokens:
            continue
        lowest, at = min((row[2 + 2 * i], r) for r, row in enumerate(table) if row[1 + 2 * i])
        where = f" (rank {at})" if len(table) > 1 else ""
        parts.append(f"{kind} pass {tokens} replayed tokens, lowest layer agreement {lowest:.2%}{where}")
    failed = sum(1 for row in table if row[0])
    verdict = f"FAILED on {failed} rank(s)" if failed else "ok"
    return f"moeverify agreement guard: step {step}: " + "; ".join(parts) + f"; {verdict} ({LOG_ENV}=off quiets this)"
