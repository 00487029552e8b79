"""bench/memory.py's layouts: names read by moeverify.spec.layout's parser, world sizes, per-rank peaks and fits."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from moeverify.errors import LayoutError


@pytest.fixture(scope="module")
def memory():
    path = Path(__file__).resolve().parents[2] / "bench" / "memory.py"
    spec = importlib.util.spec_from_file_location("bench_memory", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    "name, expected",
    [
        ("tp1", ("tp1", {}, 1)),
        ("ep2", ("ep2-dp2", {"ep": 2}, 2)),  # the least world size EP2 admits: the canonical name says dp2
        ("ep2-dp2", ("ep2-dp2", {"ep": 2}, 2)),
        ("pp2", ("pp2", {"pp": 2}, 2)),
        ("pp2-dp2", ("pp2-dp2", {"pp": 2}, 4)),  # dpN given: world = tp*pp*cp*dp
        ("tp2-sp", ("tp2-sp", {"tp": 2, "sp": True}, 2)),
    ],
)
def test_parse_layout_names_world_sizes(memory, name, expected):
    assert memory.parse_layout(name) == expected


@pytest.mark.parametrize(
    "name, message",
    [
        ("zz2", r"cannot parse part 'zz2'"),
        ("sp", r"sp \(sequence parallel\) needs tp > 1"),
        ("ep2-dp1", r"not divisible"),
    ],
)
def test_parse_layout_refuses_bad_names(memory, name, message):
    with pytest.raises(LayoutError, match=message):
        memory.parse_layout(name)


def test_main_refuses_bad_layout_before_running(memory, capsys):
    with pytest.raises(SystemExit) as exc:
        memory.main(["--layout", "tp1", "ep3x"])
    assert exc.value.code == 2 and "--layout ep3x" in capsys.readouterr().err


def test_rank_peaks_read_from_run_json(memory, tmp_path):
    report = tmp_path / "run.json"
    report.write_text(json.dumps([{"check": "export", "passed": True, "peak_rss_mb": [1024.0, 512.5]}]))
    assert memory._rank_peaks(report) == [2**30, round(512.5 * 2**20)]
    report.write_text(json.dumps([{"check": "export", "passed": True, "peak_rss_mb": [1024.0, None]}]))
    with pytest.raises(SystemExit, match="no peak_rss_mb for every rank"):
        memory._rank_peaks(report)


def test_fits_per_layout_use_largest_rank(memory):
    rows = [
        dict(phase="check:export", layers=n, model_bytes=100 * n, peak=999, layout=layout, rank_peaks=[a * n + 10, 1])
        for n in (2, 4)
        for layout, a in (("tp1", 3), ("ep2-dp2", 2))
    ]
    rows.append(dict(phase="check:export", layers=1, model_bytes=100, peak=50))  # no layout: a 1-rank row
    fits = memory._fits(rows)
    assert fits["check:export@ep2-dp2"] == dict(slope=0.02, fixed_gb=0.0)
    assert set(fits) == {"check:export", "check:export@ep2-dp2"}


def test_weights_directory_is_measured_at_its_own_depth(memory, tmp_path):
    """A config alone gets its depth set per row; a directory of safetensors keeps its own (no override in the
    scenario), and a row asking it for another depth is refused rather than measured as something else."""
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"model_type": "qwen3_moe", "num_hidden_layers": 3}))
    assert not memory.weights_dir(config) and memory.depth_overrides(config, 2) == {"num_hidden_layers": 2}
    assert not memory.weights_dir(tmp_path)  # a config without weights beside it
    (tmp_path / "model.safetensors").write_bytes(b"")
    assert memory.weights_dir(tmp_path) and memory.depth_overrides(tmp_path, 3) == {}
    with pytest.raises(SystemExit, match="holds weights of 3 layers; --layers 2"):
        memory.depth_overrides(tmp_path, 2)
    scen = tmp_path / "scen.json"
    memory._scenario(scen, tmp_path, 3, "export")
    (entry,) = json.loads(scen.read_text())["scenarios"]
    assert "model_set" not in entry and entry["model"] == str(tmp_path)
    memory._scenario(scen, config, 2, "export")
    (entry,) = json.loads(scen.read_text())["scenarios"]
    assert entry["model_set"] == {"num_hidden_layers": 2}
