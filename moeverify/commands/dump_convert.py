"""``moeverify dump convert SRC DST``: rollout arrays or Megatron's router_trace JSONL (one file, or every rank's
of one job) to a dump; a dump to ``.npz``. A failed convert leaves nothing behind."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np

from moeverify import record
from moeverify.commands.dump_errors import guarded, refuse_options
from moeverify.commands.dump_outputs import refuse_inputs
from moeverify.errors import LayoutError, UsageError
from moeverify.record import importers
from moeverify.record.writer import RankWriter
from moeverify.routing import expert_map, layer_numbering
from moeverify.routing.views import rank_coords
from moeverify.spec.layout import parse_layout_name

FROM = ("dump", "npy", "npz", "jsonl")
TO = ("dump", "npz")


_ALL = (
    "--num-experts",
    "--moe-layers",
    "--num-layers",
    "--step",
    "--layer-offset",
    "--layout",
    "--world-size",
    "--order",
    "--seq-len",
    "--batch",
    "--microbatches",
    "--layer-numbering",
)


@guarded
def cmd_convert(args) -> int:
    """``dump convert SRC DST``."""
    src, dst = Path(args.src), Path(args.dst)
    if args.layout is not None and args.src_format is None and src.suffix in (".npy", ".npz"):
        raise UsageError(
            f"--layout reads a directory of every rank's router_trace_rank<R>.jsonl; {src} is a "
            f"{src.suffix} array (drop --layout)"
        )
    src_format = args.src_format or ("jsonl" if args.layout is not None else _guess_src(src))
    dst_format = args.dst_format or ("npz" if dst.suffix == ".npz" else "dump")
    if src_format == "dump" and dst_format == "dump":
        raise UsageError("convert from a dump to a dump does nothing; use --to npz (or a DST ending .npz)")
    if src_format != "dump" and dst_format == "npz":
        raise UsageError(f"convert --from {src_format} writes a dump; drop --to npz or give a DST directory")
    _check_dst(dst, dst_format)
    refuse_inputs("DST", args.dst, [("SRC", args.src), ("--expert-map", args.expert_map)])
    _refuse_inapplicable(args, src, src_format)
    if src_format == "dump":
        dump = record.load(src)
        routes_of = None
        if args.expert_map:
            emap = expert_map.load(
                args.expert_map,
                moe_layers=dump.model.moe_layers,
                num_layers=dump.model.num_layers,
                physical_experts=dump.model.num_experts,
                what=str(src),
            )
            routes_of = lambda step: dump.routes(step=step).map_experts(emap, where=f"{src} step {step}")  # noqa: E731
        out = importers.export_npz(dump, dst, routes_of=routes_of)
        print(
            f"wrote {out}"
            + (f" (logical expert ids through {args.expert_map})" if routes_of else "")
            + "; dump diff reads it back with its steps and token order"
        )
        return 0
    if args.layout is not None:
        return _convert_trace_ranks(args, src, dst)
    order = _convert_order(args, src_format)
    if src_format == "jsonl":
        steps = importers.read_router_trace(
            src, num_experts=args.num_experts, layer_offset=args.layer_offset or 0, microbatches=args.microbatches
        )
    else:
        named = _moe_columns(args, importers.read_named_arrays(src, fmt=src_format), src)
        if order and args.seq_len is not None and args.batch is not None:
            for name, arr in named.items():  # each micro-batch's array routes seq_len x batch tokens
                if getattr(arr, "ndim", 0) == 3 and arr.shape[0] != args.seq_len * args.batch:
                    raise UsageError(
                        f"{src}: {name}: {arr.shape[0]} tokens != --seq-len {args.seq_len} x --batch "
                        f"{args.batch} = {args.seq_len * args.batch} (each array is one micro-batch)"
                    )
        steps = {
            args.step or 0: importers.routes_from_arrays(
                list(named.values()),
                num_experts=args.num_experts,
                moe_layers=args.moe_layers,
                where=str(src),
                names=list(named),
            )
        }
    if args.num_layers is not None:
        _check_num_layers(args, steps)
    if args.expert_map:
        steps = _map_steps(args, steps, src)
    with _removed_on_failure(dst):
        for step, routes in steps.items():
            record.save(
                dst,
                routes,
                step=step,
                num_layers=args.num_layers,
                moe_layers=args.moe_layers if src_format == "jsonl" and args.moe_layers else None,
                seq_len=args.seq_len if order else None,
                batch=args.batch if order else None,
                order=order,
            )
    known = (
        f"token order recorded (seq_len {args.seq_len}, batch {args.batch})"
        if order
        else "token order NOT recorded: dump diff will refuse it unless told (--seq-len/--batch/--order here)"
    )
    print(f"wrote {dst}: step(s) {sorted(steps)}; {known}")
    return 0


def _check_dst(dst: Path, dst_format: str) -> None:
    if not dst.resolve().parent.is_dir():
        raise UsageError(f"{dst}: directory {dst.resolve().parent} does not exist")
    if dst_format == "dump" and (dst.exists() or dst.is_symlink()):  # an empty directory too: never written into
        if not dst.is_dir():
            raise UsageError(f"{dst} exists and is not a directory; give a new directory for the dump")
        what = "already holds a dump" if (dst / record.MANIFEST).exists() else "exists"
        raise UsageError(f"{dst} {what}; convert never writes into an existing directory: give a new one")
    if dst_format == "npz" and dst.suffix != ".npz":
        raise UsageError(f"{dst}: an export is a .npz file; give a DST ending in .npz")
    if dst_format == "npz" and dst.exists():
        raise UsageError(f"{dst} exists; choose a new file (convert never overwrites)")


def _refuse_inapplicable(args, src: Path, src_format: str) -> None:
    """Every option that would not change what this source converts to is refused, naming it."""
    if src_format == "dump":
        refuse_options(
            args,
            _ALL,
            because=f"{src} is a dump, which records its own model, steps, token order and "
            "layout; convert DIR OUT.npz writes them as they are",
        )
        return
    if src_format == "npz" and importers.is_export(src):
        raise UsageError(
            f"{src} is an export of a dump (dump convert DIR OUT.npz): convert the dump itself, or "
            "give the .npz to dump diff directly (it keeps the dump's steps and token order)"
        )
    if args.layout is not None:
        if src_format != "jsonl":
            raise UsageError(f"--layout reads every rank's router_trace JSONL; --from {src_format} does not apply")
        refuse_options(
            args,
            ["--expert-map", "--layer-offset", "--step"],
            because="convert --layout takes "
            "router_trace as Megatron writes it, every step it holds, each stage's layers placed by "
            "--num-layers",
        )
    else:
        refuse_options(args, ["--world-size"], because="it gives the ranks of --layout")
    if src_format == "jsonl":
        refuse_options(args, ["--step"], because="router_trace records its own steps, and every step is written")
        refuse_options(args, ["--layer-numbering"], because="router_trace names each record's layer itself")
        if args.order not in (None, "router"):
            raise UsageError(
                f"--order {args.order}: router_trace holds Megatron's router order (s * B + b), always; "
                "drop --order or give --order router"
            )
    else:
        refuse_options(
            args,
            ["--layer-offset", "--microbatches"],
            because=f"they apply to router_trace JSONL, and {src} is a .{src_format} array",
        )


def _convert_trace_ranks(args, src: Path, dst: Path) -> int:
    """``convert TRACE_DIR DST --layout NAME``: every rank's router_trace as one merged dump."""
    if not src.is_dir():
        raise UsageError(f"convert --layout reads a directory of router_trace_rank<R>.jsonl files; {src} is not one")
    missing = [
        flag
        for flag, value in (
            ("--world-size", args.world_size),
            ("--num-layers", args.num_layers),
            ("--seq-len", args.seq_len),
            ("--batch", args.batch),
        )
        if value is None
    ]
    if missing:
        raise UsageError(
            f"convert --layout needs {', '.join(missing)}: the model's decoder layers place each "
            "pipeline stage's layers, the geometry places each rank's tokens"
        )
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
    moe_layers = None
    if args.moe_layers:
        moe_layers = sorted(set(args.moe_layers))
        bad = [layer for layer in moe_layers if not 0 <= layer < args.num_layers]
        if bad or len(moe_layers) != len(args.moe_layers):
            raise UsageError(
                f"--moe-layers {list(args.moe_layers)}: must be distinct layers in [0, --num-layers {args.num_layers})"
            )
    by_rank = importers.read_router_trace_ranks(
        src,
        layout=layout,
        world_size=world,
        num_layers=args.num_layers,
        num_experts=args.num_experts,
        moe_layers=moe_layers,
        microbatches=args.microbatches,
    )
    traced = {rank: steps for rank, steps in by_rank.items() if steps}
    first = traced[min(traced)]
    if moe_layers is None:
        moe_layers = sorted({layer for steps in traced.values() for r in steps.values() for layer in r.layers})
    experts = max(r.num_experts for r in first.values())
    with _removed_on_failure(dst):
        for step in sorted(first):  # every rank writes a step, then it is committed: one step at a time
            for rank in range(world):
                coords = rank_coords(layout, rank=rank, world_size=world)
                if rank in traced:
                    record.save(
                        dst,
                        traced[rank][step],
                        step=step,
                        num_layers=args.num_layers,
                        moe_layers=moe_layers,
                        seq_len=args.seq_len,
                        batch=args.batch,
                        order="router",
                        world_size=world,
                        layout=layout,
                        coords=coords,
                    )
                else:  # a pipeline stage without MoE layers: its geometry only
                    _save_dense_rank(
                        dst,
                        step=step,
                        microbatches=first[step].microbatches,
                        args=args,
                        layout=layout,
                        coords=coords,
                        model=record.ModelInfo(
                            num_layers=args.num_layers,
                            moe_layers=tuple(moe_layers),
                            num_experts=experts,
                            topk=first[step].topk,
                        ),
                    )
            record.finalize(dst, world_size=world)
        merged = record.load(dst)
        for step in sorted(first):
            merged.routes(step=step)  # merge now: a geometry that does not fit fails here, loudly
    dense = sorted(set(range(world)) - set(traced))
    print(
        f"wrote {dst}: {world} ranks ({layout.name(world)}), step(s) {sorted(first)}, "
        f"{len(moe_layers)} MoE layers, {experts} experts; token order recorded (seq_len {args.seq_len}, "
        f"batch {args.batch} per rank)" + (f"; rank(s) {dense} hold no MoE layer" if dense else "")
    )
    return 0


def _save_dense_rank(dst: Path, *, step: int, microbatches: int, args, layout, coords, model) -> None:
    with RankWriter(
        dst, model=model, coords=coords, layout=layout, world_size=args.world_size, background=False, append=True
    ) as writer:
        for mb in range(microbatches):
            writer.add_tokens(step=step, mb=mb, seq_len=args.seq_len, batch=args.batch)


def _moe_columns(args, named: dict, src: Path) -> dict:
    """Arrays whose layer axis holds one column per decoder layer, cut to their ``--moe-layers`` columns
    (``layer_numbering``: refused when the width fits both readings, unless ``--layer-numbering`` says which)."""
    if args.moe_layers is None:
        if args.layer_numbering == "decoder":
            raise UsageError(
                "--layer-numbering decoder needs --moe-layers: which of the decoder layer columns are the MoE layers"
            )
        return named
    moe = list(args.moe_layers)
    num_layers = args.num_layers if args.num_layers is not None else max(moe, default=-1) + 1
    out = {}
    for name, arr in named.items():
        width = arr.shape[1] if isinstance(arr, np.ndarray) and arr.ndim == 3 else None
        if width is None or (
            args.layer_numbering is None
            and width != num_layers
            and not layer_numbering.ambiguous(width, layers=moe, num_layers=num_layers)
        ):
            out[name] = arr  # one column per MoE layer, or refused by routes_from_arrays naming --moe-layers
            continue
        cols = layer_numbering.columns(
            width,
            layers=moe,
            num_layers=num_layers,
            numbering=args.layer_numbering,
            where=f"{src}: {name}",
            error=UsageError,
            pick="--layer-numbering {}",
            count="--num-layers",
        )
        out[name] = arr if cols == list(range(width)) else arr[:, cols, :]
    return out


def _map_steps(args, steps: dict, src: Path) -> dict:
    """Converted routes (physical expert slots) as logical expert ids through ``--expert-map``."""
    out = {}
    for step, routes in steps.items():
        num_layers = args.num_layers if args.num_layers is not None else max(routes.layers) + 1
        emap = expert_map.load(
            args.expert_map,
            moe_layers=routes.layers,
            num_layers=num_layers,
            physical_experts=args.num_experts,
            what=str(src),
        )
        if routes.num_experts > emap.physical:
            raise expert_map.ExpertMapError(
                f"{args.expert_map}: {emap.physical} slot(s), but {src} step {step} holds "
                f"expert id {routes.num_experts - 1}"
            )
        out[step] = routes.map_experts(emap, where=f"{src} step {step}")
    return out


def _convert_order(args, src_format: str) -> str | None:
    """The token order convert records: None (unknown) unless --seq-len and --batch are given."""
    if (args.seq_len is None) != (args.batch is None):
        raise UsageError("--seq-len and --batch go together")
    if args.seq_len is None:
        if args.order is not None:
            raise UsageError(
                f"--order {args.order} needs --seq-len and --batch (the micro-batch geometry that maps the order)"
            )
        return None
    if args.order is None and src_format != "jsonl":
        raise UsageError(
            "an array's token order is not in the file: give --order sequence (rollout engines: each "
            "request's tokens in turn) or --order router (Megatron's s * B + b)"
        )
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
            shutil.rmtree(self.dst, ignore_errors=True)
        return False


def _guess_src(src: Path) -> str:
    if src.is_dir():
        if src.suffix in (".npy", ".npz", ".jsonl") and not (src / "manifest.json").exists():
            raise UsageError(f"{src} is a directory, not a {src.suffix} file (and holds no dump manifest)")
        return "dump"
    suffix = src.suffix.lstrip(".")
    if suffix in FROM:
        return suffix
    raise UsageError(f"cannot tell the format of {src} from its name; pass --from {{{','.join(FROM)}}}")
