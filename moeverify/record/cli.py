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
    p.add_argument("--order", choices=ORDERS, help="token order of SRC (router_trace: router; arrays: required "
                   "with --seq-len/--batch)")
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
    from moeverify.record.order import require_same_tokens

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
    a, b = _align_experts(a.routes, b.routes)
    return _report(args, record.diff(a, b))


def _report(args, report, extra: dict | None = None) -> int:
    from rich.console import Console

    Console().print(report.table())
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
        return [arr[r][~(arr[r] < 0).all(axis=(1, 2))] for r in range(arr.shape[0])]  # drop all -1 padding rows
    return arrays


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
    info = dump.steps[step]
    aligned = align(dump.routes(step=step), seq_len=info.seq_len, batch=info.batch, moe_layers=dump.model.moe_layers,
                    num_layers=dump.model.num_layers, requests=_rollout_requests(rollout_path), where=str(rollout_path))
    print(f"rollout: {aligned.requests} request(s), {aligned.compared} token(s) compared, {aligned.uncaptured} "
          f"training position(s) without a rollout row, {aligned.gaps} capture-gap row(s) set apart")
    return _report(args, record.diff(aligned.train, aligned.rollout), {"rollout": aligned.as_json()})


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
    src_format = args.src_format or _guess_src(src)
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
        out = importers.export_npz(record.load(src), dst)
        print(f"wrote {out}")
        return 0
    order = _convert_order(args, src_format)
    if src_format == "jsonl":
        steps = importers.read_router_trace(src, num_experts=args.num_experts, layer_offset=args.layer_offset)
    else:
        arrays = importers.read_arrays(src, fmt=src_format)
        steps = {args.step: importers.routes_from_arrays(arrays, num_experts=args.num_experts,
                                                         moe_layers=args.moe_layers, where=str(src))}
    if args.num_layers is not None:
        _check_num_layers(args, steps)
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
    """One side of a diff, in sequence order where its order is known (``order.Ordered``)."""
    from moeverify import record
    from moeverify.record import importers
    from moeverify.record.order import Ordered, to_sequence_order

    path = Path(path_text)
    if path.is_dir():
        if order is not None:
            raise UsageError(f"{flag}: {path} is a dump, which records its own token order; drop {flag}")
        dump = record.load(path)
        routes = dump.routes(step=step)
        if dump.token_order(step) is None:
            return Ordered(routes=routes, source=str(path), order=None,
                           why_unknown=f"step {step} was saved without seq_len/batch, so its token order is unknown "
                                       f"(record.save(..., seq_len=, batch=), or convert with --seq-len --batch)")
        return Ordered(routes=routes, source=str(path), order="sequence")
    if path.suffix in (".npy", ".npz"):
        routes = importers.routes_from_arrays(importers.read_arrays(path), where=str(path))
        if order is None:
            return Ordered(routes=routes, source=str(path), order=None,
                           why_unknown=f"an array carries no token order ({flag} sequence|router)")
        return Ordered(routes=to_sequence_order(routes, order=order, seq_len=args.seq_len, batch=args.batch,
                                                where=str(path)), source=str(path), order="sequence")
    raise UsageError(f"{path}: neither a dump directory nor a .npy/.npz file")


def _align_experts(a, b):
    """Arrays carry no expert count (max id + 1 is inferred); take the larger one for both sides."""
    from moeverify.routes import Routes

    experts = max(a.num_experts, b.num_experts)

    def widen(r):
        if r.num_experts == experts:
            return r
        data = {layer: [r.get(layer, mb) for mb in range(r.microbatches)] for layer in r.layers}
        return Routes(data, num_experts=experts, topk=r.topk)

    return widen(a), widen(b)
