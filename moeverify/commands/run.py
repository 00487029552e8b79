"""``moeverify run``: scenario files in, each world-size group in one torchrun, records and tables out.

Options are parsed once, up front (the check options from their one declaration, ``moeverify.spec.checks``);
conflicting or impossible requests are refused before any rank starts, with the fix. The launching and
collecting is ``moeverify.runner``; this module is the command: arguments, scenario selection, preflight, the
run directory and multi-node control.
"""

from __future__ import annotations

import argparse
import signal
import sys
import time
from pathlib import Path

from moeverify import files
from moeverify.commands.common import EXIT_INTERRUPTED, REPO_ROOT, output_path, user_model_ref
from moeverify.errors import UsageError
from moeverify.runner import interrupts, nodes
from moeverify.spec import checks, timeouts
from moeverify.spec import scenario as scenario_mod
from moeverify.spec.models import user
from moeverify.spec.models.ref import ModelRef
from moeverify.spec.options import OPTIONS
from moeverify.spec.options import validate as validate_option

DEFAULT_SCENARIOS = "scenarios/smoke.yaml"
RELEASE_SCENARIOS = "scenarios/release.yaml"
DEFAULT_TIMEOUT_S = timeouts.SCENARIO_S  # public name of timeouts.SCENARIO_S


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds (a number > 0), got {text!r}") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected seconds > 0 (and finite), got {text!r}")
    if value > timeouts.MAX_S:
        raise argparse.ArgumentTypeError(f"expected seconds at most {timeouts.MAX_S:.0f}, got {text!r}")
    return value


class _Switch(argparse.BooleanOptionalAction):
    """``--NAME`` / ``--no-NAME``: giving both is refused (the last one would silently win)."""

    def __call__(self, parser, namespace, values, option_string=None):
        seen = getattr(namespace, "_switches_given", None)
        if seen is None:
            seen = {}
            namespace._switches_given = seen
        earlier = seen.setdefault(self.dest, option_string)
        if earlier != option_string:
            parser.error(f"{earlier} and {option_string} contradict each other; give one of them")
        super().__call__(parser, namespace, values, option_string)


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "run",
        help="run scenario files (torchrun per world size)",
        description="Run the checks of scenario files; exit 0 all passed, 1 any failed, 2 usage error.",
    )
    p.add_argument("files", nargs="*", metavar="FILE", help=f"scenario files (default {DEFAULT_SCENARIOS})")
    p.add_argument("--list", action="store_true", help="print the selected scenarios (name, world size, checks)")
    p.add_argument(
        "--filter",
        action="append",
        default=[],
        metavar="GLOB",
        help="select scenarios by name (fnmatch; repeatable, any match selects)",
    )
    p.add_argument("--check", metavar="NAME", help="run only this check")
    p.add_argument(
        "--model",
        metavar="PATH",
        help="verify this model instead of the files' families: an HF model directory (config.json, "
        "optional safetensors weights) or a config.json; layouts it does not admit are skipped "
        f"with the reason (files default to {RELEASE_SCENARIOS})",
    )
    p.add_argument(
        "--model-set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config.json key of --model (repeatable), e.g. num_hidden_layers=4 to shrink "
        "a production config to a CPU-sized model of the same architecture",
    )
    for option in OPTIONS.values():
        if option.flag and option.meta.switch:  # --NAME / --no-NAME; neither given: the option's default rule
            p.add_argument(option.flag, dest=option.name, action=_Switch, default=None, help=option.help)
        elif option.flag:
            p.add_argument(option.flag, dest=option.name, metavar=option.metavar, help=option.help)
    p.add_argument("--backend", choices=("cpu", "cuda", "auto"), default="auto", help="device backend (default auto)")
    p.add_argument("--json", type=output_path, metavar="PATH", help="write the records as a JSON list")
    p.add_argument(
        "--junit", type=output_path, metavar="PATH", help="write JUnit XML (one testcase per scenario and check)"
    )
    p.add_argument(
        "--timeout",
        type=_positive_float,
        default=DEFAULT_TIMEOUT_S,
        metavar="S",
        help=f"per-scenario deadline on every rank, seconds (default {DEFAULT_TIMEOUT_S:.0f})",
    )
    p.add_argument(
        "--run-dir",
        type=output_path,
        metavar="DIR",
        help="where ranks write plans, logs and stacks (default ./runs/DATE-TIME)",
    )
    p.add_argument(
        "--nnodes",
        metavar="N",
        help="nodes sharing each world-size group (default: NNODES or "
        "SLURM_NNODES, else 1); every node runs the same command",
    )
    p.add_argument(
        "--node-rank", type=int, metavar="R", help="this node (default NODE_RANK or SLURM_NODEID); node 0 reports"
    )
    p.add_argument(
        "--rdzv-endpoint",
        metavar="HOST:PORT",
        help="node 0's address and a free port; the 200 ports "
        "above it are used too (default MASTER_ADDR:MASTER_PORT, or Slurm's first host)",
    )
    p.add_argument("-v", "--verbose", action="store_true", help="show torchrun and rank output")
    p.set_defaults(func=_cmd_run)


def _check_outputs(args) -> None:
    if args.list:
        for flag, value in (("--json", args.json), ("--junit", args.junit), ("--run-dir", args.run_dir)):
            if value:
                raise UsageError(f"--list runs nothing, so {flag} has nothing to do; drop {flag} or drop --list")
    if args.run_dir:
        run_dir = Path(args.run_dir)
        if run_dir.exists() and not run_dir.is_dir():
            raise UsageError(f"--run-dir {args.run_dir}: exists and is not a directory")


def _load(args, node=None):
    from moeverify.runner import select  # lazy: rich (its results table)

    known = checks.check_names()
    if args.check is not None and args.check not in known:
        raise UsageError(f"--check {args.check!r}: unknown check; known checks: {', '.join(known)}")
    options = {o.name: getattr(args, o.name) for o in OPTIONS.values() if o.flag}
    for key, value in options.items():
        if value is not None:
            validate_option(OPTIONS[key].flag_for(value), key, value)
    model = user_model_ref(args)
    fallback = RELEASE_SCENARIOS if model else DEFAULT_SCENARIOS
    default = fallback if Path(fallback).is_file() else str(REPO_ROOT / fallback)
    files = args.files or [default]
    scenarios = scenario_mod.load(
        files, checks=known, model=model, max_world_size=scenario_mod.CPU_MAX_WORLD_SIZE * (node.nnodes if node else 1)
    )
    chosen = select.select(scenarios, filters=args.filter, check=args.check)
    select.check_option_use(chosen, options)
    select.check_plugins(chosen, options)
    return chosen, {k: v for k, v in options.items() if v is not None}


def _gpu_count(backend: str) -> int:
    if backend == "cpu":
        return 0
    import torch  # lazy: torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _terminate_cleanly(signum, frame) -> None:
    """SIGTERM unwinds like Ctrl-C, so a running torchrun group is killed on the way out."""
    raise KeyboardInterrupt


def _cmd_run(args) -> int:
    from moeverify.runner import select  # lazy: rich (its results table)

    _check_outputs(args)
    node = nodes.from_args(args)
    chosen, options = _load(args, node)
    if args.list:
        for ref in dict.fromkeys(s.model for s in chosen if s.model.is_user):
            print(f"# {ref.key}: {user.load(ref).describe()}")
            _preflight_listed(ref)
        for s in chosen:
            extra = f"  (gpu only: {s.gpu_only})" if s.gpu_only else ""
            extra += f"  (not run: {s.unfit})" if s.unfit else ""
            extra += "".join(
                f"  (expected failure: {e.finding} {e.check} {','.join(e.subchecks)})" for e in s.expect_fail
            )
            print(f"{s.name}  {s.world_size}  {','.join(s.checks)}{extra}")
        return 0
    timeouts.check()  # every MOEVERIFY_*_TIMEOUT_S the launcher and the ranks read: refused here, before any rank
    files.check_cache_root()  # MOEVERIFY_CACHE_DIR: where the ranks write seeded checkpoints
    select.probe_plugins(chosen, options)  # a user's subject, receiver or replay implementation, loaded for real
    groups, skipped, notices = select.plan_backends(
        chosen,
        backend=args.backend,
        gpu_count=_gpu_count(args.backend),
        per_node=node.per_node if node else (lambda world: world),
    )
    _preflight_models(groups)
    previous = signal.signal(signal.SIGTERM, _terminate_cleanly)
    try:
        cluster = None
        if node is not None:
            control = _control(args, node, chosen=chosen, groups=groups, options=options)
            if node.node_rank > 0:
                return _follow(args, node, control, groups=groups, options=options)
            from moeverify.runner import launch  # lazy: rich (its results table)

            control.wait_joined()
            cluster = launch.Cluster(node, control)
        code = EXIT_INTERRUPTED
        try:
            code = _execute(args, groups=groups, skipped=skipped, notices=notices, options=options, cluster=cluster)
        finally:
            if cluster is not None:
                cluster.finish(code)
        return code
    finally:
        signal.signal(signal.SIGTERM, previous)


def _preflight_listed(ref: ModelRef) -> None:
    """``--list`` of a user model: what the run's preflight would refuse with this install is refused here too (an
    architecture Megatron-Bridge cannot convert, a config it would build as another model, and without Transformer
    Engine a model its local layer spec cannot rebuild), so a plan that lists is a plan that starts."""
    from moeverify.models import builder  # lazy: torch, megatron
    from moeverify.runtime.bridge_import import real_te_available  # lazy: torch

    te = real_te_available()
    builder.preflight(ref, te_real=te)
    built = "with Transformer Engine's layer spec" if te else "without Transformer Engine (its local layer spec)"
    print(f"# {ref.key}: Megatron-Bridge converts it and builds it {built}")


def _preflight_models(groups) -> None:
    """User models (``--model``, ``model:``) are checked here, before torchrun, for what every rank would
    refuse: an architecture Megatron-Bridge cannot convert, a layer spec the CPU path cannot rebuild."""
    without_te: dict[ModelRef, bool] = {}
    for group in groups:
        for scenario in group.scenarios:
            if scenario.model.is_user:
                without_te[scenario.model] = without_te.get(scenario.model, False) or group.backend == "cpu"
    if not without_te:
        return
    from moeverify.models import builder  # lazy: torch, megatron
    from moeverify.runtime.bridge_import import real_te_available  # lazy: torch

    te_here = real_te_available()
    for ref, on_cpu in without_te.items():
        print(f"checking {ref.key} with Megatron-Bridge before any rank starts ...", flush=True)
        builder.preflight(ref, te_real=te_here and not on_cpu)


def _control(args, node, *, chosen, groups, options):
    """Several nodes: join the control store, with a digest of what this node loaded (all must agree)."""
    scenarios = [
        {k: v for k, v in scenario_mod.scenario_to_dict(s).items() if k != "source"} for s in chosen
    ]  # not where
    loaded = {
        "scenarios": scenarios,
        "options": options,
        "timeout": args.timeout,
        "groups": [(g.world_size, g.backend) for g in groups],
        "nnodes": node.nnodes,
    }
    return nodes.Control(node, loaded=loaded)


def _follow(args, node, control, *, groups, options) -> int:
    """A node other than node 0: run its share of every group node 0 starts; node 0's exit code."""
    from moeverify.runner import launch  # lazy: rich (its results table)

    run_dir = _make_run_dir(args, sub=f"node{node.node_rank}")
    specs = [
        launch.GroupSpec(
            world_size=g.world_size,
            scenarios=g.scenarios,
            backend=g.backend,
            options=options,
            timeout_s=args.timeout,
            run_dir=run_dir,
            verbose=False,
        )
        for g in groups
    ]
    print(
        f"node {node.node_rank} of {node.nnodes}: running its share of every group node 0 starts; results are "
        f"reported on node 0 (its --json/--junit); files in {run_dir}",
        flush=True,
    )
    try:
        code = launch.follow(node, control, specs)
    except nodes.NodeLost as exc:
        print(f"moeverify: node {node.node_rank}: {exc}", file=sys.stderr)
        return 1
    print(f"node {node.node_rank}: node 0 finished with exit code {code}", flush=True)
    return code


def _make_run_dir(args, *, sub: str | None = None) -> Path:
    """The directory of this run's rank files (``sub``: a follower node's own). It must hold no group
    directory (``world*``) of an earlier run: their result files would be read as this run's."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    base = (
        Path(args.run_dir)
        if args.run_dir
        else next(
            p
            for p in (Path("runs") / (stamp if n == 0 else f"{stamp}-{n}") for n in range(1000))
            if not (p / (sub or "")).exists()
        )
    )  # two runs started in the same second get two directories
    run_dir = (base / sub if sub else base).resolve()
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        probe = run_dir / ".moeverify-write-probe"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise UsageError(f"--run-dir {run_dir}: cannot write there ({exc.strerror or exc})") from None
    stale = sorted(p.name for p in run_dir.glob("world*"))
    if stale:
        raise UsageError(
            f"--run-dir {run_dir}: holds {', '.join(stale)} of an earlier run, whose result files "
            "would be read as this run's: give a new or empty directory"
        )
    return run_dir


def _execute(args, *, groups, skipped, notices, options, cluster=None) -> int:
    from rich.console import Console  # lazy: rich
    from rich.text import Text  # lazy: rich

    from moeverify.runner import launch, report  # lazy: rich
    from moeverify.runner.outputs import Outputs  # lazy: rich

    outputs = Outputs(json_path=args.json, junit_path=args.junit)
    run_dir = _make_run_dir(args)
    # Scenario names, paths and messages are the user's text: printed as Text, never read as markup or
    # emoji codes (a model named "m" makes "model:m:", which rich would print as an emoji).
    console = Console(highlight=False, emoji=False)
    for notice in notices:
        console.print(Text.assemble(("note:", "yellow"), f" {notice}"))
    planned = [(s.name, c) for g in groups for s in g.scenarios for c in s.checks]
    marks = report.expect_marks(s for g in groups for s in g.scenarios)  # expect_fail: known findings
    results = list(skipped)
    streamed: list[report.Result] = []  # results as they arrive (the group's list adds peak RSS at its end)

    def progress(result: report.Result) -> None:
        result = report.expect(result, marks)
        streamed.append(result)
        style = {"passed": "green", "failed": "red", "crashed": "bold red"}.get(result.status, "yellow")
        console.print(
            Text.assemble(
                f"[{len(streamed)}/{len(planned)}] ",
                (f"{result.label:7}", style),
                f" {result.record.scenario} {result.record.check} ({result.record.seconds:.1f}s)",
            )
        )
        outputs.write(results + streamed[len(results) - len(skipped) :])

    t0 = time.perf_counter()
    interrupted = False
    try:
        with interrupts.deferred(), console.status("starting") as status:

            def started(scenario, check) -> None:
                status.update(Text(f"running {scenario.name} {check} (world size {scenario.world_size})"))

            for group in groups:
                console.print(
                    Text(
                        f"world size {group.world_size} on {group.backend}: {len(group.scenarios)} "
                        f"scenario(s); files in {run_dir}"
                    )
                )
                status.update(Text(f"starting torchrun with {group.world_size} rank(s)"))
                spec = launch.GroupSpec(
                    world_size=group.world_size,
                    scenarios=group.scenarios,
                    backend=group.backend,
                    options=options,
                    timeout_s=args.timeout,
                    run_dir=run_dir,
                    verbose=args.verbose,
                    cluster=cluster,
                )
                results += [
                    report.expect(r, marks) for r in launch.run_group(spec, on_result=progress, on_start=started)
                ]
    except KeyboardInterrupt:
        interrupted = True
        results += streamed[len(results) - len(skipped) :]
        results += report.interrupted(planned, done={(r.record.scenario, r.record.check) for r in results})
    outputs.write(results)  # files first: a report that cannot be printed must not lose the results
    report.print_report(results, console=console)
    console.print(f"wall time {time.perf_counter() - t0:.1f}s")
    if interrupted:
        console.print(
            Text.assemble(("interrupted", "bold red"), ": the results so far are in the table and the result files")
        )
        return EXIT_INTERRUPTED
    return report.exit_code(results)
