"""``moeverify dump inspect | diff | convert``: ``register(subparsers)`` adds them; each verb sets ``func``.

Every verb returns an exit code: 0 done, 1 ``diff --fail-on-diff`` found a difference, 2 bad input
(unreadable, corrupt or inconsistent dumps, impossible option combinations), with one message.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from moeverify.errors import MoEVerifyError, UsageError
from moeverify.files import atomic_write, check_output_file
from moeverify.record.order import ORDERS

EXIT_DIFF = 1
EXIT_USAGE = 2
_FROM = ("dump", "npy", "npz", "jsonl")
_TO = ("dump", "npz")


def register(subparsers) -> argparse.ArgumentParser:
    """Add ``dump`` with its verbs to an argparse subparsers object."""
    dump = subparsers.add_parser("dump", help="routing dumps: inspect, diff, convert",
                                 description="Inspect, compare and convert routing dumps.")
    verbs = dump.add_subparsers(dest="dump_verb", metavar="VERB", parser_class=type(dump))
    verbs.required = True

    p = verbs.add_parser("inspect", help="summarise one dump: shape, layout, steps, load balance per layer")
    p.add_argument("path", metavar="PATH", help="dump directory")
    p.add_argument("--step", type=_non_negative, metavar="S", help="step for the load table (default: first)")
    p.add_argument("--json", metavar="OUT", help="also write the summary as JSON")
    p.set_defaults(func=cmd_inspect)

    p = verbs.add_parser("diff", help="compare two routings of the same tokens, layer by layer")
    p.add_argument("a", metavar="A", help="dump directory, or .npy/.npz [tokens, layers, topk] routes")
    p.add_argument("b", metavar="B", help="dump directory, or .npy/.npz routes")
    p.add_argument("--step", type=_non_negative, default=0, metavar="S", help="step of A (default 0)")
    p.add_argument("--step-b", type=_non_negative, metavar="S", help="step of B (default: --step)")
    p.add_argument("--json", metavar="OUT", help="write the diff record as JSON")
    p.add_argument("--plot", metavar="PNG", help="write the disagreement heatmap and expert-load bars")
    p.add_argument("--worst", type=_non_negative, default=10, metavar="N", help="tokens listed in JSON (default 10)")
    p.add_argument("--fail-on-diff", action="store_true", help="exit 1 if any token's expert set differs")
    p.add_argument("--order-a", choices=ORDERS, help="token order of A when it is an array (a dump knows its own)")
    p.add_argument("--order-b", choices=ORDERS, help="token order of B when it is an array")
    _add_geometry(p, "of the array side(s) given in router order")
    p.add_argument("--rollout", action="store_true",
                   help="B is a rollout engine's routed experts: .npz with one [positions, layers, topk] array per "
                        "request (vLLM routed_experts, SGLang return_routed_experts), or .npy [requests, positions, "
                        "layers, topk] padded with -1; lined up with A's sequences request by request")
    p.add_argument("--assume-same-order", action="store_true",
                   help="compare by position although a side's token order is unknown (you vouch for it)")
    p.add_argument("--expert-map-a", metavar="FILE", help="A records physical expert slots (EPLB redundant experts): "
                   ".json or .npy map slot -> logical expert id, one for all layers or one per layer; A's ids are "
                   "mapped to logical ids before comparing")
    p.add_argument("--expert-map-b", metavar="FILE", help="the same for B")
    p.add_argument("--in-memory", action="store_true", help="load both sides whole and diff in memory (default: "
                   "read one layer at a time; same figures, memory of one layer)")
    p.set_defaults(func=cmd_diff)

    p = verbs.add_parser("finalize", help="commit (or discard) steps a run wrote but did not commit to the manifest",
                         description="A run that ends between its rank files and the manifest leaves steps written "
                                     "but uncommitted. finalize folds the rank records into manifest.json; with "
                                     "--drop-uncommitted it deletes what the manifest does not list instead.")
    p.add_argument("path", metavar="PATH", help="dump directory")
    p.add_argument("--world-size", type=_positive, metavar="N", help="ranks the dump must have (default: the "
                   "records' own)")
    p.add_argument("--drop-uncommitted", action="store_true", help="discard uncommitted steps instead")
    p.set_defaults(func=cmd_finalize)

    p = verbs.add_parser("convert", help="rollout arrays or Megatron router_trace JSONL to a dump; a dump to .npz")
    p.add_argument("src", metavar="SRC", help="dump directory, .npy, .npz or router_trace_rank*.jsonl")
    p.add_argument("dst", metavar="DST", help="output dump directory or .npz file")
    p.add_argument("--from", dest="src_format", choices=_FROM, help="SRC format (default: from its suffix)")
    p.add_argument("--to", dest="dst_format", choices=_TO, help="DST format (default: npz if DST ends .npz)")
    p.add_argument("--num-experts", type=_positive, metavar="E", help="experts per layer (default: max id + 1)")
    p.add_argument("--moe-layers", type=_int_list, metavar="L,L,...", help="global MoE layer numbers of the "
                   "array's layer axis (default 0..layers-1)")
    p.add_argument("--num-layers", type=_positive, metavar="N", help="decoder layers (default: last MoE layer + 1)")
    p.add_argument("--step", type=_non_negative, default=0, metavar="S", help="step to write (arrays; default 0)")
    p.add_argument("--layer-offset", type=_non_negative, default=0, metavar="N",
                   help="added to router_trace layer numbers (a later pipeline stage's first layer)")
    p.add_argument("--layout", metavar="NAME", help="SRC is a directory of every rank's router_trace_rank<R>.jsonl "
                   "of one job under this layout (e.g. tp2-sp, ep2, cp2, pp2; Megatron's default rank order): one "
                   "merged dump; needs --world-size, --num-layers, --seq-len (global) and --batch (per rank)")
    p.add_argument("--world-size", type=_positive, metavar="N", help="with --layout: the job's ranks (exactly "
                   "router_trace_rank0..N-1.jsonl must be in SRC)")
    p.add_argument("--order", choices=ORDERS, help="token order of SRC (router_trace: router; arrays: required "
                   "with --seq-len/--batch)")
    p.add_argument("--expert-map", metavar="FILE", help="SRC holds physical expert slots: map them to logical expert "
                   "ids (.json or .npy slot -> logical id, one for all layers or one per layer) before writing")
    _add_geometry(p, "of SRC's micro-batches; with them the dump knows its token order")
    p.set_defaults(func=cmd_convert)
    return dump


def _add_geometry(p, what: str) -> None:
    p.add_argument("--seq-len", type=_positive, metavar="S", help=f"tokens per sequence {what}")
    p.add_argument("--batch", type=_positive, metavar="B", help=f"sequences per micro-batch {what}")


# -- option parsing -----------------------------------------------------------------------------
def _non_negative(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}")
    return value


def _positive(text: str) -> int:
    value = _non_negative(text)
    if value == 0:
        raise argparse.ArgumentTypeError(f"expected an integer > 0, got {text!r}")
    return value


def _int_list(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(p) for p in text.split(",") if p.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def _guarded(fn):
    """Bad input becomes one message on stderr and exit 2."""
    def run(args) -> int:
        try:
            return fn(args)
        except MoEVerifyError as exc:
            print(f"moeverify dump: error: {exc}", file=sys.stderr)
            return EXIT_USAGE
    run.__name__ = fn.__name__
    run.__doc__ = fn.__doc__
    return run


def _out_path(flag: str, value: str | None) -> None:
    if value:
        check_output_file(flag, value)


# -- verbs --------------------------------------------------------------------------------------
@_guarded
def cmd_inspect(args) -> int:
    """``dump inspect PATH``."""
    from rich.console import Console

    from moeverify import record
    from moeverify.record.summary import summarize, summary_table

    _out_path("--json", args.json)
    summary = summarize(record.load(args.path), step=args.step)
    title, table = summary_table(summary)
    console = Console()
    console.print(title)
    console.print(table)
    if args.json:
        atomic_write(Path(args.json), (json.dumps(summary, indent=1) + "\n").encode())
    return 0


@_guarded
def cmd_diff(args) -> int:
    """``dump diff A B``."""
    from moeverify import record
    from moeverify.record.order import require_same_tokens, shared_geometry

    _out_path("--json", args.json)
    _out_path("--plot", args.plot)

    if (args.seq_len is None) != (args.batch is None):
        raise UsageError("--seq-len and --batch go together")
    if args.rollout:
        return _diff_rollout(args)
    a = _routes_of(args.a, args.step, order=args.order_a, args=args, flag="--order-a")
    b = _routes_of(args.b, args.step if args.step_b is None else args.step_b, order=args.order_b, args=args,
                   flag="--order-b")
    require_same_tokens(a, b, assume_same_order=args.assume_same_order)
    geometry = shared_geometry(a, b)
    src_a, src_b, maps = _mapped(args, a, b)
    sequences = {} if geometry is None else {"seq_len": geometry[0], "batch": geometry[1]}
    if args.in_memory:
        report = record.diff(src_a.routes(), src_b.routes(), **sequences)
    else:
        report = record.diff_stream(src_a, src_b, **sequences)
    return _report(args, report, {"engine": "in-memory" if args.in_memory else "stream", "expert_maps": maps})


def _mapped(args, a, b):
    """Both sides' layer sources with their expert maps applied and one expert count; the maps' JSON record."""
    from moeverify.record import expert_map, stream

    sides = {}
    for name, side, flag, path in (("a", a, "--expert-map-a", args.expert_map_a),
                                   ("b", b, "--expert-map-b", args.expert_map_b)):
        src = side.routes
        if path is None:
            sides[name] = (src, None, side)
            continue
        dump = src.dump if isinstance(src, stream.DumpSource) else None
        layers = src.layers
        emap = expert_map.load(path, moe_layers=layers,
                               num_layers=dump.model.num_layers if dump is not None else None,
                               physical_experts=src.num_experts if dump is not None else None,
                               what=f"{side.source}")
        if dump is None and src.num_experts > emap.physical:  # an array: its largest id must be a slot of the map
            raise expert_map.ExpertMapError(f"{path}: {emap.physical} slot(s), but {side.source} holds expert id "
                                            f"{src.num_experts - 1}")
        src = stream.MappedSource(stream.widen(src, emap.physical), emap, where=side.source,
                                  token_label=_token_label(side))
        sides[name] = (src, emap, side)
    (src_a, map_a, side_a), (src_b, map_b, side_b) = sides["a"], sides["b"]
    for mapped, other, other_side, other_map in ((map_a, src_b, side_b, map_b), (map_b, src_a, side_a, map_a)):
        if mapped is None:
            continue
        known = other_map is not None or isinstance(other_side.routes, stream.DumpSource)  # arrays infer theirs
        if known and other.num_experts != mapped.logical:
            whose = f"{other_map.path}'s" if other_map is not None else f"{other_side.source}'s"
            raise expert_map.ExpertMapError(f"{mapped.path}: maps onto {mapped.logical} logical experts, {whose} side "
                                            f"has {other.num_experts} (both sides must be the same logical experts)")
    experts = max(src_a.num_experts, src_b.num_experts)
    maps = {k: m.as_json() for k, m in (("a", map_a), ("b", map_b)) if m is not None} or None
    return stream.widen(src_a, experts), stream.widen(src_b, experts), maps


def _token_label(side):
    """Names a token of a side for messages: its sequence and position where the side knows them."""
    geometry = side.geometry

    def label(mb: int, row: int) -> str:
        if geometry is None:
            return f"token {row}"
        seq_len, _ = geometry
        seq, pos = divmod(row, seq_len[mb])
        return f"token {row} (sequence {seq} of the micro-batch, position {pos})"

    return label


def _report(args, report, extra: dict | None = None) -> int:
    from rich.console import Console

    console = Console()
    console.print(report.table())
    sequences = report.sequence_table(args.worst)
    if sequences is not None:
        console.print(sequences)
    if args.json:
        record_json = report.to_json(worst=args.worst)
        if extra:
            record_json.update(extra)
        atomic_write(Path(args.json), (json.dumps(record_json, indent=1) + "\n").encode())
    if args.plot:
        from moeverify.record.plots import plot_diff

        plot_diff(report, args.plot)
    if args.fail_on_diff and report.tokens_diverging_any_layer > 0:
        return EXIT_DIFF
    return 0


def _rollout_requests(path: Path) -> list:
    from moeverify.record import importers

    arrays = importers.read_arrays(path)
    if path.suffix == ".npy":
        (arr,) = arrays
        if arr.ndim != 4:
            raise UsageError(f"{path}: a .npy rollout is [requests, positions, layers, topk], got shape {arr.shape}")
        return [_strip_trailing_padding(arr[r]) for r in range(arr.shape[0])]
    return arrays


def _strip_trailing_padding(request_PLK):
    """A padded request's own rows: trailing all -1 rows are padding; an all -1 row before a real one is a capture
    gap and stays (``rollout.align`` counts it apart), so no later position moves."""
    real_P = ~(request_PLK < 0).all(axis=(1, 2))
    length = int(real_P.nonzero()[0].max()) + 1 if real_P.any() else 0
    return request_PLK[:length]


def _diff_rollout(args) -> int:
    """``dump diff TRAIN ROLLOUT --rollout``: request by request, uncaptured positions and gaps apart."""
    from moeverify import record
    from moeverify.record.rollout import align

    train_path, rollout_path = Path(args.a), Path(args.b)
    if not train_path.is_dir():
        raise UsageError(f"--rollout: A must be the training dump (a directory), got {train_path}")
    for flag in ("order_a", "order_b", "seq_len", "batch", "assume_same_order"):
        if getattr(args, flag):
            raise UsageError(f"--rollout lines requests up by themselves; drop --{flag.replace('_', '-')}")
    dump = record.load(train_path)
    step = args.step
    if dump.token_order(step) is None:
        raise UsageError(f"{train_path}: step {step} was saved without seq_len/batch, so its sequences cannot be "
                         "told apart; record it with RouteRecorder or record.save(..., seq_len=, batch=)")
    from moeverify.record import expert_map
    from moeverify.record.order import Ordered

    info = dump.steps[step]
    batch = dump.layout.dp(dump.world_size) * info.batch  # sequences per merged micro-batch
    train = dump.routes(step=step)
    maps = {}
    if args.expert_map_a:
        map_a = expert_map.load(args.expert_map_a, moe_layers=train.layers, num_layers=dump.model.num_layers,
                                physical_experts=dump.model.num_experts, what=str(train_path))
        side = Ordered(routes=None, source=str(train_path), order="sequence", seq_len=info.seq_len, batch=batch)
        train = map_a.map_routes(train, where=str(train_path), token_label=_token_label(side))
        maps["a"] = map_a.as_json()
    map_b = None
    if args.expert_map_b:
        map_b = expert_map.load(args.expert_map_b, moe_layers=train.layers, num_layers=dump.model.num_layers,
                                physical_experts=None, what=str(rollout_path))
        maps["b"] = map_b.as_json()
    aligned = align(train, seq_len=info.seq_len, batch=batch, moe_layers=dump.model.moe_layers,
                    num_layers=dump.model.num_layers, requests=_rollout_requests(rollout_path), where=str(rollout_path),
                    expert_map=map_b)
    print(f"rollout: {aligned.requests} request(s), {aligned.compared} token(s) compared, {aligned.uncaptured} "
          f"training position(s) without a rollout row, {aligned.gaps} capture-gap row(s) set apart")
    report = record.diff(aligned.train, aligned.rollout, sequence_tokens=aligned.sequence_tokens,
                         sequence_extra=aligned.per_request)
    return _report(args, report, {"rollout": aligned.as_json(), "engine": "in-memory", "expert_maps": maps or None})


@_guarded
def cmd_finalize(args) -> int:
    """``dump finalize PATH``."""
    from moeverify import record
    from moeverify.record.writer import drop_uncommitted

    path = Path(args.path)
    if not path.is_dir():
        raise UsageError(f"{path}: not a directory")
    if args.drop_uncommitted:
        dropped = drop_uncommitted(path)
        print(f"{path}: dropped " + ("; ".join(f"rank {r} step(s) {s}" for r, s in sorted(dropped.items()))
                                     if dropped else "nothing (every step was committed)"))
        return 0
    manifest = record.finalize(path, world_size=args.world_size)
    record.load(path)  # what was committed must read back
    print(f"{path}: committed step(s) {sorted(int(s) for s in manifest['steps'])} of {manifest['world_size']} rank(s)")
    return 0


@_guarded
def cmd_convert(args) -> int:
    """``dump convert SRC DST``."""
    from moeverify import record
    from moeverify.record import importers

    src, dst = Path(args.src), Path(args.dst)
    src_format = args.src_format or ("jsonl" if args.layout is not None else _guess_src(src))
    dst_format = args.dst_format or ("npz" if dst.suffix == ".npz" else "dump")
    if src_format == "dump" and dst_format == "dump":
        raise UsageError("convert from a dump to a dump does nothing; use --to npz (or a DST ending .npz)")
    if src_format != "dump" and dst_format == "npz":
        raise UsageError(f"convert --from {src_format} writes a dump; drop --to npz or give a DST directory")
    if not dst.resolve().parent.is_dir():
        raise UsageError(f"{dst}: directory {dst.resolve().parent} does not exist")
    if dst_format == "dump" and dst.exists() and not dst.is_dir():
        raise UsageError(f"{dst} exists and is not a directory; give a new directory for the dump")
    if dst_format == "dump" and dst.is_dir() and any(dst.iterdir()):
        what = "already holds a dump" if (dst / record.MANIFEST).exists() else "is not empty"
        raise UsageError(f"{dst} {what}; choose a new directory")
    if dst_format == "npz" and dst.exists():
        raise UsageError(f"{dst} exists; choose a new file (convert never overwrites)")
    if src_format == "dump":
        dump = record.load(src)
        routes_of = None
        if args.expert_map:
            from moeverify.record import expert_map

            emap = expert_map.load(args.expert_map, moe_layers=dump.model.moe_layers, num_layers=dump.model.num_layers,
                                   physical_experts=dump.model.num_experts, what=str(src))
            routes_of = lambda step: emap.map_routes(dump.routes(step=step), where=f"{src} step {step}")  # noqa: E731
        out = importers.export_npz(dump, dst, routes_of=routes_of)
        print(f"wrote {out}" + (f" (logical expert ids through {args.expert_map})" if routes_of else ""))
        return 0
    if args.layout is not None:
        return _convert_trace_ranks(args, src, dst)
    order = _convert_order(args, src_format)
    if src_format == "jsonl":
        steps = importers.read_router_trace(src, num_experts=args.num_experts, layer_offset=args.layer_offset)
    else:
        arrays = importers.read_arrays(src, fmt=src_format)
        steps = {args.step: importers.routes_from_arrays(arrays, num_experts=args.num_experts,
                                                         moe_layers=args.moe_layers, where=str(src))}
    if args.num_layers is not None:
        _check_num_layers(args, steps)
    if args.expert_map:
        steps = _map_steps(args, steps, src)
    if order is not None:  # store as a one-rank dump does (router order), with the geometry that maps it
        from moeverify.record.order import to_router_order, to_sequence_order

        steps = {step: to_router_order(to_sequence_order(r, order=order, seq_len=args.seq_len, batch=args.batch,
                                                         where=f"{src} step {step}"),
                                       seq_len=args.seq_len, batch=args.batch, where=f"{src} step {step}")
                 for step, r in steps.items()}
    with _removed_on_failure(dst):
        for step, routes in steps.items():
            record.save(dst, routes, step=step, num_layers=args.num_layers,
                        moe_layers=args.moe_layers if src_format == "jsonl" and args.moe_layers else None,
                        seq_len=args.seq_len if order else None, batch=args.batch if order else None)
    known = f"token order recorded (seq_len {args.seq_len}, batch {args.batch})" if order else \
        "token order NOT recorded: dump diff will refuse it unless told (--seq-len/--batch/--order here)"
    print(f"wrote {dst}: step(s) {sorted(steps)}; {known}")
    return 0


def _convert_trace_ranks(args, src: Path, dst: Path) -> int:
    """``convert TRACE_DIR DST --layout NAME``: every rank's router_trace as one merged dump."""
    from moeverify import record
    from moeverify.errors import LayoutError
    from moeverify.layout import parse_layout_name
    from moeverify.record import importers
    from moeverify.views import rank_coords

    if not src.is_dir():
        raise UsageError(f"convert --layout reads a directory of router_trace_rank<R>.jsonl files; {src} is not one")
    missing = [flag for flag, value in (("--world-size", args.world_size), ("--num-layers", args.num_layers),
                                        ("--seq-len", args.seq_len), ("--batch", args.batch)) if value is None]
    if missing:
        raise UsageError(f"convert --layout needs {', '.join(missing)}: the model's decoder layers place each "
                         "pipeline stage's layers, the geometry places each rank's tokens")
    if args.order not in (None, "router") or args.expert_map or args.moe_layers or args.layer_offset or args.step:
        raise UsageError("convert --layout takes router_trace as Megatron writes it (every step it holds): no --order "
                         "other than router, --expert-map, --moe-layers, --layer-offset or --step")
    try:
        layout, dp = parse_layout_name(args.layout)
    except LayoutError as exc:
        raise UsageError(f"--layout: {exc}") from None
    world = args.world_size
    try:
        layout.validate(world_size=world)
    except LayoutError as exc:
        raise UsageError(f"--layout {args.layout} does not fit --world-size {world}: {exc}") from None
    if dp != 1 and layout.dp(world) != dp:
        raise UsageError(f"--layout {args.layout} says dp{dp}, but --world-size {world} makes dp{layout.dp(world)}")
    by_rank = importers.read_router_trace_ranks(src, layout=layout, world_size=world, num_layers=args.num_layers,
                                                num_experts=args.num_experts)
    moe_layers = sorted({layer for steps in by_rank.values() for r in steps.values() for layer in r.layers})
    experts = {r.num_experts for steps in by_rank.values() for r in steps.values()}
    with _removed_on_failure(dst):
        for step in sorted(by_rank[0]):  # every rank writes a step, then it is committed: one step at a time
            for rank, steps in by_rank.items():
                record.save(dst, steps[step], step=step, num_layers=args.num_layers, moe_layers=moe_layers,
                            seq_len=args.seq_len, batch=args.batch, world_size=world, layout=layout,
                            coords=rank_coords(layout, rank=rank, world_size=world))
            record.finalize(dst, world_size=world)
        merged = record.load(dst)
        for step in sorted(by_rank[0]):
            merged.routes(step=step)  # merge now: a geometry that does not fit fails here, loudly
    print(f"wrote {dst}: {world} ranks ({layout.name(world)}), step(s) {sorted(by_rank[0])}, "
          f"{len(moe_layers)} MoE layers, {max(experts)} experts; token order recorded (seq_len {args.seq_len}, "
          f"batch {args.batch} per rank)")
    return 0


def _map_steps(args, steps: dict, src: Path) -> dict:
    """Converted routes (physical expert slots) as logical expert ids through ``--expert-map``."""
    from moeverify.record import expert_map

    out = {}
    for step, routes in steps.items():
        num_layers = args.num_layers if args.num_layers is not None else max(routes.layers) + 1
        emap = expert_map.load(args.expert_map, moe_layers=routes.layers, num_layers=num_layers,
                               physical_experts=args.num_experts, what=str(src))
        if routes.num_experts > emap.physical:
            raise expert_map.ExpertMapError(f"{args.expert_map}: {emap.physical} slot(s), but {src} step {step} holds "
                                            f"expert id {routes.num_experts - 1}")
        out[step] = emap.map_routes(routes, where=f"{src} step {step}")
    return out


def _convert_order(args, src_format: str) -> str | None:
    """The token order convert records: None (unknown) unless --seq-len and --batch are given."""
    if (args.seq_len is None) != (args.batch is None):
        raise UsageError("--seq-len and --batch go together")
    if args.seq_len is None:
        if args.order is not None:
            raise UsageError(f"--order {args.order} needs --seq-len and --batch (the micro-batch geometry that maps "
                             f"the order)")
        return None
    if args.order is None and src_format != "jsonl":
        raise UsageError("an array's token order is not in the file: give --order sequence (rollout engines: each "
                         "request's tokens in turn) or --order router (Megatron's s * B + b)")
    return args.order or "router"  # Megatron's router_trace holds the router's own order


def _check_num_layers(args, steps) -> None:
    for step, routes in steps.items():
        too_high = [layer for layer in routes.layers if layer >= args.num_layers]
        if too_high:
            raise UsageError(f"--num-layers {args.num_layers}: step {step} has MoE layer(s) {too_high} >= it")


class _removed_on_failure:
    """A convert that fails leaves no half-made destination behind (only what it created itself)."""

    def __init__(self, dst: Path):
        self.dst, self.existed = dst, dst.exists()

    def __enter__(self):
        return self

    def __exit__(self, kind, exc, tb):
        if kind is not None and not self.existed and self.dst.exists():
            import shutil

            shutil.rmtree(self.dst, ignore_errors=True)
        return False


def _guess_src(src: Path) -> str:
    if src.is_dir():
        return "dump"
    suffix = src.suffix.lstrip(".")
    if suffix in _FROM:
        return suffix
    raise UsageError(f"cannot tell the format of {src} from its name; pass --from {{{','.join(_FROM)}}}")


def _routes_of(path_text: str, step: int, *, order: str | None, args, flag: str):
    """One side of a diff as a layer source (``stream``), in sequence order where its order is known
    (``order.Ordered``, with the sequences where the side knows them)."""
    from moeverify import record
    from moeverify.record import importers, stream
    from moeverify.record.order import Ordered, to_sequence_order

    path = Path(path_text)
    if path.is_dir():
        if order is not None:
            raise UsageError(f"{flag}: {path} is a dump, which records its own token order; drop {flag}")
        dump = record.load(path)
        source = stream.DumpSource(dump, step)
        source.microbatch_tokens()  # the step exists and its ranks can be merged: checked before any data is read
        if dump.token_order(step) is None:
            return Ordered(routes=source, source=str(path), order=None,
                           why_unknown=f"step {step} was saved without seq_len/batch, so its token order is unknown "
                                       f"(record.save(..., seq_len=, batch=), or convert with --seq-len --batch)")
        info = dump.steps[step]
        return Ordered(routes=source, source=str(path), order="sequence", seq_len=info.seq_len,
                       batch=dump.layout.dp(dump.world_size) * info.batch)
    if path.suffix in (".npy", ".npz"):
        routes = importers.routes_from_arrays(importers.read_arrays(path), where=str(path))
        if order is None:
            return Ordered(routes=stream.RoutesSource(routes), source=str(path), order=None,
                           why_unknown=f"an array carries no token order ({flag} sequence|router)")
        geometry = {}
        if args.seq_len is not None:
            geometry = {"seq_len": (args.seq_len,) * routes.microbatches, "batch": args.batch}
        return Ordered(routes=stream.RoutesSource(to_sequence_order(routes, order=order, seq_len=args.seq_len,
                                                                    batch=args.batch, where=str(path))),
                       source=str(path), order="sequence", **geometry)
    raise UsageError(f"{path}: neither a dump directory nor a .npy/.npz file")
