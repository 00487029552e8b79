"""Supported version ranges: declared once in moeverify/spec/support.py, equal in pyproject.toml, and the lock
inside."""

import re
import tomllib
from pathlib import Path

import pytest
from waiting import CHILD_S

from moeverify.cli import main
from moeverify.spec import support

ROOT = Path(__file__).resolve().parents[2]


def declared_in_pyproject() -> dict[str, str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    specs = list(project["dependencies"]) + [d for deps in project["optional-dependencies"].values() for d in deps]
    out = {}
    for spec in specs:
        name, rest = re.match(r"([A-Za-z0-9_.-]+)\s*(.*)", spec).groups()
        if rest:
            out[name] = rest.replace(" ", "")
    return out


def locked() -> dict[str, str]:
    out = {}
    for name in ("stack.txt", "nodeps.txt"):
        for line in (ROOT / "requirements" / name).read_text().splitlines():
            if "==" in line and not line.startswith("#"):
                dist, version = line.split("==")
                out[dist.strip()] = version.strip()
    return out


def test_pyproject_declares_exactly_the_supported_ranges():
    assert declared_in_pyproject() == {item.dist: item.spec() for item in support.SUPPORTED}


def test_the_lock_ci_runs_lies_inside_every_supported_range():
    lock = locked()
    for item in support.SUPPORTED:
        assert item.dist in lock, f"{item.dist} is supported but not in requirements/"
        assert item.admits(lock[item.dist]), f"{item.dist}=={lock[item.dist]} outside {item.spec()}"


@pytest.mark.parametrize(
    "version,expected", [("2.11.0+cu130", (2, 11)), ("0.19.2rc1", (0, 19, 2)), ("6", (6,)), ("2.14.1", (2, 14, 1))]
)
def test_release_reads_local_and_pre_release_versions(version, expected):
    assert support.release(version) == expected


def test_ranges_are_half_open():
    torch = next(item for item in support.SUPPORTED if item.dist == "torch")
    assert torch.admits("2.11.0+cu130") and torch.admits("2.14.9") and not torch.admits("2.15.0")
    assert not torch.admits("2.10.2")


def test_check_names_what_is_unsupported_and_what_is_missing():
    ok = {item.dist: item.low for item in support.SUPPORTED}
    assert support.check(ok) == []
    problems = support.check({**ok, "torch": "2.9.1", "megatron-core": "not installed", "verl": "not installed"})
    assert problems == [
        "torch 2.9.1 is outside the supported range >=2.11,<2.15",
        "megatron-core is not installed (supported >=0.19,<0.20)",
    ]
    with pytest.raises(ValueError, match="not a version"):
        support.release("unknown")


def test_doctor_refuses_an_unsupported_stack(monkeypatch, capsys):
    from moeverify.commands import doctor

    monkeypatch.setattr(
        doctor,
        "_versions",
        lambda: {
            "torch": "2.9.1",
            "megatron-core": "0.19.2",
            "megatron-bridge": "0.6.2",
            "transformers": "5.12.1",
            "verl": "not installed",
        },
    )
    assert main(["doctor"]) == 1
    out = capsys.readouterr()
    assert "UNSUPPORTED" in out.out and "torch 2.9.1 is outside the supported range >=2.11,<2.15" in out.err


@pytest.mark.timing
def test_pip_install_no_deps_into_an_existing_environment_works_outside_the_checkout(tmp_path):
    """What users do in an NGC container or beside a cluster's own torch: install moeverify alone (no deps,
    nothing from the network), then use it from anywhere; the installed copy, not this checkout, answers."""
    import subprocess
    import sys

    site = tmp_path / "site"
    pip = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--quiet",
            "--no-index",
            "--no-deps",
            "--no-build-isolation",
            "--target",
            str(site),
            str(ROOT),
        ],
        capture_output=True,
        text=True,
    )
    assert pip.returncode == 0, pip.stderr[-2000:]
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(site), "HOME": str(tmp_path)}
    probe = subprocess.run(
        [sys.executable, "-c", "import moeverify.cli, moeverify.spec.support; print(moeverify.__file__)"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
    )
    assert probe.returncode == 0 and probe.stdout.strip().startswith(str(site)), probe.stderr[-2000:]
    listing = subprocess.run(
        [sys.executable, "-m", "moeverify", "run", str(ROOT / "scenarios" / "smoke.yaml"), "--list"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
        timeout=CHILD_S,
    )
    assert listing.returncode == 0 and "qwen3_moe" in listing.stdout, listing.stderr[-2000:]
