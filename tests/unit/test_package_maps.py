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


FACES = ("routes", "views", "layout", "rollout_writer", "engine_routes")


def _imports_of(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names)
    return out


def test_the_code_imports_the_packages_not_the_public_faces():
    """``moeverify.routing.routes`` and the other faces exist for users' scripts; the package imports the real modules,
    so that the import contract sees every edge."""
    faces = {f"moeverify.{f}" for f in FACES}
    shims = {ROOT / f"{f}.py" for f in FACES}
    found = {str(p.relative_to(ROOT)): sorted(_imports_of(p) & faces) for p in ROOT.rglob("*.py") if p not in shims}
    assert {k: v for k, v in found.items() if v} == {}


@pytest.mark.parametrize("face", FACES)
def test_a_public_face_is_the_module_it_names(face):
    import importlib

    public = importlib.import_module(f"moeverify.{face}")
    real = {"layout": "moeverify.spec.layout"}.get(face, f"moeverify.routing.{face}")
    if face == "views":  # the views face adds the function form of Routes.to_local / to_global
        from moeverify.routing import views

        assert all(getattr(public, n) is getattr(views, n) for n in public.__all__ if hasattr(views, n))
        assert set(public.__all__) >= {
            n
            for n in dir(views)
            if not n.startswith("_")
            and n[0].islower()
            and callable(getattr(views, n))
            and getattr(views, n).__module__ == views.__name__
        }
    else:
        assert public is importlib.import_module(real)


def test_message_limits_are_declared_once():
    """How much a message quotes is ``errors.py``'s ``SHOW`` and ``SHOW_NAMES``, and what it says of the rest is
    ``errors.more`` (``few``): no other limit, no hand-written "(+N more)" / "(and N more)" / " ..."."""
    lines = [
        (f"{p.relative_to(ROOT)}:{n}", line)
        for p in ROOT.rglob("*.py")
        for n, line in enumerate(p.read_text().splitlines(), 1)
    ]
    declared = sorted(where for where, line in lines if re.match(r"SHOW(_\w+)? *=", line))
    assert [w.split(":")[0] for w in declared] == ["errors.py", "errors.py"], declared
    by_hand = [
        where
        for where, line in lines
        if not where.startswith("errors.py:")
        and re.search(r"\(\+\{|\(and \{|more\)[\"']|\(\+more\)|[\"'] \.\.\.[\"']", line)
    ]
    assert not by_hand, f"truncated by hand, not through errors.few / errors.more: {by_hand}"
