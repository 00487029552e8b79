"""Live agreement guard: per step and global layer, the share of replayed tokens whose top-k expert set is the one
native routing would choose now.

Legend of shape suffixes: T = tokens of one router call, K = top-k.

Off by default. ``MOEVERIFY_AGREEMENT=PATH.jsonl`` turns it on for every replay mode of the patch (session
``replay()``, autopatch ``replay:DIR``, in-job ``r2``); ``MOEVERIFY_AGREEMENT_MIN=0.99`` fails the job with
``RouteError`` (step, layer, rank, agreement vs minimum) at the end of a step whose agreement in some layer falls
below it. Code users call ``agreement.guard(path=..., minimum=..., writer=...)`` instead.

What is counted: each forward routing call served by a replay hook (never a log-prob or native call, never a
recompute inside backward), every token of the call: its replayed ids against megatron-core's own top-k of the
same selection scores (``default_compute_topk``: score function, expert bias, groups as the router has them),
compared as sets. Counts stay on the device; the host reads them once per step.

A step ends at each ``optimizer.step()`` of any torch optimizer in the process (a global post-hook; Megatron's
optimizers step torch optimizers inside) that follows counted calls, or at ``Guard.end_step()``. Per step one
JSON line per layer goes to the rank's file (``PATH`` on one rank, ``STEM.rankR.jsonl`` beside it otherwise), and
one scalar per layer to the job's logger where one is found: the ``writer=`` given, else Megatron's TensorBoard
writer (``megatron.training.global_vars``) and an active wandb run, only if the job imported them.
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

from moeverify.errors import RouteError, UsageError

ENV = "MOEVERIFY_AGREEMENT"
MIN_ENV = "MOEVERIFY_AGREEMENT_MIN"
FLOOR_ENV = "MOEVERIFY_AGREEMENT_FLOOR"
OFF = "off"
CHANCE = "chance"  # the default floor of in-job replay: better than random expert ids (module docstring)
TAG = "moeverify/agreement/layer{layer}"
PASS_TAG = "moeverify/agreement/{kind}/layer{layer}"
PASSES = ("training", "log_prob", "replay")  # in-job passes; "replay": a session's or a whole-job replay's calls
Z = 3.0  # standard deviations above chance that a sample must show to pass the chance floor below its margin

ACTIVE: Guard | None = None  # read on the routing hot path: None costs one global load per call


def chance_floor(*, topk: int, num_experts: int, slots: int) -> tuple[float, float]:
    """``(chance, floor)``: the mean overlap random top-``topk`` ids of ``num_experts`` have with any top-k
    (``topk / num_experts``), and the overlap below which ``slots`` replayed slots are judged no better than random:
    below both a quarter of the way from chance to 1 and ``Z`` standard deviations of a random sample above chance."""
    chance = topk / num_experts
    margin = chance + (1.0 - chance) / 4
    noise = chance + Z * math.sqrt(chance * (1.0 - chance) / max(slots, 1))
    return chance, min(margin, noise)


class Guard:
    """Per-pass, per-layer agreement counts of replayed router calls, flushed per step (see the module docstring).

    Args:
        path: the JSONL file of rows (None: rows kept in ``history`` only).
        minimum: fail a step whose agreement (exact top-k sets) falls below this share in some pass and layer.
        floor: ``"chance"``: fail a step whose replayed ids overlap native routing's no better than random ids would
            (``chance_floor``); a number: fail below that mean overlap; None: no floor.
        writer: a TensorBoard-like ``add_scalar`` logger.
    """

    def __init__(
        self,
        *,
        path: str | os.PathLike | None = None,
        minimum: float | None = None,
        writer=None,
        floor: str | float | None = None,
    ):
        for name, value in (("minimum", minimum), ("floor", None if floor == CHANCE else floor)):
            if value is not None and not (isinstance(value, (int, float)) and 0.0 <= value <= 1.0):
                raise UsageError(f"agreement {name} {value!r}: expected a share in [0, 1]")
        self.path = Path(path) if path is not None else None
        self.minimum = minimum
        self.floor = floor
        self.writer = writer
        self.step = 0  # steps flushed with counted calls
        self.fresh = False  # new routes arrived since the last flush (``routes_changed``)
        self.history: list[dict] = []  # every row written, for code users and tests
        # (pass, layer) -> [overlap histogram (device tensor, ``count``), calls' tokens, top-k, experts]
        self._counts: dict[tuple[str, int], list] = {}
        self._bins: dict[tuple, torch.Tensor] = {}  # (device, top-k) -> the histogram's bin numbers
        self._file = None
        self._hook = register_optimizer_step_post_hook(self._after_optimizer_step)

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
        counts = self._counts.get((kind, layer))
        if counts is None:
            self._counts[(kind, layer)] = [hist_B, t, k, num_experts]
        else:
            counts[0] += hist_B
            counts[1] += t

    def _after_optimizer_step(self, optimizer, args, kwargs) -> None:
        if self._counts:
            self.end_step()

    def end_step(self) -> dict[int, float]:
        """Flush this step's counts: ``{layer: agreement}`` of the training (or replay) pass; every pass's rows go to
        ``history``, the file and the logger. Raises ``RouteError`` below the minimum or the floor."""
        if not self._counts:
            return {}
        self.step += 1
        rank = _rank()
        entries = sorted(self._counts.items(), key=lambda item: (PASSES.index(item[0][0]), item[0][1]))
        device = entries[0][1][0].device
        read = torch.cat([counts[0].to(device) for _, counts in entries]).tolist()  # one host read a step
        rows, at = [], 0
        for (kind, layer), (_, tokens, k, experts) in entries:
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
        self._counts.clear()
        self.history.extend(rows)
        self._write(rows, rank)
        self._log(rows)
        self._judge(rows, rank)
        return {row["layer"]: row["agreement"] for row in rows if row["pass"] != "log_prob"}

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

    def _judge(self, rows: list[dict], rank: int) -> None:
        def fail(row: dict, what: str, got: float, want: float, setting: str, count: int) -> None:
            raise RouteError(
                f"agreement guard: step {self.step} {row['pass']} pass layer {row['layer']} rank {rank}: "
                f"{what} {got:.4%} over {row['tokens']} replayed tokens (padding {row['padding']} and "
                f"tokens routed natively {row['routed_natively']} not counted), expected at least "
                f"{want:.4%} ({setting}); {count} pass-layer(s) below"
            )

        judged = [r for r in rows if r["tokens"]]
        fresh, self.fresh = self.fresh, False
        if self.minimum is not None:
            below = [r for r in judged if r["agreement"] < self.minimum]
            if below:
                worst = min(below, key=lambda r: r["agreement"])
                fail(
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
            floors = {id(r): (r.get("floor") if self.floor == CHANCE else self.floor) for r in judged}
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
                fail(
                    worst,
                    what,
                    worst["overlap"],
                    floors[id(worst)],
                    f"{FLOOR_ENV}={self.floor}"
                    if self.floor != CHANCE
                    else f"{FLOOR_ENV}={CHANCE}, the default of in-job replay; {FLOOR_ENV}={OFF} turns it off",
                    len(below),
                )

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
) -> Guard:
    """Start the process's agreement guard (one at a time); ``stop()`` ends it. Arguments as ``Guard``'s."""
    global ACTIVE
    if ACTIVE is not None:
        raise UsageError("an agreement guard is already active in this process: call agreement.stop() first")
    ACTIVE = Guard(path=path, minimum=minimum, writer=writer, floor=floor)
    return ACTIVE


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


def from_env(*, in_job: bool = False, floor_default: str | None = None) -> Guard | None:
    """Start the guard from ``MOEVERIFY_AGREEMENT`` / ``_MIN`` / ``_FLOOR`` (autopatch calls it).

    Args:
        in_job: in-job replay (r2, r3, routes from the batch): the guard is on unless ``MOEVERIFY_AGREEMENT=off``;
            elsewhere it is off unless ``MOEVERIFY_AGREEMENT=PATH.jsonl`` is set.
        floor_default: the floor when ``MOEVERIFY_AGREEMENT_FLOOR`` is unset (``"chance"`` for a rollout engine's
            routes).
    """
    path, minimum, floor = (os.environ.get(name) or None for name in (ENV, MIN_ENV, FLOOR_ENV))
    if in_job and ACTIVE is not None and path is minimum is floor is None:
        return None  # the job started its own guard (agreement.guard()): it counts in-job replay too
    if path == OFF:
        if minimum is not None or floor not in (None, OFF):
            raise UsageError(
                f"{ENV}={OFF} turns the agreement guard off, but {MIN_ENV} or {FLOOR_ENV} asks it to "
                "judge the job: unset one of them"
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
    if floor is None:
        floor = floor_default
    elif floor == OFF:
        floor = None
    elif floor != CHANCE:
        floor = _share(FLOOR_ENV, floor)
    return guard(path=path, minimum=share, floor=floor)


def _rank() -> int:
    dist = torch.distributed
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _world() -> int:
    dist = torch.distributed
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
