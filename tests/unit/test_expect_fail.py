"""expect_fail: known findings marked in scenario files; parsing, verdicts, exit codes, table, JSON and JUnit."""

from __future__ import annotations

import io
import json
import textwrap
import xml.etree.ElementTree as ET

import pytest
from rich.console import Console

from moeverify.errors import UsageError
from moeverify.models import families as model_families
from moeverify.oracles.results import CheckRecord, Tally
from moeverify.runner import junit, report
from moeverify.runner.report import Result
from moeverify.spec import expectations
from moeverify.spec.expectations import ExpectedFailure
from moeverify.spec.scenario import load, scenario_from_dict, scenario_to_dict

CHECKS = ("roundtrip", "export", "replay", "hf_parity")
FAMILIES = {name: model_families.family_shape(name) for name in model_families.FAMILIES}
F3 = ExpectedFailure(finding="F3", check="hf_parity", subchecks=("layers", "logits"), reason="sigmoid routing")


def _load(tmp_path, text: str, **kwargs):
    path = tmp_path / "s.yaml"
    path.write_text(textwrap.dedent(text))
    return load([str(path)], checks=CHECKS, families=FAMILIES, **kwargs)


# ------------------------------------------------------------------------------------------------ parsing
def test_expect_fail_scenario_and_matrix_entries_are_read(tmp_path):
    scenarios = _load(
        tmp_path,
        """
        scenarios:
          - {family: ernie45_moe, world_size: 1, checks: [roundtrip, hf_parity],
             expect_fail: [{finding: F3, check: hf_parity, subchecks: [layers, logits], reason: sigmoid routing}]}
        matrix:
          - families: [olmoe]
            world_size: 2
            layouts: [{tp: 2, sp: true}]
            checks: [roundtrip]
            moe_checks: [replay]
            expect_fail: [{finding: F5, check: replay, subchecks: [equivalence]}]
    """,
    )
    assert scenarios[0].expect_fail == (F3,)
    assert scenarios[1].expect_fail == (ExpectedFailure(finding="F5", check="replay", subchecks=("equivalence",)),)
    assert scenario_from_dict(scenario_to_dict(scenarios[0])) == scenarios[0]


@pytest.mark.parametrize(
    "entry, message",
    [
        (
            "{finding: F3, check: hf_parity, subchecks: [layer]}",
            r"s.yaml:3: scenario ernie45_moe/tp1: expect_fail \(F3\): unknown hf_parity subcheck\(s\) \['layer'\]; "
            r"known: layers, logits",
        ),
        (
            "{finding: F3, check: export, subchecks: [bitwise]}",
            r"expect_fail \(F3\): check 'export' is not run by this scenario \(its checks: roundtrip, hf_parity\)",
        ),
        ("{finding: F3, check: hf_parity}", r"expect_fail entry: missing \['subchecks'\]"),
        ("{finding: F3, check: hf_parity, subchecks: [layers], why: x}", r"unknown key\(s\) \['why'\]"),
        ("{finding: three, check: hf_parity, subchecks: [layers]}", r"finding must be a findings-table id such as F3"),
        ("{finding: F3, check: hf_parity, subchecks: []}", r"subchecks must be a non-empty list of hf_parity's"),
        ("{finding: F3, check: hf_parity, subchecks: [layers, layers]}", r"listed twice"),
    ],
)
def test_expect_fail_bad_entries_are_refused_at_load(tmp_path, entry, message):
    with pytest.raises(UsageError, match=message):
        _load(
            tmp_path,
            f"""
            scenarios:
              - {{family: ernie45_moe, world_size: 1, checks: [roundtrip, hf_parity], expect_fail: [{entry}]}}
        """,
        )


def test_expect_fail_replay_subcheck_not_run_is_refused(tmp_path):
    with pytest.raises(
        UsageError,
        match=r"unknown replay subcheck\(s\) \['drift'\] \(or not run: replay_subchecks\); "
        r"known: equivalence$",
    ):
        _load(
            tmp_path,
            """
            scenarios:
              - {family: qwen3_moe, world_size: 1, checks: [replay], options: {replay_subchecks: [equivalence]},
                 expect_fail: [{finding: F9, check: replay, subchecks: [drift]}]}
        """,
        )


def test_expect_fail_not_a_default_and_not_applied_under_model(tmp_path):
    with pytest.raises(UsageError, match=r"unknown defaults key\(s\) \['expect_fail'\]"):
        _load(
            tmp_path,
            """
            defaults: {expect_fail: [{finding: F3, check: hf_parity, subchecks: [layers]}]}
            scenarios: [{family: qwen2, world_size: 1, checks: [hf_parity]}]
        """,
        )
    (s,) = _load(
        tmp_path,
        """
        scenarios:
          - {family: ernie45_moe, world_size: 1, checks: [hf_parity],
             expect_fail: [{finding: F3, check: hf_parity, subchecks: [layers]}]}
    """,
        model="qwen3_moe",
    )
    assert s.expect_fail == (), "a file's findings are about its own families, not the --model put in their place"


def test_declared_subchecks_are_the_checks_own(repo_root):
    from moeverify.oracles import hf_parity
    from moeverify.spec import checks

    declared = {name: expectations.subcheck_names(name) for name in checks.CHECKS}
    assert None not in declared.values(), f"every built-in check declares its subchecks: {declared}"
    assert declared["hf_parity"] == hf_parity.SUBCHECKS == ("layers", "logits")
    assert expectations.subcheck_names("no_such_check") is None
    assert "key_set" in expectations.subcheck_names("export") and "bitwise" in expectations.subcheck_names("roundtrip")


def test_gpu_scenarios_mark_f3_on_ernie_only(repo_root):
    scenarios = load([str(repo_root / "scenarios" / "gpu.yaml")], checks=CHECKS)
    marked = {s.name: s.expect_fail for s in scenarios if s.expect_fail}
    assert marked == {
        "ernie45_moe/tp1": (
            ExpectedFailure(
                finding="F3",
                check="hf_parity",
                subchecks=("layers", "logits"),
                reason=marked["ernie45_moe/tp1"][0].reason,
            ),
        )
    }


# ------------------------------------------------------------------------------------------------ verdicts
def _record(*, failing=(), passing=("layers", "logits"), error=None, check="hf_parity") -> CheckRecord:
    tallies = {}
    for name in passing:
        tallies[name] = Tally()
        tallies[name].ok()
    for name in failing:
        tallies[name] = Tally()
        tallies[name].fail(f"{name} differs")
    if error is not None:
        return CheckRecord.crashed(scenario="ernie45_moe/tp1", check=check, seconds=1.0, error=error)
    return CheckRecord.from_tallies(scenario="ernie45_moe/tp1", check=check, seconds=1.0, tallies=tallies)


MARKS = {("ernie45_moe/tp1", "hf_parity"): F3}


def _judged(record: CheckRecord) -> Result:
    return report.expect(Result(record=record), MARKS)


def test_expected_failure_failing_as_marked_is_no_regression():
    result = _judged(_record(failing=("layers", "logits"), passing=()))
    assert result.status == "xfailed" and result.label == "expected failure (F3)"
    assert report.exit_code([result]) == 0
    entry = result.as_dict()
    assert entry["passed"] is False and entry["expected_failure"]["status"] == "expected failure (F3)"
    assert entry["expected_failure"]["subchecks"] == ["layers", "logits"]


def test_expected_failure_now_passing_is_flagged():
    result = _judged(_record())
    assert result.status == "xpassed" and report.exit_code([result]) == 1
    assert report.failing_lines(result)[0].startswith("expected failure now passes: F3 hf_parity layers, logits")
    half = _judged(_record(failing=("layers",), passing=("logits",)))
    assert half.status == "xpassed" and report.exit_code([half]) == 1
    assert "now passes: F3 hf_parity logits (layers still fails)" in report.failing_lines(half)[0]


def test_expected_failure_with_another_failure_or_a_crash_is_a_regression():
    other = _judged(_record(failing=("layers", "logits"), passing=()))
    other = report.expect(
        Result(
            record=CheckRecord.from_tallies(
                scenario="ernie45_moe/tp1",
                check="hf_parity",
                seconds=1.0,
                tallies={**{n: _failed_tally() for n in ("layers", "logits", "extra")}},
            )
        ),
        MARKS,
    )
    assert other.status == "failed" and report.exit_code([other]) == 1
    assert "extra failed too: not explained by F3" in report.failing_lines(other)[0]
    crashed = _judged(_record(error="rank 0 raised RuntimeError: boom"))
    assert crashed.status == "crashed" and report.exit_code([crashed]) == 1
    assert crashed.as_dict()["expected_failure"]["outcome"] == "failed otherwise"


def _failed_tally() -> Tally:
    t = Tally()
    t.fail("x")
    return t


def test_unmarked_checks_are_judged_as_before():
    plain = report.expect(Result(record=_record(failing=("layers",), passing=("logits",), check="roundtrip")), MARKS)
    assert plain.verdict is None and plain.status == "failed" and "expected_failure" not in plain.as_dict()
    assert report.exit_code([_judged(_record(failing=("layers", "logits"), passing=())), plain]) == 1


def test_table_json_and_junit_name_the_finding():
    results = [_judged(_record(failing=("layers", "logits"), passing=())), _judged(_record())]
    out = io.StringIO()
    report.print_report(results, console=Console(file=out, width=250, color_system=None))
    text = out.getvalue()
    assert "expected failure (F3)" in text and "expected failure now passes: F3" in text
    assert "1 expected failure(s), 1 expected failure(s) now passing" in text
    assert json.loads(report.to_json(results))[0]["expected_failure"]["finding"] == "F3"
    root = ET.fromstring(junit.to_bytes(results))
    assert (root.get("skipped"), root.get("failures")) == ("1", "1")
    cases = root.findall(".//testcase")
    assert cases[0].find("skipped").get("message").startswith("expected failure: F3 hf_parity layers, logits")
    assert cases[1].find("failure").get("type") == "ExpectedFailureNowPasses"


def test_report_prints_user_text_verbatim_never_as_markup_or_emoji():
    crashed = Result(
        record=CheckRecord.crashed(
            scenario="model:m:/tp1", check="roundtrip", seconds=0.1, error="[bold]model:m: :smile: [/__w/x]"
        )
    )
    out = io.StringIO()
    report.print_report([crashed], console=Console(file=out, width=250, color_system=None))
    text = out.getvalue()
    assert "model:m:/tp1" in text and "[bold]model:m: :smile: [/__w/x]" in text
    assert (
        "\N{CIRCLED LATIN CAPITAL LETTER M}" not in text
        and "\N{SMILING FACE WITH OPEN MOUTH AND SMILING EYES}" not in text
    )


# ------------------------------------------------------------------------------------------ moeverify run
@pytest.fixture
def fake_group(monkeypatch):
    """``launch.run_group`` replaced by one that reports each check as ``outcome[check]`` says (no torchrun)."""
    from moeverify.runner import launch

    outcome: dict[str, tuple[str, ...]] = {}

    def run_group(spec, *, on_result, on_start=None):
        out = []
        for scenario in spec.scenarios:
            for check in scenario.checks:
                failing = outcome.get(check, ())
                tallies = {name: (_failed_tally() if name in failing else Tally()) for name in ("layers", "logits")}
                for tally in tallies.values():
                    tally.checked = max(tally.checked, 1)
                result = Result(
                    record=CheckRecord.from_tallies(scenario=scenario.name, check=check, seconds=0.1, tallies=tallies)
                )
                on_result(result)
                out.append(result)
        return out

    monkeypatch.setattr(launch, "run_group", run_group)
    return outcome


def test_run_exit_code_means_something_changed(tmp_path, capsys, fake_group, monkeypatch):
    from moeverify import cli

    monkeypatch.setenv("COLUMNS", "250")  # the table's lines unwrapped

    path = tmp_path / "s.yaml"
    path.write_text(
        textwrap.dedent("""
        scenarios:
          - {family: ernie45_moe, world_size: 1, checks: [roundtrip, hf_parity],
             expect_fail: [{finding: F3, check: hf_parity, subchecks: [layers, logits]}]}
    """)
    )

    def run(name: str) -> tuple[int, str, list]:
        out = tmp_path / f"{name}.json"
        code = cli.main(["run", str(path), "--backend", "cpu", "--json", str(out), "--run-dir", str(tmp_path / name)])
        return code, capsys.readouterr().out, json.loads(out.read_text())

    fake_group["hf_parity"] = ("layers", "logits")  # the finding as it is
    code, out, records = run("known")
    assert code == 0 and "expected failure (F3)" in out, out
    assert records[1]["expected_failure"]["status"] == "expected failure (F3)" and records[1]["passed"] is False
    fake_group["hf_parity"] = ()  # fixed upstream
    code, out, _ = run("fixed")
    assert code == 1 and "expected failure now passes: F3 hf_parity layers, logits" in out, out
    fake_group["roundtrip"] = ("layers",)  # a regression beside the known finding
    fake_group["hf_parity"] = ("layers", "logits")
    code, out, _ = run("regressed")
    assert code == 1 and "expected failure (F3)" in out, out


def test_run_progress_prints_user_model_names_verbatim(tmp_path, capsys, fake_group, monkeypatch):
    """Names and paths are printed as given: rich must read neither ``:m:`` as an emoji nor ``[b]`` as markup."""
    import transformers

    from moeverify import cli
    from moeverify.commands import run as run_cmd

    monkeypatch.setattr(run_cmd, "_preflight_models", lambda groups: None)  # no bridge here: the output is tested
    config = transformers.Qwen3MoeConfig(num_hidden_layers=2, num_experts=4, num_experts_per_tok=2)
    config.architectures = ["Qwen3MoeForCausalLM"]
    config.save_pretrained(tmp_path / "m")
    scenarios = tmp_path / "s.yaml"
    scenarios.write_text("scenarios:\n  - {family: qwen3_moe, world_size: 1, checks: [roundtrip]}\n")
    monkeypatch.setenv("COLUMNS", "250")
    code = cli.main(
        [
            "run",
            str(scenarios),
            "--model",
            str(tmp_path / "m"),
            "--backend",
            "cpu",
            "--run-dir",
            str(tmp_path / "runs:m:[b]"),
        ]
    )
    out = capsys.readouterr().out
    assert code == 0 and "model:m/tp1 roundtrip" in out and "runs:m:[b]" in out, out
    assert "\N{CIRCLED LATIN CAPITAL LETTER M}" not in out
