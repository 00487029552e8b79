"""Run the replay check on one scenario without the runner: ``python -m torch.distributed.run
--nproc-per-node N -m moeverify.oracles.replay_main FAMILY/LAYOUT --impl native --json OUT``.

Used by the replay tests and ``tools/replay_matrix.py``; ``moeverify run --check replay`` is the
normal way. Rank 0 writes the record (DESIGN.md Results) to ``--json``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from moeverify.errors import MoEVerifyError


def _parse(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="replay_main", description=__doc__.splitlines()[0])
    ap.add_argument("scenario", metavar="FAMILY/LAYOUT", help="e.g. qwen3_moe/ep2 (layout as in scenario names)")
    ap.add_argument("--impl", default="moeverify", help="moeverify | native | verl | module:factory")
    ap.add_argument("--variants", default=None, help="comma-separated router variants, or 'full'")
    ap.add_argument("--subchecks", default=None, help="comma-separated subset of the replay subchecks")
    ap.add_argument("--recompute", default=None, help="comma-separated recompute modes (full, moe)")
    ap.add_argument("--json", dest="json_path", default=None, help="write the record here (rank 0)")
    ap.add_argument("--notes", default=None, help="write drift/cross-layout agreement notes here (rank 0)")
    return ap.parse_args(argv)


def _split(value: str | None) -> list[str] | None:
    return None if value is None else [v.strip() for v in value.split(",") if v.strip()]


def main(argv: list[str] | None = None) -> int:
    args = _parse(sys.argv[1:] if argv is None else argv)
    from moeverify import runtime
    from moeverify.layout import parse_layout_name
    from moeverify.oracles.context import CheckContext, Scenario
    from moeverify.oracles.replay.oracle import run
    from moeverify.oracles.results import CheckRecord

    family, _, layout_name = args.scenario.partition("/")
    rt = runtime.init("auto")
    layout, _ = parse_layout_name(layout_name)
    world = rt.world_size  # data parallel (and expert-data parallel) follow from the ranks torchrun gave
    layout.validate(world_size=world)
    options = {"replay_impl": args.impl, "replay_notes_path": args.notes}
    if args.variants:
        options["router_variants"] = "full" if args.variants == "full" else _split(args.variants)
    if args.subchecks:
        options["replay_subchecks"] = _split(args.subchecks)
    if args.recompute:
        options["replay_recompute"] = _split(args.recompute)
    scenario = Scenario(family=family, layout=layout, world_size=world, checks=("replay",))
    ctx = CheckContext(scenario=scenario, rank=rt.rank, world_size=rt.world_size, backend=rt.backend,
                       options=options)
    start = time.monotonic()
    try:
        tallies = run(ctx)
        record = CheckRecord.from_tallies(scenario=scenario.name, check="replay",
                                          seconds=time.monotonic() - start, tallies=tallies)
    except MoEVerifyError as e:
        record = CheckRecord.crashed(scenario=scenario.name, check="replay", seconds=time.monotonic() - start,
                                     error=f"{type(e).__name__}: {e}")
    if rt.rank == 0:
        text = json.dumps(record.as_dict(), indent=1)
        if args.json_path:
            with open(args.json_path, "w") as f:
                f.write(text)
        print(text if len(text) < 20000 else text[:20000])
    return 0 if record.passed else 1


if __name__ == "__main__":
    sys.exit(main())
