"""--json/--junit: bad targets refused before the run, files whole at every moment and current after each result."""

import json
import os
import xml.etree.ElementTree as ET

import pytest

from moeverify.errors import UsageError
from moeverify.oracles.results import CheckRecord
from moeverify.runner.outputs import Outputs
from moeverify.runner.report import Result, interrupted


def _passed(name="qwen2/tp1"):
    return Result(
        record=CheckRecord(
            scenario=name,
            check="roundtrip",
            seconds=1.0,
            subchecks={"bitwise": {"passed": True, "checked": 3, "failed": 0, "failures": []}},
        )
    )


def test_outputs_write_an_empty_list_up_front_then_every_update(tmp_path):
    out_json, out_xml = tmp_path / "r.json", tmp_path / "r.xml"
    outputs = Outputs(json_path=str(out_json), junit_path=str(out_xml))
    assert json.loads(out_json.read_text()) == []
    assert ET.parse(out_xml).getroot().get("tests") == "0"
    outputs.write(
        [
            _passed(),
            *interrupted([("qwen2/tp1", "roundtrip"), ("qwen2/pp2", "export")], done={("qwen2/tp1", "roundtrip")}),
        ]
    )
    data = json.loads(out_json.read_text())
    assert [(d["scenario"], d["passed"], d.get("interrupted")) for d in data] == [
        ("qwen2/tp1", True, None),
        ("qwen2/pp2", False, True),
    ]
    root = ET.parse(out_xml).getroot()
    assert root.get("errors") == "1" and root.find(".//error").get("type") == "Interrupted"
    assert sorted(os.listdir(tmp_path)) == ["r.json", "r.xml"]  # no temporary file left behind


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda tmp: str(tmp), "is a directory"),
        (lambda tmp: "/dev/full", "is not a regular file"),
        (lambda tmp: str(tmp / "missing" / "r.json"), "does not exist"),
    ],
)
def test_outputs_refuse_targets_that_cannot_hold_the_results(tmp_path, make, match):
    with pytest.raises(UsageError, match=match):
        Outputs(json_path=make(tmp_path), junit_path=None)


def test_outputs_refuse_the_same_file_twice(tmp_path):
    with pytest.raises(UsageError, match="name the same file"):
        Outputs(json_path=str(tmp_path / "x"), junit_path=str(tmp_path / "." / "x"))
