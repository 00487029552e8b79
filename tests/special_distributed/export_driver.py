"""Runs the export check for several scenarios and subjects inside ONE torchrun (imports paid once).

Usage: torchrun --nproc-per-node N export_driver.py --out OUT.json --scenario qwen3_moe:ep2 ...
       [--subject sharded --subject bridge] [--mutants] [--refresh]
Each scenario is ``family:layout-name`` (``moeverify.spec.layout.parse_layout_name``), or ``path/config.json[+key=value
...]:layout-name`` for a user model (plain subjects only, no mutants); rank 0 writes a JSON
list of ``{"scenario", "subject", "passed", "subchecks"}``. ``--mutants`` adds every mutant of
``moeverify.oracles.export.mutants.MUTANTS`` that applies to the scenario. ``--refresh`` adds the ``refresh``
subcheck (a second export after a weight update) to the named subjects; mutants that must fail ``refresh`` or
``refresh_delta``
always get it, the others never (their subchecks are those of one export).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback


def _args():
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--scenario", action="append", required=True)
    p.add_argument("--subject", action="append", default=[])
    p.add_argument("--mutants", action="store_true")
    p.add_argument("--only-mutant", action="append", default=[])
    p.add_argument("--lockstep-timeout", type=float, default=None)
    p.add_argument("--refresh", action="store_true")
    p.add_argument(
        "--receivers",
        action="store_true",
        help="the receiver controls and mutants on the sharded subject's stream, with a reload, and the "
        "subject mutants the receiver must show",
    )
    return p.parse_args()


def _subjects(args, family, layout, world_size):
    from moeverify.oracles import export

    out = [(name, export.load_subject(name), args.refresh) for name in args.subject]
    if (args.mutants or args.only_mutant) and not family.startswith("model:"):
        from moeverify.models import family_shape, family_traits
        from moeverify.oracles.export import mutants

        traits, shape = family_traits(family), family_shape(family)
        for m in mutants.MUTANTS:
            if args.only_mutant and m.name not in args.only_mutant:
                continue
            if m.applies(traits=traits, shape=shape, layout=layout, world_size=world_size):
                out.append((f"mutant:{m.name}", m.factory, bool({"refresh", "refresh_delta"} & set(m.fails))))
    return out


def main() -> int:
    args = _args()
    from moeverify import models, runtime
    from moeverify.oracles import export
    from moeverify.oracles.export.refresh import run_twice
    from moeverify.spec.layout import parse_layout_name

    rt = runtime.init("cpu")
    records = []
    for spec in args.scenario:
        family, _, layout_name = spec.rpartition(":")
        layout, _dp = parse_layout_name(layout_name)
        if family.endswith(".json") or "+" in family:  # a user model: PATH[+key=value...] (plain subjects only)
            from moeverify.spec.models import user

            path, *sets = family.split("+")
            model = user.read(path, user.parse_sets(sets)).ref
            family = model.key
        else:
            model = models.ModelRef.builtin(family)
        with runtime.parallel(layout):
            built = models.build(model, layout)
            sctx = export.SubjectContext(
                bridge=built.bridge,
                model_chunks=built.model_chunks,
                layout=layout,
                rank=rt.rank,
                world_size=rt.world_size,
                hf_path=built.hf_path,
                built=built,
                timeout_s=120,
            )
            if args.lockstep_timeout:
                sctx.options["lockstep_timeout"] = args.lockstep_timeout
            for name, factory, refresh in _subjects(args, family, layout, rt.world_size):
                t0 = time.time()
                try:
                    tallies = (
                        run_twice(export.run_subject, factory, sctx) if refresh else export.run_subject(factory, sctx)
                    )
                    subchecks = {k: t.as_dict() for k, t in tallies.items()}
                    error = None
                except Exception as exc:  # noqa: BLE001 - reported per scenario
                    subchecks, error = {}, f"rank {rt.rank}: {type(exc).__name__}: {exc}\n{traceback.format_exc()}"
                    print(error, file=sys.stderr, flush=True)
                passed = error is None and all(s["passed"] for s in subchecks.values())
                records.append(
                    {
                        "scenario": f"{family}/{layout.name(rt.world_size)}",
                        "subject": name,
                        "passed": passed,
                        "seconds": round(time.time() - t0, 2),
                        "subchecks": subchecks,
                        "error": error,
                    }
                )
                _report(records, rt.rank)
            if args.receivers:
                _receivers(
                    records,
                    sctx,
                    family=family,
                    layout=layout,
                    world_size=rt.world_size,
                    first=spec == args.scenario[0],
                )
    if rt.rank == 0:
        with open(args.out, "w") as f:
            json.dump(records, f, indent=1)
    return 0


def _report(records, rank):
    if rank == 0:
        r = records[-1]
        bad = [k for k, s in r["subchecks"].items() if not s["passed"]]
        print(
            f"{r['scenario']} {r['subject']}: {'PASS' if r['passed'] else 'FAIL ' + ','.join(bad)} ({r['seconds']}s)",
            flush=True,
        )


def _receivers(records, sctx, *, family, layout, world_size, first=True):
    """The receiver controls and mutants (``receiver_mutants``) on this scenario, each loading the ``sharded``
    subject's stream (the controls and the mutants of subchecks that need a weight sync with one: ``refresh``), and
    the subject mutants the receiver must show (``SUBJECT_MUTANTS``) streamed into the ``fused`` receiver. On the
    first scenario every one that applies; on later ones (a tied model, an MTP model) only the ``fused`` control
    and the mutants that apply there alone (``APPLIES``)."""
    from moeverify.models import family_traits
    from moeverify.oracles.export import load_subject, mutants, run_export
    from moeverify.oracles.export.receiver_mutants import (
        APPLIES,
        CONTROLS,
        MUTANTS,
        NEEDS_SYNC,
        SHOWN_AFTER_A_SYNC,
        SUBJECT_MUTANTS,
    )

    sharded = load_subject("sharded")
    traits = family_traits(family)
    by_name = {m.name: m.factory for m in mutants.MUTANTS}

    def applies(n):
        return APPLIES[n](traits) if n in APPLIES else first

    # the weight update (refresh) only where a subcheck that needs a sync must pass or fail
    named = [(f"receiver:{n}", sharded, f, True) for n, f in CONTROLS.items() if first or n == "fused"]
    named += [
        (f"receiver-mutant:{n}", sharded, f, s in NEEDS_SYNC or n in SHOWN_AFTER_A_SYNC)
        for n, (f, s) in MUTANTS.items()
        if applies(n)
    ]
    named += [
        (f"subject-mutant:{n}", by_name[n], CONTROLS["fused"], s == "receiver_reload")
        for n, s in SUBJECT_MUTANTS.items()
        if first
    ]
    for name, subject, receiver, refresh in named:
        t0 = time.time()
        tallies = run_export(subject, sctx, refresh=refresh, receiver=receiver)
        subchecks = {k: t.as_dict() for k, t in tallies.items()}
        records.append(
            {
                "scenario": f"{family}/{layout.name(world_size)}",
                "subject": name,
                "passed": all(s["passed"] for s in subchecks.values()),
                "seconds": round(time.time() - t0, 2),
                "subchecks": subchecks,
                "error": None,
            }
        )
        _report(records, sctx.rank)


if __name__ == "__main__":
    sys.exit(main())
