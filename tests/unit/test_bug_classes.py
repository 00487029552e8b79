"""The one declaration of what each subcheck exists for (``moeverify.spec.bug_classes``) against what the oracles emit,
the mutant catalogues, the findings, the tests it names, the docs tables and the result records."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from moeverify.oracles.results import CheckRecord, Tally
from moeverify.spec import bug_classes, expectations

ROOT = Path(__file__).resolve().parents[2]
DOCS = {
    "export": "docs/export.md",
    "replay": "docs/replay_matrix.md",
    "roundtrip": "docs/design.md",
    "hf_parity": "docs/design.md",
}


def _emitted() -> dict[str, tuple[str, ...]]:
    """Every subcheck name each built-in check's oracle can emit, from the oracles' own declarations."""
    from moeverify.oracles import hf_parity, roundtrip
    from moeverify.oracles.export import collect
    from moeverify.spec.checks import REPLAY_SUBCHECKS

    return {
        "export": collect.SUBCHECKS + collect.OPTIONAL_SUBCHECKS,
        "replay": tuple(REPLAY_SUBCHECKS),
        "roundtrip": roundtrip.SUBCHECKS,
        "hf_parity": hf_parity.SUBCHECKS,
    }


def _catalogues() -> dict[str, dict[str, tuple[str, ...]]]:
    """KIND -> NAME -> the subchecks that item is known to fail (empty: existence only)."""
    from moeverify.oracles.export import mutants, receiver_mutants
    from moeverify.oracles.replay import faulty
    from moeverify.spec.checks import REPLAY_IMPLS

    export = {m.name: m.fails for m in mutants.MUTANTS}
    for name, subcheck in receiver_mutants.SUBJECT_MUTANTS.items():
        export[name] = (*export[name], subcheck)
    return {
        "export": export,
        "receiver": {n: (s,) for n, (_, s) in receiver_mutants.MUTANTS.items()},
        "replay": {n: (s, *faulty.ALSO_FAILS.get(n, ())) for n, s in faulty.MUTANTS.items()},
        "impl": dict.fromkeys(REPLAY_IMPLS, ()),
    }


def test_bug_classes_every_emitted_subcheck_of_every_check_is_declared():
    from moeverify.spec.checks import CHECKS

    emitted = _emitted()
    assert set(emitted) == set(CHECKS) == {c.check for c in bug_classes.CLASSES}
    for check, names in emitted.items():
        assert set(bug_classes.subchecks(check)) == set(names) == set(CHECKS[check].declared_subchecks), check
        assert [n for n in names if not bug_classes.guards(check, n)] == [], check
        assert set(expectations.subcheck_names(check)) == set(names), check  # what expect_fail may name


def test_bug_classes_name_only_mutants_that_exist_and_that_fail_the_subcheck():
    catalogues = _catalogues()
    for c in bug_classes.CLASSES:
        for item in c.caught_by:
            kind, _, name = item.partition(":")
            if kind in catalogues:
                assert name in catalogues[kind], f"{c.check}.{c.subcheck}: no {kind} mutant {name!r}"
                fails = catalogues[kind][name]
                if kind == "replay" and name in ("wrong_microbatch", "layer_shift"):
                    continue  # also shown failing drift / cross_layout / native_parity (test_replay_oracle.py)
                if fails:
                    assert c.subcheck in fails, f"{c.check}.{c.subcheck}: {item} fails {fails}, not this subcheck"


def test_bug_classes_declare_every_mutant_against_each_subcheck_it_fails():
    declared = {(c.subcheck, item) for c in bug_classes.CLASSES for item in c.caught_by}
    for kind, catalogue in _catalogues().items():
        for name, fails in catalogue.items():
            for subcheck in fails:
                assert (subcheck, f"{kind}:{name}") in declared, f"{kind} mutant {name} fails {subcheck}, undeclared"


def test_bug_classes_findings_and_tests_named_exist():
    findings = (ROOT / "docs" / "findings.md").read_text()
    for c in bug_classes.CLASSES:
        for item in c.caught_by:
            kind, _, name = item.partition(":")
            if kind == "finding":
                assert re.search(rf"\({name}\)", findings), (
                    f"{c.check}.{c.subcheck}: finding {name} not in docs/findings.md"
                )
            elif kind == "test":
                path, _, func = name.partition("::")
                tree = ast.parse((ROOT / path).read_text())
                assert func in {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}, item


@pytest.mark.parametrize("check", sorted(DOCS))
def test_bug_classes_docs_table_is_the_declaration(check):
    text = (ROOT / DOCS[check]).read_text()
    assert bug_classes.with_table(text, check) == text, (
        f"{DOCS[check]}: the bug-class table of {check} differs from moeverify/spec/bug_classes.py; regenerate with "
        f"bug_classes.with_table"
    )


def test_bug_classes_upstream_examples_cite_a_thread_or_a_finding():
    for c in bug_classes.CLASSES:
        assert re.search(r"[\w.-]+/[\w.-]+#\d+|\bF\d+\b|this project", c.upstream) or c.subcheck == "lockstep", c


def test_bug_classes_minimal_mutant_is_one_the_subcheck_is_shown_to_fail():
    """A row's minimal mutant is one of its ``caught_by`` (so the catalogue and faulty-impl tests that prove those
    prove it), says what it changes, and comes with the smallest difference the subcheck cannot see."""
    for c in bug_classes.CLASSES:
        if c.minimal:
            assert c.minimal_item in c.caught_by and len(c.minimal_change) > 20, c
            assert len(c.blind_to) > 40, c
    with pytest.raises(ValueError, match="does not start with one of caught_by"):
        bug_classes.BugClass(
            check="export",
            subcheck="x",
            guards="g",
            upstream="u",
            caught_by=("export:a",),
            minimal="export:b: one element",
            blind_to="nothing",
        )
    with pytest.raises(ValueError, match="given together"):
        bug_classes.BugClass(
            check="export",
            subcheck="x",
            guards="g",
            upstream="u",
            caught_by=("export:a",),
            minimal="export:a: one element",
        )


def test_bug_classes_every_subcheck_declares_its_sensitivity():
    """Issue #37: every subcheck of every built-in check names the minimal mutant it is shown to catch and the
    smallest difference it cannot see."""
    assert [f"{c.check}.{c.subcheck}" for c in bug_classes.CLASSES if not (c.minimal and c.blind_to)] == []


def test_bug_classes_refuse_a_malformed_entry():
    with pytest.raises(ValueError, match="caught_by entry 'flipped_bit' is not KIND:NAME"):
        bug_classes.BugClass(check="export", subcheck="x", guards="g", upstream="u", caught_by=("flipped_bit",))
    with pytest.raises(ValueError, match="must all be given"):
        bug_classes.BugClass(check="export", subcheck="x", guards="", upstream="u", caught_by=("export:a",))
    with pytest.raises(ValueError, match="lacks one"):
        bug_classes.with_table("no markers here", "export")


def test_records_name_the_class_of_every_subcheck_and_what_did_not_run():
    ok = Tally()
    ok.ok(3)
    record = CheckRecord.from_tallies(
        scenario="s", check="export", seconds=1.0, tallies={"bitwise": ok, "lockstep": ok}
    )
    data = record.as_dict()
    assert data["subchecks"]["bitwise"]["guards"] == bug_classes.guards("export", "bitwise")
    assert set(data["not_run"]) == set(bug_classes.subchecks("export")) - {"bitwise", "lockstep"}
    assert data["not_run"]["refresh"] == bug_classes.guards("export", "refresh")
    assert CheckRecord.from_dict(data).as_dict() == data
    extra = CheckRecord.from_tallies(scenario="s", check="my_check", seconds=1.0, tallies={"x": ok}).as_dict()
    assert "guards" not in extra["subchecks"]["x"] and "not_run" not in extra
    crashed = CheckRecord.crashed(scenario="s", check="export", seconds=1.0, error="boom").as_dict()
    assert "not_run" not in crashed
