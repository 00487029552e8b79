"""``moeverify dump inspect | diff | convert | finalize``: ``register(subparsers)`` adds them; each verb sets
``func``. ``moeverify.cli`` imports this module only when ``dump`` runs (the dump format needs torch).

Every verb returns an exit code: 0 done, 1 ``diff --fail-on-diff`` found a difference, 2 bad input
(unreadable, corrupt or inconsistent dumps, impossible option combinations), with one message.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from rich.console import Console

from moeverify import record
from moeverify.commands.common import output_path
from moeverify.commands.dump_convert import FROM, TO, cmd_convert
from moeverify.commands.dump_diff import cmd_diff
from moeverify.commands.dump_errors import EXIT_DIFF, EXIT_USAGE, guarded, refuse_options
from moeverify.commands.dump_outputs import PLOT_SUFFIXES, check_outputs
from moeverify.errors import UsageError
from moeverify.files import atomic_write
from moeverify.record.commit import drop_uncommitted
from moeverify.record.order import ORDERS
from moeverify.record.summary import summarize, summary_table
from moeverify.routing.layer_numbering import NUMBERINGS

__all__ = ["EXIT_DIFF", "EXIT_USAGE", "cmd_convert", "cmd_diff", "cmd_finalize", "cmd_inspect", "register"]


def register(subparsers) -> argparse.ArgumentParser:
    """Add ``dump`` with its verbs to an argparse subparsers object."""
    dump = subparsers.add_parser(
        "dump", help="routing dumps: inspect, diff, convert", description="Inspect, compare and convert routing dumps."
    )
    verbs = dump.add_subparsers(dest="dump_verb", metavar="VERB", parser_class=type(dump))
    verbs.required = True

    p = verbs.add_parser("inspect", help="summarise one dump: shape, layout, steps, load balance per layer")
    p.add_argument("path", metavar="PATH", help="dump directory")
    p.add_argument("--step", type=_non_negative, metavar="S", help="step for the load table (default: first)")
    p.add_argument(
        "--json", type=output_path, metavar="OUT", help="also write the summary as JSON (never into the dump)"
    )
    p.set_defaults(func=cmd_inspect)

    p = verbs.add_parser("diff", help="compare two routings of the same tokens, layer by layer")
    p.add_argument("a", metavar="A", help="dump directory, or .npy/.npz [tokens, layers, topk] routes")
    p.add_argument("b", metavar="B", help="dump directory, or .npy/.npz routes")
    p.add_argument(
        "--step",
        type=_non_negative,
        metavar="S",
        help="step of A when it is a dump or an export (required when it holds several; else its only step)",
    )
    p.add_argument("--step-b", type=_non_negative, metavar="S", help="step of B (default: --step)")
    p.add_argument("--json", type=output_path, metavar="OUT", help="write the diff record as JSON")
    p.add_argument(
        "--plot",
        type=output_path,
        metavar="PNG",
        help=f"write the disagreement heatmap and expert-load bars to exactly this path, ending "
        f"{', '.join(PLOT_SUFFIXES)} (the format)",
    )
    p.add_argument("--worst", type=_non_negative, default=10, metavar="N", help="tokens listed in JSON (default 10)")
    p.add_argument("--fail-on-diff", action="store_true", help="exit 1 if any token's expert set differs")
    p.add_argument(
        "--tokens-differ-ok",
        action="store_true",
        help="compare although both sides' token fingerprints say they routed different tokens (refused "
        "otherwise); the report then labels the divergence as on differing tokens",
    )
    p.add_argument("--order-a", choices=ORDERS, help="token order of A when it is an array (a dump knows its own)")
    p.add_argument("--order-b", choices=ORDERS, help="token order of B when it is an array")
    _add_geometry(p, "of the array side(s) given in router order")
    p.add_argument(
        "--rollout",
        action="store_true",
        help="B is a rollout engine's routed experts: .npz with one [positions, layers, topk] array per "
        "request (vLLM routed_experts, SGLang return_routed_experts), or .npy [requests, positions, "
        "layers, topk] padded with -1; lined up with A's sequences request by request",
    )
    p.add_argument(
        "--gaps-expected",
        action="store_true",
        help="with --rollout and --fail-on-diff: capture gaps (rows the engine never filled) are expected, e.g. a "
        "framework's zero-filled rows after a trajectory's last generation; without it a gap fails the diff",
    )
    p.add_argument(
        "--assume-same-order",
        action="store_true",
        help="compare by position although a side's token order is unknown (you vouch for it)",
    )
    p.add_argument(
        "--expert-map-a",
        metavar="FILE",
        help="A records physical expert slots (EPLB redundant experts): "
        ".json or .npy map slot -> logical expert id, one for all layers or one per layer; A's ids are "
        "mapped to logical ids before comparing",
    )
    p.add_argument("--expert-map-b", metavar="FILE", help="the same for B")
    _add_numbering(p, "with --rollout: what B's layer axis holds")
    p.add_argument(
        "--in-memory",
        action="store_true",
        help="load both sides whole and diff in memory (default: "
        "read one layer at a time; same figures, memory of one layer)",
    )
    p.set_defaults(func=cmd_diff)

    p = verbs.add_parser(
        "finalize",
        help="commit (or discard) steps a run wrote but did not commit to the manifest",
        description="A run that ends between its rank files and the manifest leaves steps written "
        "but uncommitted. finalize folds the rank records into manifest.json; with "
        "--drop-uncommitted it deletes what the manifest does not list instead.",
    )
    p.add_argument("path", metavar="PATH", help="dump directory")
    p.add_argument(
        "--world-size", type=_positive, metavar="N", help="ranks the dump must have (default: the records' own)"
    )
    p.add_argument("--drop-uncommitted", action="store_true", help="discard uncommitted steps instead")
    p.set_defaults(func=cmd_finalize)

    p = verbs.add_parser("convert", help="rollout arrays or Megatron router_trace JSONL to a dump; a dump to .npz")
    p.add_argument("src", metavar="SRC", help="dump directory, .npy, .npz or router_trace_rank*.jsonl")
    p.add_argument(
        "dst", type=output_path, metavar="DST", help="new dump directory or .npz file (never an existing path)"
    )
    p.add_argument("--from", dest="src_format", choices=FROM, help="SRC format (default: from its suffix)")
    p.add_argument("--to", dest="dst_format", choices=TO, help="DST format (default: npz if DST ends .npz)")
    p.add_argument("--num-experts", type=_positive, metavar="E", help="experts per layer (default: max id + 1)")
    p.add_argument(
        "--moe-layers",
        type=_int_list,
        metavar="L,L,...",
        help="global MoE layer numbers of the "
        "array's layer axis (default 0..layers-1); with --layout, the model's MoE layers (a pipeline "
        "stage holding none of them may have an empty trace)",
    )
    p.add_argument("--num-layers", type=_positive, metavar="N", help="decoder layers (default: last MoE layer + 1)")
    p.add_argument("--step", type=_non_negative, metavar="S", help="step to write (arrays; default 0)")
    p.add_argument(
        "--layer-offset",
        type=_non_negative,
        metavar="N",
        help="added to router_trace layer numbers (a later pipeline stage's first layer; default 0)",
    )
    p.add_argument(
        "--microbatches",
        type=_positive,
        metavar="M",
        help="router_trace: the job's micro-batches per "
        "step (per rank); with it, records of activation recompute (a micro-batch routed again in "
        "backward) are identified by their equal ids and dropped; without it a step holding more than one "
        "forward pass is refused",
    )
    p.add_argument(
        "--layout",
        metavar="NAME",
        help="SRC is a directory of every rank's router_trace_rank<R>.jsonl "
        "of one job under this layout (e.g. tp2-sp, ep2, cp2, pp2; Megatron's default rank order): one "
        "merged dump; needs --world-size, --num-layers, --seq-len (global) and --batch (per rank)",
    )
    p.add_argument(
        "--world-size",
        type=_positive,
        metavar="N",
        help="with --layout: the job's ranks (exactly router_trace_rank0..N-1.jsonl must be in SRC)",
    )
    p.add_argument(
        "--order",
        choices=ORDERS,
        help="token order of SRC (router_trace: router; arrays: required with --seq-len/--batch)",
    )
    p.add_argument(
        "--expert-map",
        metavar="FILE",
        help="SRC holds physical expert slots: map them to logical expert "
        "ids (.json or .npy slot -> logical id, one for all layers or one per layer) before writing",
    )
    _add_geometry(p, "of SRC's micro-batches; with them the dump knows its token order")
    _add_numbering(p, "arrays with --moe-layers: what SRC's layer axis holds")
    p.set_defaults(func=cmd_convert)
    return dump


def _add_numbering(p, what: str) -> None:
    p.add_argument(
        "--layer-numbering",
        choices=NUMBERINGS,
        help=f"{what}: one column per MoE router (routers) or "
        "one per decoder layer, dense ones included (decoder); default: inferred, and refused when the "
        "column count fits both (as many dense layers as MTP layers)",
    )


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


# -- verbs --------------------------------------------------------------------------------------
@guarded
def cmd_inspect(args) -> int:
    """``dump inspect PATH``."""
    check_outputs([("--json", args.json)], [("PATH", args.path)])
    summary = summarize(record.load(args.path), step=args.step)
    if args.json is not None:  # written before the table: a reader that closes stdout (| head) still gets it
        atomic_write(Path(args.json), (json.dumps(summary, indent=1) + "\n").encode())
    title, table = summary_table(summary)
    console = Console()
    console.print(title)
    console.print(table)
    return 0


@guarded
def cmd_finalize(args) -> int:
    """``dump finalize PATH``."""
    path = Path(args.path)
    if not path.is_dir():
        raise UsageError(f"{path}: not a directory")
    if args.drop_uncommitted:
        refuse_options(
            args, ["--world-size"], because="--drop-uncommitted keeps what the manifest commits, whatever the ranks"
        )
        dropped = drop_uncommitted(path)
        print(
            f"{path}: dropped "
            + (
                "; ".join(f"rank {r} step(s) {s}" for r, s in sorted(dropped.items()))
                if dropped
                else "nothing (every step was committed)"
            )
        )
        return 0
    manifest = record.finalize(path, world_size=args.world_size)
    record.load(path)  # what was committed must read back
    print(f"{path}: committed step(s) {sorted(int(s) for s in manifest['steps'])} of {manifest['world_size']} rank(s)")
    return 0
