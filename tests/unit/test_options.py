"""Check options, declared once: docs, flags and scenario validation agree with moeverify.spec.options."""

from pathlib import Path

import pytest

from moeverify import cli
from moeverify.errors import UsageError
from moeverify.spec import options

DOCS = Path(__file__).resolve().parents[2] / "docs" / "scenarios.md"


def test_docs_option_table_is_the_declared_one():
    text = DOCS.read_text()
    start = text.index("-->\n", text.index("<!-- options table")) + 4
    end = text.index("\n<!-- end of options table -->")
    assert text[start:end] == options.markdown_table(), "docs/scenarios.md: regenerate the options table"


def test_every_flagged_option_is_a_run_flag():
    run = next(a for a in cli.build_parser()._subparsers._group_actions[0].choices.values() if a.prog.endswith("run"))
    flags = {s for action in run._actions for s in action.option_strings}
    assert {o.flag for o in options.OPTIONS.values() if o.flag} <= flags


@pytest.mark.parametrize(
    ("key", "value", "match"),
    [
        ("replay_subchecks", [], "non-empty list"),
        ("replay_subchecks", ["drift", 3], "as strings"),
        ("replay_microbatches", True, "whole number"),
        ("replay_seq_len", 2.5, "whole number"),
        ("lockstep_timeout", float("inf"), "finite"),
        ("subject", "", "non-empty string"),
        ("subject", ["bridge"], "non-empty string"),
        (3, 1, "unknown option 3"),
    ],
)
def test_bad_option_values_name_option_and_reason(key, value, match):
    with pytest.raises(UsageError, match=match):
        options.validate("s.yaml:3", key, value)


def test_good_option_values_pass():
    assert options.validate("x", "replay_subchecks", "drift, recompute") == ("drift", "recompute")
    assert options.validate("x", "replay_recompute", ["full"]) == ("full",)
    assert options.validate("x", "router_variants", "full") == "full"
