"""``moeverify dump diff A B``: both sides lined up token for token (or refused), compared, reported; with
``--rollout``, a training dump against a rollout engine's routed experts request by request."""

from __future__ import annotations

import json
from pathlib import Path

from rich.console import Console

from moeverify import record
from moeverify.commands.dump_errors import EXIT_DIFF, guarded, refuse_options
from moeverify.commands.dump_outputs import check_outputs
from moeverify.commands.dump_plot import plot_diff
from moeverify.errors import RouteError, UsageError
from moeverify.files import atomic_write
from moeverify.record import importers, stream, tokens
from moeverify.record.order import Ordered, require_same_tokens, shared_geometry, to_sequence_order
from moeverify.record.rollout import align
from moeverify.routing import expert_map
from moeverify.routing.rollout_arrays import RolloutSpec


@guarded
def cmd_diff(args) -> int:
    """``dump diff A B``."""
    check_outputs(  # before anything is read: never onto (or into) an input, never one file twice
        [("--json", args.json), ("--plot", args.plot)],
        [("A", args.a), ("B", args.b), ("--expert-map-a", args.expert_map_a), ("--expert-map-b", args.expert_map_b)],
    )

    if (args.seq_len is None) != (args.batch is None):
        raise UsageError("--seq-len and --batch go together")
    if args.rollout:
        return _diff_rollout(args)
    refuse_options(args, ["--layer-numbering"], because="it says what a rollout's layer axis holds (with --rollout)")
    refuse_options(args, ["--gaps-expected"], because="only a rollout (--rollout) has capture gaps")
    kind_a, kind_b = _kind(args.a), _kind(args.b)
    if kind_a == "array":
        refuse_options(
            args,
            ["--step"],
            because=f"--step is A's step, and A ({args.a}) is an array of one step (B's step is --step-b)",
        )
    if kind_b == "array":
        refuse_options(args, ["--step-b"], because=f"B ({args.b}) is an array of one step")
    if not any(kind == "array" and order for kind, order in ((kind_a, args.order_a), (kind_b, args.order_b))):
        refuse_options(
            args,
            ["--seq-len", "--batch"],
            because="they give the geometry of an array side given with "
            "--order-a/--order-b, and there is none (a dump or an export records its own)",
        )
    a = _routes_of(args.a, args.step, order=args.order_a, args=args, flag="--order-a")
    b = _routes_of(
        args.b, args.step if args.step_b is None else args.step_b, order=args.order_b, args=args, flag="--order-b"
    )
    if a.order is not None and b.order is not None:
        refuse_options(
            args,
            ["--assume-same-order"],
            because="both sides' token orders are known, so they are lined up token for token without it",
        )
    tokens = _check_tokens(args, a, b)
    require_same_tokens(a, b, assume_same_order=args.assume_same_order)
    geometry = shared_geometry(a, b)
    src_a, src_b, maps = _mapped(args, a, b)
    seq_len, batch = (None, None) if geometry is None else geometry
    try:
        if args.in_memory:
            report = record.diff(src_a.routes(), src_b.routes(), seq_len=seq_len, batch=batch)
        else:
            report = record.diff_stream(src_a, src_b, seq_len=seq_len, batch=batch)
    except RouteError as exc:
        if not str(exc).startswith("cannot diff:"):
            raise
        raise UsageError(f"{exc} (A: {args.a}, B: {args.b})") from None
    return _report(
        args,
        report,
        {"engine": "in-memory" if args.in_memory else "stream", "expert_maps": maps, "token_identity": tokens},
    )


def _check_tokens(args, a, b) -> dict:
    """Token identity first: refuse sides whose tokens differ unless ``--tokens-differ-ok``; one line when it is
    unknown. Returns the JSON record (``tokens``)."""
    sides = [side.routes for side in (a, b)]
    if not all(isinstance(s, stream.DumpSource) for s in sides):
        which = " and ".join(
            f"{name} ({side.source})"
            for name, side in (("A", a), ("B", b))
            if not isinstance(side.routes, stream.DumpSource)
        )
        print(
            f"token identity unknown: {which} carr{'y' if ' and ' in which else 'ies'} no token fingerprints "
            f"(only a dump does)"
        )
        return {"identity": "unknown"}
    check = tokens.compare(sides[0].dump, sides[0].step, sides[1].dump, sides[1].step)
    if isinstance(check, str):
        print(check)
        return {"identity": "unknown"}
    if check.differ:
        if not getattr(args, "tokens_differ_ok", False):
            raise UsageError(
                f"{check.line()}: A ({a.source}) and B ({b.source}) did not route the same tokens, so "
                f"their routing cannot be compared as divergence; --tokens-differ-ok compares them "
                f"anyway (reported as routing on differing tokens)"
            )
        print(
            f"{check.line()}: the routing divergence below is on DIFFERING tokens (--tokens-differ-ok), not "
            f"divergence of one routing"
        )
    else:
        print(f"tokens: the same in all {check.sequences} sequences (fingerprints)")
    return {"identity": "differ" if check.differ else "same", **check.as_json()}


def _kind(path_text: str) -> str:
    """``dump`` (a directory), ``export`` (a .npz that ``dump convert DIR OUT.npz`` wrote) or ``array``."""
    path = Path(path_text)
    if path.is_dir():
        if path.suffix in (".npy", ".npz") and not (path / "manifest.json").exists():
            raise UsageError(f"{path} is a directory, not a {path.suffix} file (and holds no dump manifest)")
        return "dump"
    if path.suffix in (".npy", ".npz"):
        return "export" if importers.is_export(path) else "array"
    raise UsageError(f"{path}: neither a dump directory nor a .npy/.npz file")


def _mapped(args, a, b):
    """Both sides' layer sources with their expert maps applied and one expert count; the maps' JSON record."""
    sides = {}
    for name, side, _flag, path in (
        ("a", a, "--expert-map-a", args.expert_map_a),
        ("b", b, "--expert-map-b", args.expert_map_b),
    ):
        src = side.routes
        if path is None:
            sides[name] = (src, None, side)
            continue
        dump = src.dump if isinstance(src, stream.DumpSource) else None
        layers = src.layers
        emap = expert_map.load(
            path,
            moe_layers=layers,
            num_layers=dump.model.num_layers if dump is not None else None,
            physical_experts=src.num_experts if dump is not None else None,
            what=f"{side.source}",
        )
        if dump is None and src.num_experts > emap.physical:  # an array: its largest id must be a slot of the map
            raise expert_map.ExpertMapError(
                f"{path}: {emap.physical} slot(s), but {side.source} holds expert id {src.num_experts - 1}"
            )
        src = stream.MappedSource(
            stream.widen(src, emap.physical), emap, where=side.source, token_label=_token_label(side)
        )
        sides[name] = (src, emap, side)
    (src_a, map_a, side_a), (src_b, map_b, side_b) = sides["a"], sides["b"]
    for mapped, other, other_side, other_map in ((map_a, src_b, side_b, map_b), (map_b, src_a, side_a, map_a)):
        if mapped is None:
            continue
        known = other_map is not None or isinstance(other_side.routes, stream.DumpSource)  # arrays infer theirs
        if known and other.num_experts != mapped.logical:
            whose = f"{other_map.path}'s" if other_map is not None else f"{other_side.source}'s"
            raise expert_map.ExpertMapError(
                f"{mapped.path}: maps onto {mapped.logical} logical experts, {whose} side "
                f"has {other.num_experts} (both sides must be the same logical experts)"
            )
    # A dump or an export states its expert count (a mapped side: the map's logical count); only an array
    # infers one from its largest id and may be widened. Two stated counts that differ are two models.
    stated = {
        name: (src.num_experts if emap is not None or _kind(path) != "array" else None, side.source)
        for name, (src, emap, side), path in (("A", sides["a"], args.a), ("B", sides["b"], args.b))
    }
    (experts_a, where_a), (experts_b, where_b) = stated["A"], stated["B"]
    if experts_a is not None and experts_b is not None and experts_a != experts_b:
        raise UsageError(
            f"cannot diff: A ({where_a}) has {experts_a} experts, B ({where_b}) has {experts_b}: "
            f"routes of different models (an expert map, --expert-map-a/-b, maps physical slots to "
            f"logical experts)"
        )
    dumps = [side.routes.dump for side in (a, b) if isinstance(side.routes, stream.DumpSource)]
    if len(dumps) == 2 and dumps[0].model.num_layers != dumps[1].model.num_layers:
        raise UsageError(
            f"cannot diff: A ({a.source}) is a model of {dumps[0].model.num_layers} decoder layers, B ({b.source}) "
            f"of {dumps[1].model.num_layers}: routes of different models (their MoE layers being the same "
            "numbers is no proof they are the same layers)"
        )
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


def _report(args, report, extra: dict | None = None, *, gaps: int = 0) -> int:
    """The files first, then the tables: a reader that closes stdout early (``| head``) still gets them."""
    if args.json is not None:
        record_json = report.to_json(worst=args.worst)
        if extra:
            record_json.update(extra)
        atomic_write(Path(args.json), (json.dumps(record_json, indent=1) + "\n").encode())
    if args.plot is not None:
        plot_diff(report, args.plot)
    console = Console()
    console.print(report.table())
    sequences = report.sequence_table(args.worst)
    if sequences is not None:
        console.print(sequences)
    if args.fail_on_diff and report.tokens_diverging_any_layer > 0:
        return EXIT_DIFF
    if args.fail_on_diff and gaps and not getattr(args, "gaps_expected", False):
        print(
            f"FAIL: {gaps} capture-gap row(s): the engine returned rows it never filled, so those routes cannot be "
            "compared (a capture bug, vllm-ascend #15451's shape); --gaps-expected if your framework leaves them so"
        )
        return EXIT_DIFF
    return 0


def _rollout_requests(path: Path) -> list:
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
    train_path, rollout_path = Path(args.a), Path(args.b)
    if not train_path.is_dir():
        raise UsageError(f"--rollout: A must be the training dump (a directory), got {train_path}")
    refuse_options(
        args,
        ["--order-a", "--order-b", "--seq-len", "--batch", "--assume-same-order"],
        because="--rollout lines requests up by themselves",
    )
    refuse_options(args, ["--step-b"], because="a rollout holds one step's requests (A's step is --step)")
    refuse_options(args, ["--tokens-differ-ok"], because="a rollout file carries no token ids to compare")
    if args.gaps_expected and not args.fail_on_diff:
        raise UsageError("--gaps-expected: does not apply without --fail-on-diff (gaps are counted either way)")
    if _kind(args.b) == "export":
        raise UsageError(
            f"--rollout: {rollout_path} is an export of a dump (dump convert DIR OUT.npz), not a rollout "
            "engine's routed experts; compare it without --rollout"
        )
    dump = record.load(train_path)
    step = _one_step(dump, args.step, train_path, "--step")
    geometry = dump.geometry(step)
    if geometry is None:
        raise UsageError(
            f"{train_path}: step {step} was saved without seq_len/batch, so its sequences cannot be "
            "told apart; record it with RouteRecorder or record.save(..., seq_len=, batch=, order=)"
        )
    seq_len, per_rank = geometry
    batch = dump.layout.dp(dump.world_size) * per_rank  # sequences per merged micro-batch
    train = dump.routes(step=step)
    maps = {}
    if args.expert_map_a:
        map_a = expert_map.load(
            args.expert_map_a,
            moe_layers=train.layers,
            num_layers=dump.model.num_layers,
            physical_experts=dump.model.num_experts,
            what=str(train_path),
        )
        side = Ordered(routes=None, source=str(train_path), order="sequence", seq_len=seq_len, batch=batch)
        train = train.map_experts(map_a, where=str(train_path), token_label=_token_label(side))
        maps["a"] = map_a.as_json()
    map_b = None
    if args.expert_map_b:
        map_b = expert_map.load(
            args.expert_map_b,
            moe_layers=train.layers,
            num_layers=dump.model.num_layers,
            physical_experts=None,
            what=str(rollout_path),
        )
        maps["b"] = map_b.as_json()
    spec = RolloutSpec(
        layers=tuple(dump.model.moe_layers),
        num_experts=train.num_experts,
        num_layers=dump.model.num_layers,
        numbering=args.layer_numbering,
        expert_map=map_b,
    )
    aligned = align(
        train, spec, seq_len=seq_len, batch=batch, requests=_rollout_requests(rollout_path), where=str(rollout_path)
    )
    print("token identity unknown: a rollout file carries no token ids; the requests are lined up by position")
    print(
        f"rollout: {aligned.requests} request(s), {aligned.compared} token(s) compared, {aligned.uncaptured} "
        f"training position(s) without a rollout row, {aligned.gaps} capture-gap row(s) set apart"
        + (" (expected: --gaps-expected)" if aligned.gaps and args.gaps_expected else "")
    )
    report = record.diff(
        aligned.train, aligned.rollout, sequence_tokens=aligned.sequence_tokens, sequence_extra=aligned.per_request
    )
    return _report(
        args,
        report,
        {"rollout": aligned.as_json(), "engine": "in-memory", "expert_maps": maps or None},
        gaps=aligned.gaps,
    )


def _one_step(dump, step: int | None, path, flag: str) -> int:
    """The step of ``dump`` a diff compares: the one asked for, or its only step; a dump of several steps needs one
    named (comparing its first alone would pass a divergence in any later step)."""
    if step is not None:
        return step
    steps = sorted(dump.steps)
    if len(steps) != 1:
        raise UsageError(
            f"{path} holds steps {steps}: a diff compares one step; name it with {flag} S (compare each step "
            f"in turn to cover them all)"
        )
    return steps[0]


def _routes_of(path_text: str, step: int, *, order: str | None, args, flag: str):
    """One side of a diff as a layer source (``stream``), in sequence order where its order is known
    (``order.Ordered``, with the sequences where the side knows them)."""
    path = Path(path_text)
    kind = _kind(path_text)
    if kind == "dump":
        if order is not None:
            raise UsageError(f"{flag}: {path} is a dump, which records its own token order; drop {flag}")
        dump = record.load(path)
        step = _one_step(dump, step, path, "--step" if flag == "--order-a" else "--step-b (or --step)")
        source = stream.DumpSource(dump, step)
        source.microbatch_tokens()  # the step exists and its ranks can be merged: checked before any data is read
        geometry = dump.geometry(step)
        if geometry is None:
            return Ordered(
                routes=source,
                source=str(path),
                order=None,
                why_unknown=f"step {step} was saved without seq_len/batch, so its token order is unknown "
                f"(record.save(..., seq_len=, batch=, order=), or convert with --seq-len "
                f"--batch)",
            )
        seq_len, per_rank = geometry
        return Ordered(
            routes=source,
            source=str(path),
            order="sequence",
            seq_len=seq_len,
            batch=dump.layout.dp(dump.world_size) * per_rank,
        )
    if kind == "export":
        if order is not None:
            raise UsageError(f"{flag}: {path} is an export of a dump, which records its own token order; drop {flag}")
        routes, geometry = importers.read_export(path, step=step)
        if geometry is None:
            return Ordered(
                routes=stream.RoutesSource(routes),
                source=str(path),
                order=None,
                why_unknown="its dump's step was saved without seq_len/batch, so its token order is unknown",
            )
        return Ordered(
            routes=stream.RoutesSource(routes),
            source=str(path),
            order="sequence",
            seq_len=geometry[0],
            batch=geometry[1],
        )
    routes = importers.routes_from_arrays(importers.read_arrays(path), where=str(path))
    if order is None:
        return Ordered(
            routes=stream.RoutesSource(routes),
            source=str(path),
            order=None,
            why_unknown=f"an array carries no token order ({flag} sequence|router)",
        )
    given = {}
    if args.seq_len is not None:
        given = {"seq_len": (args.seq_len,) * routes.microbatches, "batch": args.batch}
    return Ordered(
        routes=stream.RoutesSource(
            to_sequence_order(routes, order=order, seq_len=args.seq_len, batch=args.batch, where=str(path))
        ),
        source=str(path),
        order="sequence",
        **given,
    )
