"""Every package's docstring is its map: it names each of its modules and subpackages (as ````name````), so
that a module added, moved or renamed without its map fails here (two maps had drifted before this test)."""

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2] / "moeverify"
PACKAGES = sorted(p.parent for p in ROOT.rglob("__init__.py") if "__pycache__" not in p.parts)


def _members(package: Path) -> list[str]:
    mods = [p.stem for p in package.glob("*.py") if p.name != "__init__.py"]
    subs = [p.name for p in package.iterdir() if (p / "__init__.py").is_file()]
    return sorted(mods + subs)


def _named(package: Path) -> set[str]:
    doc = ast.get_docstring(ast.parse((package / "__init__.py").read_text())) or ""
    return set(re.findall(r"``([A-Za-z_][\w.]*)", doc))


@pytest.mark.parametrize("package", PACKAGES, ids=lambda p: str(p.relative_to(ROOT.parent)))
def test_package_docstring_names_every_module(package):
    named = {n.split(".")[0] for n in _named(package)} | _named(package)
    missing = [m for m in _members(package) if m not in named]
    assert not missing, f"{package.relative_to(ROOT.parent)}/__init__.py: its docstring does not name {missing}"


def test_the_walk_sees_the_packages():
    names = {str(p.relative_to(ROOT.parent)) for p in PACKAGES}
    assert {"moeverify", "moeverify/spec", "moeverify/routing", "moeverify/commands"} <= names and len(names) > 12


def test_an_unnamed_module_is_caught(tmp_path):
    (tmp_path / "__init__.py").write_text('"""Holds ``a``."""\n')
    (tmp_path / "a.py").write_text("")
    (tmp_path / "b.py").write_text("")
    assert [m for m in _members(tmp_path) if m not in _named(tmp_path)] == ["b"]
