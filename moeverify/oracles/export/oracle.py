"""The export differential oracle: a subject's per-tensor export vs Megatron-Bridge, bit for bit.

``run(ctx)`` runs on every rank (docs/design.md, "The checks"; docs/export.md, "How it runs, and what it holds in
memory"):

1. the subject (``ExportOptions.subject``, default ``sharded``) is called on every rank and drained
   into a row list (sharded rows defer their tensors, so this is cheap); a raise becomes an error
   status instead of an exception;
2. **lockstep**: one all_gather of ``[status, row count, hash of row names]`` on a dedicated gloo group
   (after a monitored barrier that names a rank that never arrives); any difference fails every rank
   and skips the rest, so a diverging rank cannot hang the per-row collectives;
3. per row: every rank takes the reference tensors the row names (``bridge.export_hf_weights(model_chunks,
   cpu=True)``, iterated by every rank in a background thread, ``feed``, yields every full HF tensor on
   every rank), and every rank other than 0 compares its own pieces bit for bit with its own copy
   (``local``). Every rank gathers a JSON header (slot table, sizes, dtype, error, and that local
   verdict: clean or not, the index runs written, a digest of the rank's reference) to rank 0; rank 0
   checks the slot tables and broadcasts go/skip and which pieces must travel. A clean piece whose
   reference digest equals rank 0's is replayed on rank 0 from rank 0's reference (the same bits,
   by that rank's comparison) into ``merge.TensorMerge``, so coverage, conflicts and replicas count
   and report as if it had travelled; every other piece (other bits, another dtype, a reference that
   differs from rank 0's or never arrived on that rank, irregular positions) travels rank by rank in
   chunks and is merged from its real bytes, as before. Each merge is checked as soon as its
   reference is in hand. Rank 0 takes a row's references before opening its merges (a merge whose
   reference is in hand keeps no values buffer while the pieces match it), and the feed's memory
   gate keeps a large export from running beside large holdings. Memory on rank 0: the merges of one
   row, the reference tensors they wait for, one chunk, and a small tensor's export in flight beside
   them. Where the slot tables differ between ranks (known at lockstep), no rank checks locally.
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import math
import traceback
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist

from moeverify.models.checkpoint import checkpoint_shapes
from moeverify.oracles.export import intact, wire
from moeverify.oracles.export.collect import SUBCHECKS, Collector, new_tallies
from moeverify.oracles.export.feed import ReferenceFeed, thread_context
from moeverify.oracles.export.local import LocalReferences, run_chunks, verdict
from moeverify.oracles.export.merge import TensorMerge
from moeverify.oracles.export.receiver import ReceiverRun, load_receiver
from moeverify.oracles.export.refresh import run_twice
from moeverify.oracles.export.rows import DrainedRow, Piece, drain, iterate_subject, pieces
from moeverify.oracles.results import Tally
from moeverify.spec import plugins, timeouts
from moeverify.spec.checks import SUBJECTS, ExportOptions


@dataclasses.dataclass(frozen=True, kw_only=True)
class SubjectContext:
    """What a subject factory receives on every rank."""

    bridge: Any
    model_chunks: list
    layout: Any
    rank: int
    world_size: int
    hf_path: Path
    built: Any = None
    options: dict = dataclasses.field(default_factory=dict)  # the check options (``ExportOptions`` reads them)
    # the export's control-group collectives (``moeverify run``: --timeout; else ``timeouts.COLLECTIVE_S``, read here)
    timeout_s: float = dataclasses.field(default_factory=lambda: timeouts.COLLECTIVE_S)
    stats: dict | None = None  # a dict here gets the elements each rank checked locally (the benchmark reads it)


def load_subject(name: str):
    """The factory for ``bridge``, ``sharded``, ``gather``, ``verl``, ``module:factory`` or ``file.py:factory``."""
    return plugins.load(name, what="subject", builtins=SUBJECTS)


def subject_context(ctx) -> SubjectContext:
    built = ctx.model()
    return SubjectContext(
        bridge=built.bridge,
        model_chunks=built.model_chunks,
        layout=ctx.scenario.layout,
        rank=ctx.rank,
        world_size=ctx.world_size,
        hf_path=Path(built.hf_path),
        built=built,
        options=dict(ctx.options),
        timeout_s=ctx.timeout_s,
    )


def run(ctx) -> dict[str, Tally]:
    """The ``export`` check (options: ``ExportOptions``): the subject's export; with ``refresh`` on (asked, or by
    default for a user's subject or with a receiver: ``ExportOptions.refresh_on``), a second export after a weight
    update (``refresh.run_twice``); with ``receiver`` set, the ``receiver`` subcheck (``receiver.ReceiverRun``: the
    receiver loads what the subject streamed)."""
    opts = ExportOptions.from_options(ctx.options, where="export check options")
    receiver = None
    if opts.receiver:
        receiver = load_receiver(opts.receiver)
    return run_export(load_subject(opts.subject), subject_context(ctx), refresh=opts.refresh_on, receiver=receiver)


def run_export(factory, sctx: SubjectContext, *, refresh: bool = False, receiver=None) -> dict[str, Tally]:
    """The export check's subchecks for subject ``factory``: with ``refresh``, export twice around a weight update;
    with a ``receiver`` factory, the receiver loads what the subject streamed (``receiver``, and ``receiver_reload``
    with ``refresh``) and what it holds is compared with the reference."""
    run = None
    if receiver is not None:
        run = ReceiverRun(receiver, sctx)
    if refresh:
        tallies = run_twice(run_subject, factory, sctx, receiver=run)
    else:
        tallies = run_subject(factory, sctx, sink=run and run.sink())
        if run is not None:
            run.check("receiver", tallies, repeat=True)
    return tallies | (run.finish() if run is not None else {})


def run_subject(factory, sctx: SubjectContext, *, reference=None, sink=None) -> dict[str, Tally]:
    """Check one subject factory against the reference on every rank; rank 0's tallies are the result.

    ``reference``: an iterable of ``(name, tensor)`` to use instead of a fresh ``export_hf_weights``
    (every rank must pass the same sequence); tests use it to reuse one export. ``sink`` (rank 0's only):
    called as ``sink(hf_name, tensor)`` with each tensor the subject streamed, merged, once it is checked.
    """
    group = wire.control_group(float(sctx.timeout_s))
    tallies = new_tallies()
    state = intact.named_state(sctx.model_chunks)
    before = intact.fingerprints(state)
    rows, error = _drain(factory, sctx)
    in_step, same_tables = _lockstep(rows, error, sctx=sctx, group=group, tally=tallies["lockstep"])
    if not in_step:
        for name in SUBCHECKS[1:]:
            tallies[name].fail("skipped: lockstep failed, no row was compared")
        return tallies
    if state:
        _model_intact(state, before, sctx=sctx, group=group, tally=tallies[intact.SUBCHECK])
    else:
        tallies[intact.SUBCHECK].skip("no model chunks given (a reference passed in): nothing to fingerprint")
    if reference is None:
        reference = sctx.bridge.export_hf_weights(sctx.model_chunks, cpu=True, show_progress=False)
    shapes = checkpoint_shapes(sctx.hf_path)
    collector = local = None
    if sctx.rank == 0:
        collector = Collector(
            tallies=tallies,
            tables=[r.table for r in rows],
            checkpoint_names=shapes,
            world_size=sctx.world_size,
            sink=sink,
        )
    elif same_tables:
        # every rank named the same tensors in every row, so a rank waiting for its row's references waits
        # only for tensors rank 0 pulls too; otherwise (slot tables differ somewhere) no rank checks locally
        # and every piece travels to rank 0, as it would with the reference on rank 0 alone
        local = LocalReferences(tables=[r.table for r in rows], checkpoint_names=set(shapes))
    store = collector if collector is not None else local
    # rank 0's feed is gated by its holdings; the others' never waits (see feed.py) and keeps what they compare
    feed = ReferenceFeed(
        reference,
        keep=store is not None,
        numels={n: math.prod(s) for n, s in shapes.items()},
        gate=sctx.rank == 0,
        wanted=None if local is None else local.wanted(),
    )
    feed.start()
    # other ranks build each row's pieces one row ahead on a helper thread, while they still send the
    # previous row; rank 0 takes the references a row needs first, and builds its own pieces after them
    ahead = _Ahead(rows, rank=sctx.rank) if sctx.rank != 0 else None
    held = cast("list[DrainedRow | None]", rows)  # the same list: a merged row is dropped to free its tensors
    try:
        for index, row in enumerate(rows):
            prepared = ahead.take(index) if ahead is not None else None
            names = [n for n, _ in row.table]
            if store is not None:
                feed.wait_until(lambda names=names: not store.wants_reference(names), store)
            _one_row(
                index,
                row,
                sctx=sctx,
                group=group,
                collector=collector,
                local=local,
                feed=feed,
                prepared=prepared or _header(row, sctx.rank),
            )
            held[index] = prepared = None  # drop the row's tensors as soon as it is merged
            if local is not None:
                local.row_done(index, row.table)
            if store is not None:
                feed.report(store.nbytes())
        feed.finish(store)  # every rank drains the rest of the reference
    except BaseException:
        feed.close()
        raise
    finally:
        if ahead is not None:
            ahead.close()
        if store is not None:
            store.close()
    if collector is not None:
        collector.finish_all()
        if sctx.stats is not None:  # the benchmark reads where the elements were checked
            sctx.stats.update(collector.elements)
    return tallies


def _model_intact(state, before, *, sctx, group, tally) -> None:
    """Every rank's changed tensors gathered to rank 0 (after lockstep: every rank is here)."""
    mine = intact.changed(state, before)
    per_rank = wire.gather_json(
        [len(state), mine[:4], len(mine)], group=group, rank=sctx.rank, world_size=sctx.world_size
    )
    if per_rank is None:  # not rank 0
        return
    for r, (held, names, count) in enumerate(per_rank):
        if count:
            tally.fail(
                f"rank {r}: the subject wrote into the model it exports: {count} of {held} tensor(s) changed "
                f"({', '.join(names)}{', ...' if count > len(names) else ''}); the reference export reads the "
                "changed model, so the values compared agree with it: convert a copy, never the parameter",
                n=held,
            )
        else:
            tally.ok(held)


class _Ahead:
    """Build row ``i + 1``'s header and pieces on a helper thread while row ``i`` is sent."""

    def __init__(self, rows: list[DrainedRow], *, rank: int) -> None:
        self._rows, self._rank, self._context = rows, rank, thread_context()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="moeverify-export-ahead")
        self._next = self._submit(0)

    def _submit(self, index: int):
        if index >= len(self._rows):
            return None
        row = self._rows[index]

        def build():
            with self._context():
                return _header(row, self._rank)

        return self._pool.submit(build)

    def take(self, index: int):
        prepared, self._next = self._next.result(), None
        self._next = self._submit(index + 1)
        return prepared

    def close(self) -> None:
        self._next = None
        self._pool.shutdown(wait=True, cancel_futures=True)


def _drain(factory, sctx) -> tuple[list[DrainedRow], str | None]:
    try:
        return drain(iterate_subject(factory, sctx), rank=sctx.rank), None
    except Exception as exc:  # a raising subject is a finding, reported through lockstep
        frames = traceback.extract_tb(exc.__traceback__)
        where = frames[-1]
        at = f"{where.filename}:{where.lineno}"
        own = [f for f in frames if not _library_frame(f.filename)]
        if own and own[-1] is not where:  # raised inside a library (torch): the subject's line that called it too
            at += f", called from {own[-1].filename}:{own[-1].lineno}"
        return [], f"rank {sctx.rank}: subject raised {type(exc).__name__}: {exc} (at {at})"


def _library_frame(filename: str) -> bool:
    """A frame of an installed package or of moeverify itself (not the subject's own code)."""
    path = Path(filename).resolve()
    return "site-packages" in path.parts or "dist-packages" in path.parts or _PACKAGE_DIR in path.parents


_PACKAGE_DIR = Path(__file__).resolve().parents[2]  # moeverify/


def _names_hash(rows: list[DrainedRow]) -> int:
    digest = hashlib.sha256("\n".join(r.row for r in rows).encode()).digest()
    return int.from_bytes(digest[:8], "little", signed=True)


def _tables_hash(rows: list[DrainedRow]) -> int:
    digest = hashlib.sha256(repr([r.table for r in rows]).encode()).digest()
    return int.from_bytes(digest[:8], "little", signed=True)


def _lockstep(rows, error, *, sctx, group, tally: Tally) -> tuple[bool, bool]:
    """``(in step, same slot tables on every rank)``; only the first is the lockstep subcheck's."""
    wait_s = ExportOptions.from_options(sctx.options, where="export check options").lockstep_timeout or sctx.timeout_s
    try:
        # names a rank that never arrives (stalled in its subject) instead of hanging on it
        dist.monitored_barrier(group=group, timeout=datetime.timedelta(seconds=wait_s), wait_all_ranks=True)
        status = wire.all_gather_ints(
            [1 if error else 0, len(rows), _names_hash(rows), _tables_hash(rows)],
            group=group,
            world_size=sctx.world_size,
        )
        errors = wire.gather_json(error, group=group, rank=sctx.rank, world_size=sctx.world_size)
        first_names = wire.gather_json(
            [r.row for r in rows[:1]], group=group, rank=sctx.rank, world_size=sctx.world_size
        )
    except RuntimeError as exc:  # a rank that never arrived: the barrier names it
        tally.fail(f"rank {sctx.rank}: lockstep collective failed: {str(exc).splitlines()[0]}")
        return False, False
    bad = False
    for r, (err, *_hashes) in enumerate(status):
        if err:
            bad = True
            if errors is not None:  # rank 0
                tally.fail(errors[r])
    counts = {r: s[1] for r, s in enumerate(status)}
    if len(set(counts.values())) > 1:
        bad = True
        tally.fail(f"row counts differ across ranks: {counts}")
    elif len({s[2] for s in status}) > 1:
        bad = True
        ref = status[0][2]
        tally.fail(
            f"row names differ from rank 0's on rank(s) {[r for r, s in enumerate(status) if s[2] != ref]} "
            f"(same count {counts[0]}; first row per rank: {first_names})"
        )
    if not bad:
        tally.ok(sctx.world_size)
    return not bad, len({s[3] for s in status}) == 1


def _header(row: DrainedRow, rank: int) -> tuple[dict, list[Piece]]:
    try:
        got = pieces(row, rank=rank)
    except Exception as exc:
        return {
            "err": f"rank {rank} row {row.row!r}: {type(exc).__name__}: {exc}",
            "c": row.contributes,
            "slots": [],
        }, []
    slots = [
        [
            p.hf_name,
            list(p.hf_shape),
            p.numel,
            str(p.values_P.dtype).removeprefix("torch."),
            (p.start if p.numel else None),
        ]
        for p in got
    ]
    return {"err": None, "c": row.contributes, "slots": slots}, got


def _one_row(
    index: int,
    row: DrainedRow,
    *,
    sctx,
    group,
    collector: Collector | None,
    local: LocalReferences | None,
    feed: ReferenceFeed,
    prepared,
) -> None:
    header, mine = prepared
    if local is not None and not header["err"]:
        for slot, piece in zip(header["slots"], mine, strict=True):
            slot.append(verdict(piece, *local.reference(piece.hf_name)))
    headers = wire.gather_json(header, group=group, rank=sctx.rank, world_size=sctx.world_size)
    mask = None
    if collector is not None and headers is not None:  # rank 0
        go = _decide(row.row, headers, collector)
        if go:
            mask = _send_mask(headers, collector)
            go = _GO_SOME_TRAVEL if any(mask) else _GO_ALL_LOCAL
    go = wire.broadcast_int(go if collector else 0, group=group)
    sends = None  # go == 1: every other rank's pieces were shown clean and are replayed on rank 0
    if go == _GO_SOME_TRAVEL:
        n_slots = len(header["slots"])
        mask = wire.broadcast_ints(mask if mask is not None else [0] * (sctx.world_size * n_slots), group=group)
        sends = [mask[r * n_slots : (r + 1) * n_slots] for r in range(sctx.world_size)]
    if sctx.rank != 0:
        for j, (piece, slot) in enumerate(zip(mine if go else (), header["slots"], strict=False)):  # go 0: none sent
            if piece.numel and sends is not None and sends[sctx.rank][j]:
                wire.send_piece(piece.positions(), piece.values_P, start=slot[4], dst=0, group=group)
        return
    assert collector is not None, "rank 0 merges: it holds the collector"
    if go:
        _merge_row(row, headers, mine, sends, group=group, collector=collector, feed=feed)
    collector.row_done(index, row.table)


_GO_ALL_LOCAL, _GO_SOME_TRAVEL = 1, 2


def _trusted(slot: list, collector: Collector) -> bool:
    """Whether rank 0 may replay another rank's piece from its own reference (see local.py)."""
    name, shape, n, dtype, _start = slot[:5]
    found = slot[5] if len(slot) > 5 else None  # no verdict: that rank does not check locally
    if not n or found is None:
        return False
    reference, ref_digest = collector.reference(name)
    return (
        reference is not None
        and name not in collector.done
        and ref_digest == found["digest"]
        and tuple(reference.shape) == tuple(shape)
        and str(reference.dtype).removeprefix("torch.") == dtype
    )


def _send_mask(headers: list[dict], collector: Collector) -> list[int]:
    return [
        int(r != 0 and bool(slot[2]) and not _trusted(slot, collector))
        for r, h in enumerate(headers)
        for slot in h["slots"]
    ]


def _decide(row_name: str, headers: list[dict], collector: Collector) -> int:
    tally = collector.t["slot_tables"]
    errors = [h["err"] for h in headers if h["err"]]
    for err in errors:
        tally.fail(err)
    if errors:
        return 0
    tables = [[(s[0], tuple(s[1])) for s in h["slots"]] for h in headers]
    differ = [r for r, t in enumerate(tables) if t != tables[0]]
    if differ:
        tally.fail(
            f"row {row_name!r}: slot table of rank(s) {differ} differs from rank 0's: "
            f"rank 0 {tables[0]} vs rank {differ[0]} {tables[differ[0]]}"
        )
        return 0
    tally.ok()
    return _GO_SOME_TRAVEL


def _merge_row(row, headers, mine: list[Piece], sends, *, group, collector: Collector, feed: ReferenceFeed) -> None:
    order = [r for r in range(len(headers)) if headers[r]["c"]] + [
        r for r in range(len(headers)) if not headers[r]["c"]
    ]
    opening = {}
    for j, (name, shape, *_rest) in enumerate(headers[0]["slots"]):
        sizes = [(h["slots"][j][2], h["slots"][j][3]) for h in headers]
        dtype = next((d for (n, d), h in zip(sizes, headers, strict=True) if n and h["c"]), sizes[0][1])
        if name not in collector.merges and name not in opening:
            opening[name] = (tuple(shape), getattr(torch, dtype))
    feed.admit(
        sum(
            TensorMerge.nbytes_for(shape, dtype, collector.world_size, backed=collector.backs(name, shape, dtype))
            for name, (shape, dtype) in opening.items()
        )
    )
    for name, (shape, dtype) in opening.items():
        collector.merge_for(name, shape, dtype)
    feed.report(collector.nbytes())
    collector.t["replicas"].ok()  # one per row examined: a layout without replicas still checks rows
    for r in order:
        contributes = headers[r]["c"]
        for j, (name, _shape, n, dtype, start, *found) in enumerate(headers[r]["slots"]):
            if not n:
                continue
            merge = collector.merges[name] if name in collector.merges else None
            if r != 0 and not (sends and sends[r][j]):
                if merge is None:
                    continue  # cannot happen (a trusted piece's tensor is open), kept as a guard
                reference, _digest = collector.reference(name)
                assert reference is not None, "a trusted piece's reference is held (_trusted)"
                _replay(merge, rank=r, runs=found[0]["runs"], reference=reference, contributes=contributes)
                collector.elements["checked_locally"] += n
                continue
            if r != 0:
                collector.elements["received"] += n
            elif (
                contributes
                and merge is not None
                and (runs_R2 := mine[j].runs_R) is not None
                and merge.write_runs(rank=0, runs_R2=runs_R2, values_P=mine[j].values_P)
            ):
                continue  # rank 0's own clean runs, kept as runs
            chunks = (
                wire.local_piece_chunks(mine[j].positions(), mine[j].values_P, start=start)
                if r == 0
                else wire.recv_piece_chunks(n=n, dtype=getattr(torch, dtype), start=start, src=r, group=group)
            )
            for positions_C, values_C in chunks:
                if merge is None:
                    continue  # already finished (named by an earlier row only); still drain the wire
                if contributes:
                    merge.write(rank=r, positions_P=positions_C, values_P=values_C)
                else:
                    merge.compare_replica(rank=r, positions_P=positions_C, values_P=values_C)


def _replay(merge: TensorMerge, *, rank: int, runs, reference: torch.Tensor, contributes: bool) -> None:
    """Another rank's clean piece, from rank 0's reference: the bits that rank compared equal to its own."""
    ref_N = reference.reshape(-1)
    if contributes and merge.run_mode(ref_N):  # kept as runs: no element is touched
        merge.write_reference_runs(rank=rank, runs_R=runs)
        return
    for positions_C in run_chunks(runs):
        if contributes:
            merge.write_reference(rank=rank, positions_P=positions_C, reference_N=ref_N)
        else:
            merge.compare_replica(rank=rank, positions_P=positions_C, values_P=ref_N[positions_C])
