"""Checks declared once (moeverify.spec.checks): each CheckSpec's options dataclass is what the flat option table, the
flags, the scenario rule and the checks' own defaults read."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from waiting import CHILD_S

from moeverify import cli
from moeverify.errors import UsageError
from moeverify.spec import checks, options
from moeverify.spec.layout import Layout
from moeverify.spec.router_variants import VARIANTS


def _run_parser():
    return next(a for a in cli.build_parser()._subparsers._group_actions[0].choices.values() if a.prog.endswith("run"))


def test_checks_every_entry_point_loads_a_function():
    loaded = {name: spec.load() for name, spec in checks.CHECKS.items()}
    assert sorted(loaded) == ["export", "hf_parity", "replay", "roundtrip"]
    assert {name: (fn.__module__, fn.__name__) for name, fn in loaded.items()} == {
        "roundtrip": ("moeverify.oracles.roundtrip", "run"),
        "export": ("moeverify.oracles.export.oracle", "run"),
        "replay": ("moeverify.oracles.replay.oracle", "run"),
        "hf_parity": ("moeverify.oracles.hf_parity", "run"),
    }


def test_checks_resolve_unknown_names_the_known_checks():
    with pytest.raises(UsageError, match=r"unknown check 'nope'; known checks: roundtrip, export, replay, hf_parity"):
        checks.resolve("nope")


def test_checks_option_table_is_every_declared_field():
    declared = {
        meta.key: (name, field.default)
        for name, spec in checks.CHECKS.items()
        for field, meta in spec.options.declared()
    }
    assert {k: o.check for k, o in options.OPTIONS.items()} == {k: check for k, (check, _) in declared.items()}
    assert len(declared) == 14


def test_checks_option_declared_by_two_checks_refused():
    @dataclasses.dataclass(frozen=True, kw_only=True)
    class Clash(checks.CheckOptions):
        seq: int = checks.option(16, key="replay_seq_len", validate=int, help="tokens")

    specs = {**checks.CHECKS, "clash": checks.CheckSpec(name="clash", entry="m:f", options=Clash)}
    with pytest.raises(AssertionError, match="option replay_seq_len is declared by replay and clash"):
        options._table(specs)


def test_checks_typed_defaults_are_what_the_checks_use():
    assert checks.ExportOptions.from_options({}) == checks.ExportOptions(
        subject="sharded", lockstep_timeout=None, refresh=None, receiver=None
    )
    replay = checks.ReplayOptions.from_options({})
    assert (replay.impl, replay.variants, replay.seq_len, replay.batch) == ("moeverify", (VARIANTS["default"],), 16, 2)
    assert replay.subchecks == checks.CHECKS["replay"].subchecks and replay.recompute == ("full", "moe")


def test_checks_from_options_reads_its_own_keys_converted_and_none_as_unset():
    merged = {
        "subject": "bridge",
        "replay_seq_len": 8,
        "router_variants": "full",
        "replay_impl": None,
        "replay_subchecks": "drift, recompute",
    }
    assert checks.ExportOptions.from_options(merged).subject == "bridge"
    replay = checks.ReplayOptions.from_options(merged)
    assert (replay.seq_len, replay.impl, replay.subchecks) == (8, "moeverify", ("drift", "recompute"))
    assert replay.variants == tuple(VARIANTS.values())


@pytest.mark.parametrize(
    ("raw", "match"),
    [
        ({"refresh": "yes"}, r"^export check options: option refresh: expected true, false or auto, got 'yes'$"),
        (
            {"lockstep_timeout": 0},
            r"^export check options: option lockstep_timeout: expected a finite number of "
            r"seconds > 0, got 0$",
        ),
        ({"subject": "nocolon"}, r"^export check options: option subject: subject 'nocolon' is not bridge, sharded"),
    ],
)
def test_checks_from_options_validates_again_naming_where(raw, match):
    with pytest.raises(UsageError, match=match):
        checks.ExportOptions.from_options(raw, where="export check options")


USER = "my_pkg.export:factory"
USER_FILE = f"{Path(__file__).resolve().parents[1] / 'special_distributed' / 'stale_subject.py'}:stale"


@pytest.mark.parametrize(
    ("options_", "on", "why"),
    [
        ({"subject": USER}, True, "default for a user's subject (my_pkg.export:factory); --no-refresh"),
        ({"subject": USER_FILE}, True, f"default for a user's subject ({USER_FILE})"),
        ({"subject": "sharded", "receiver": "fused"}, True, "default with a receiver (fused)"),
        ({"receiver": "my_pkg.engine:receiver"}, True, "default with a receiver (my_pkg.engine:receiver)"),
        ({}, False, "default for the built-in subject sharded without a receiver; --refresh"),
        ({"subject": "gather"}, False, "default for the built-in subject gather"),
        ({"subject": "verl", "refresh": "auto"}, False, "default for the built-in subject verl"),
        ({"subject": USER, "refresh": "auto"}, True, "default for a user's subject"),
        ({"subject": USER, "refresh": False}, False, "turned off (--no-refresh or refresh: false)"),
        ({"subject": USER, "receiver": "fused", "refresh": False}, False, "turned off"),
        ({"subject": "bridge", "refresh": True}, True, "asked (--refresh or refresh: true)"),
    ],
)
def test_checks_export_refresh_resolves_by_subject_receiver_and_request(options_, on, why):
    opts = checks.ExportOptions.from_options(options_)
    assert opts.refresh_on is on
    assert opts.refresh_why.startswith(why)
    assert opts.decisions() == {"refresh": {"on": on, "why": opts.refresh_why}}


@pytest.mark.parametrize(
    ("scenario", "argv", "on"),
    [
        ({}, [], False),  # built-in subject alone
        ({}, ["--subject", USER], True),  # a user's subject: on with no option
        ({}, ["--subject", USER, "--no-refresh"], False),  # the flag turns it off
        ({}, ["--refresh"], True),  # and on for a built-in
        ({"refresh": True}, ["--no-refresh"], False),  # a flag overrides the scenario's key, both ways
        ({"subject": USER, "refresh": False}, ["--refresh"], True),
        ({"subject": USER, "refresh": False}, [], False),  # the scenario key alone
        ({"refresh": True}, [], True),
        ({"receiver": "fused"}, [], True),
    ],
)
def test_checks_export_refresh_flags_and_scenario_keys(scenario, argv, on):
    args = _run_parser().parse_args(argv)
    flags = {o.name: getattr(args, o.name) for o in options.OPTIONS.values() if o.flag}
    merged = {**scenario, **{k: v for k, v in flags.items() if v is not None}}  # as the worker merges them
    assert checks.ExportOptions.from_options(merged).refresh_on is on


def test_checks_export_refresh_flag_names_itself_in_messages():
    refresh = options.OPTIONS["refresh"]
    assert (refresh.flag_for(True), refresh.flag_for(False)) == ("--refresh", "--no-refresh")
    assert options.OPTIONS["subject"].flag_for("x") == "--subject"
    assert options.OPTIONS["replay_seq_len"].flag_for(3) == "replay_seq_len"
    assert (
        options.validate("x", "refresh", "auto") == "auto"
        and checks.ExportOptions.from_options({"refresh": "auto"}).refresh is None
    )


def test_checks_replay_scenario_rule_reads_the_declared_seq_len():
    replay = checks.CHECKS["replay"]
    assert replay.refusal({}, Layout(cp=2), world_size=2) is None  # 16 % 4
    assert replay.refusal({"replay_seq_len": 12}, Layout(cp=3), world_size=3) is None
    assert replay.refusal({}, Layout(cp=3), world_size=3) == (
        "the replay check's sequence of 16 tokens is not divisible by 2 * cp = 6 (context parallelism splits each "
        "sequence in 2 * cp chunks); set options: {replay_seq_len: N} with N a multiple of it"
    )
    assert checks.CHECKS["export"].refusal({}, Layout(cp=3), world_size=3) is None


def test_checks_without_options_read_none():
    spec = checks.CheckSpec(name="tiny", entry="m:f")
    assert spec.options.from_options({"subject": "bridge"}) == checks.NoOptions()
    assert spec.refusal({"replay_seq_len": 3}, Layout(cp=2), world_size=2) is None


@pytest.mark.parametrize(
    ("layout", "world_size", "match"),
    [
        (
            Layout(),
            2,
            r"^hf_parity runs on one rank with the default layout .*not at world_size 2: put hf_parity in a "
            r"world_size 1 scenario",
        ),
        (Layout(ep=2), 2, r"not at world_size 2, layout ep2-dp2: put hf_parity"),
        (Layout(tp=2), 4, r"not at world_size 4, layout tp2-dp2"),
    ],
)
def test_checks_hf_parity_is_refused_at_load_off_one_rank(layout, world_size, match):
    import re

    refusal = checks.CHECKS["hf_parity"].refusal({}, layout, world_size=world_size)
    assert refusal is not None and re.search(match, refusal), refusal
    assert checks.CHECKS["hf_parity"].refusal({}, Layout(), world_size=1) is None


def test_checks_run_flags_and_help_come_from_the_declaration():
    actions = {a.dest: a for a in _run_parser()._actions}
    flagged = {k: o for k, o in options.OPTIONS.items() if o.flag}
    assert sorted(flagged) == ["receiver", "refresh", "replay_impl", "subject"]
    for key, option in flagged.items():
        if option.meta.switch:
            assert actions[key].option_strings == ["--refresh", "--no-refresh"] == list(option.flags)
            continue
        assert (actions[key].option_strings, actions[key].metavar) == ([option.flag], option.metavar)
    assert actions["replay_impl"].help.endswith("(default moeverify)")
    assert actions["subject"].help.endswith("path/file.py:factory (default sharded)")


@pytest.mark.timing
def test_checks_declarations_import_no_torch(repo_root):
    code = textwrap.dedent("""
        import sys

        class _Refuse:
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in ("torch", "megatron", "transformers", "safetensors"):
                    raise ImportError(f"blocked import of {name}")

        sys.meta_path.insert(0, _Refuse())
        from moeverify.spec import checks, options
        from moeverify.spec.layout import Layout
        opts = checks.ReplayOptions.from_options({"router_variants": "full", "replay_seq_len": 8})
        refusal = checks.CHECKS["replay"].refusal({}, Layout(cp=3), world_size=3)
        print(len(opts.variants), len(options.OPTIONS), refusal[:40])
    """)
    proc = subprocess.run([sys.executable, "-c", code], cwd=repo_root, capture_output=True, text=True, timeout=CHILD_S)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split()[:2] == [str(len(VARIANTS)), "14"], proc.stdout
    assert "the replay check's sequence of 16 tokens" in proc.stdout


def test_checks_export_docs_table_lists_the_declared_subchecks(repo_root):
    text = (repo_root / "docs" / "export.md").read_text()
    table = text[text.index("| subcheck | checks | counts |") : text.index("\n\n", text.index("| subcheck | checks |"))]
    rows = [line.split("|")[1].strip() for line in table.splitlines()[2:]]
    always = tuple(r.strip("`") for r in rows if "(option)" not in r)
    assert always == checks.CHECKS["export"].subchecks


def test_checks_selected_subchecks_follow_the_declared_option():
    replay, export = checks.CHECKS["replay"], checks.CHECKS["export"]
    assert replay.selected_subchecks({}) == (replay.subchecks, None)
    assert replay.selected_subchecks({"replay_subchecks": ("weights", "drift")}) == (
        ("drift", "weights"),
        "replay_subchecks",
    )
    assert export.selected_subchecks({"replay_subchecks": ("drift",)}) == (export.declared_subchecks, None)
    assert export.declared_subchecks == export.subchecks + (
        "refresh",
        "receiver",
        "receiver_reload",
        "refresh_delta",
        "receiver_ranks",
        "receiver_repeat",
        "receiver_wake",
        "receiver_copies",
    )


def test_replay_subchecks_in_layout_leaves_out_every_whole_model_build():
    """``replay_subchecks: in_layout`` runs exactly the declared subchecks that never build the whole model on one
    rank; each left out says why; a misspelling names the shorthand too."""
    from moeverify.spec.checks import REPLAY_IN_LAYOUT, REPLAY_SUBCHECKS, REPLAY_WHOLE_MODEL, ReplayOptions

    assert set(REPLAY_WHOLE_MODEL) <= set(REPLAY_SUBCHECKS) and all(REPLAY_WHOLE_MODEL.values())
    got = ReplayOptions.from_options({"replay_subchecks": "in_layout"}).subchecks
    assert got == REPLAY_IN_LAYOUT == ("equivalence", "drift", "recompute", "native_parity", "weights")
    assert set(got) | set(REPLAY_WHOLE_MODEL) == set(REPLAY_SUBCHECKS)
    with pytest.raises(UsageError, match="or 'in_layout' for equivalence"):
        ReplayOptions.from_options({"replay_subchecks": "in_layouts"})


def test_replay_dtype_is_fp32_or_bf16():
    from moeverify.spec.checks import ReplayOptions

    assert ReplayOptions.from_options({}).dtype == "fp32"
    assert ReplayOptions.from_options({"replay_dtype": "bf16"}).dtype == "bf16"
    with pytest.raises(UsageError, match="replay_dtype: expected one of fp32, bf16, got 'fp16'"):
        ReplayOptions.from_options({"replay_dtype": "fp16"})
