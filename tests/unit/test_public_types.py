"""The public names the docs show type-check in a user's code: ``py.typed`` ships, and each public face (a module
that *is*, at run time, the module it names) declares its names as explicit re-exports a type checker reads.

The user's view is reproduced: a snippet in a directory of its own, checked by mypy ``--strict`` (explicit
re-exports only) with moeverify found as an installed package, as ``make setup`` or ``pip install`` leaves it.
Pyright runs too where it is installed.
"""

import ast
import importlib
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from waiting import CHILD_S

REPO = Path(__file__).resolve().parents[2]
FACES = {  # public face -> the module it is
    "layout": "moeverify.spec.layout",
    "routes": "moeverify.routing.routes",
    "rollout_writer": "moeverify.routing.rollout_writer",
    "engine_routes": "moeverify.routing.engine_routes",
}

# The names the README and docs/ import, used as the docs use them; never run, only type-checked.
USER_CODE = """\
from pathlib import Path

import numpy as np
import torch

from moeverify import engine_routes as er
from moeverify import views
from moeverify.engine_routes import EngineRoutes
from moeverify.layout import Layout
from moeverify.patches import injob
from moeverify.patches import router_replay as rr
from moeverify.rollout_writer import RolloutWriter, mark_complete
from moeverify.routes import Routes, safe_routes
from moeverify.views import RankCoords, job_layout, rank_coords, to_local

layout: Layout = Layout(ep=2)
coords: RankCoords = rank_coords(layout, rank=0, world_size=2)
ids_TK: torch.Tensor = safe_routes(4, topk=2, num_experts=8)
routes: Routes = Routes({1: [ids_TK]}, num_experts=8, topk=2)
local: Routes = to_local(routes, layout, coords=coords, seq_len=4, batch=1, num_layers=2)
merged: Routes = views.to_global(
    {coords: local}, layout, world_size=2, seq_len=4, batch=1, num_layers=2, moe_layers=[1]
)
rollout: Routes = Routes.from_rollout(np.zeros((4, 1, 2), dtype=np.int64), layers=[1], num_experts=8, tokens=4)
got: EngineRoutes = er.from_vllm(np.zeros((3, 2, 2), dtype=np.int32), num_tokens=4, physical=False)
sglang: EngineRoutes = er.from_sglang({}, num_layers=2, top_k=2, num_tokens=4, physical=False)
spliced: EngineRoutes = er.splice(got, got)
physical: bool = er.sglang_ids_physical("0.5.9", placement=False)
with RolloutWriter("rollout_routes", step=0) as w:
    w.add([1, 2, 3, 4], got)
done: Path = mark_complete("rollout_routes", step=0)
rr.apply()
rr.revert()
injob.add_routes(version=0, sequences=[[1, 2, 3, 4]], routes=[got])
injob.drop_routes()
with injob.pass_kind("training"), injob.rollout_version(0):
    pass
job: tuple[Layout, RankCoords, int] = job_layout(sp=False)
"""

# The control: names that resolved to Any would let these through.
WRONG_CODE = """\
from moeverify.layout import Layout
from moeverify.rollout_writer import mark_complete

layout: str = Layout(ep=2)
done: int = mark_complete("rollout_routes", step=0)
"""


def _mypy() -> Path:
    found = Path(sys.executable).parent / "mypy"
    if not found.exists():
        which = shutil.which("mypy")
        if which is None:
            pytest.skip("mypy is not installed (make setup installs it)")
        found = Path(which)
    return found


@pytest.mark.timing  # a child process: bounded by waiting.CHILD_S, run under load by make test
def test_public_names_type_check_with_mypy(tmp_path, request):
    """The docs' code passes mypy --strict; the control's two wrong assignments are its only errors (names that
    resolved to Any would let them through). Both files in one run, outside the repository (no project config)."""
    (tmp_path / "user_code.py").write_text(USER_CODE)
    (tmp_path / "wrong_code.py").write_text(WRONG_CODE)
    (tmp_path / "mypy.ini").write_text("[mypy]\n")
    cache = request.config.cache.mkdir("mypy-public-types")  # a warm run takes seconds, a cold one about a minute
    cmd = [str(_mypy()), "--strict", "--config-file", "mypy.ini", "--cache-dir", str(cache)]
    proc = subprocess.run(
        [*cmd, "user_code.py", "wrong_code.py"], cwd=tmp_path, capture_output=True, text=True, timeout=CHILD_S
    )
    errors = [line for line in proc.stdout.splitlines() if ": error: " in line]
    where = [e.split(": error: ")[0] for e in errors]
    assert where == ["wrong_code.py:4", "wrong_code.py:5"], proc.stdout + proc.stderr
    assert all("[assignment]" in e for e in errors), errors


@pytest.mark.timing  # a child process: bounded by waiting.CHILD_S, run under load by make test
def test_public_names_type_check_with_pyright(tmp_path):
    pyright = shutil.which("pyright")
    if pyright is None:
        pytest.skip("pyright is not installed (mypy checks the same snippet)")
    (tmp_path / "user_code.py").write_text(USER_CODE)
    (tmp_path / "pyrightconfig.json").write_text(f'{{"pythonPath": "{sys.executable}"}}')
    proc = subprocess.run([pyright, "user_code.py"], cwd=tmp_path, capture_output=True, text=True, timeout=CHILD_S)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def _type_checking_reexports(tree: ast.Module) -> dict[str, str]:
    """``{name: module}`` of the face's ``if TYPE_CHECKING:`` imports, each of the form ``import X as X``."""
    out = {}
    for node in tree.body:
        if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING":
            for imp in node.body:
                assert isinstance(imp, ast.ImportFrom) and imp.module, ast.unparse(imp)
                for alias in imp.names:
                    assert alias.asname == alias.name, f"{ast.unparse(imp)}: not an explicit re-export (X as X)"
                    out[alias.name] = imp.module
    return out


def _declared_all(tree: ast.Module) -> list[str]:
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets):
            return list(ast.literal_eval(node.value))
    return []


def _public_names(module_file: Path) -> set[str]:
    """Names a module defines or explicitly re-exports at its top level, leading underscore excepted."""
    names = set()
    for node in ast.parse(module_file.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, ast.ImportFrom):
            names.update(a.name for a in node.names if a.asname == a.name)
    return {n for n in names if not n.startswith("_")}


@pytest.mark.parametrize("face", sorted(FACES))
def test_public_face_reexports_every_name_of_its_module(face):
    """The type checker's view of a face (its re-exports) and the run time's (the module itself) hold the same
    names: a name added to the module and not to its face fails here."""
    real = FACES[face]
    tree = ast.parse((REPO / "moeverify" / f"{face}.py").read_text())
    reexports = _type_checking_reexports(tree)
    assert set(reexports.values()) == {real}, reexports
    assert sorted(reexports) == sorted(_declared_all(tree))
    real_file = REPO / (real.replace(".", "/") + ".py")
    assert set(reexports) == _public_names(real_file)
    public, module = importlib.import_module(f"moeverify.{face}"), importlib.import_module(real)
    assert all(getattr(public, name) is getattr(module, name) for name in reexports)


def test_public_face_control_a_missing_name_is_caught():
    tree = ast.parse('__all__ = ["A"]\nif TYPE_CHECKING:\n    from m import A as A\nelse:\n    import sys\n')
    assert _type_checking_reexports(tree) == {"A": "m"} and _declared_all(tree) == ["A"]
    with pytest.raises(AssertionError, match="not an explicit re-export"):
        _type_checking_reexports(ast.parse("if TYPE_CHECKING:\n    from m import A\n"))


@pytest.mark.timing  # a child process: bounded by waiting.CHILD_S, run under load by make test
def test_wheel_ships_py_typed(tmp_path):
    """``pip install`` of the package brings ``moeverify/py.typed`` (PEP 561), so users' checkers read its types."""
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    shutil.copytree(REPO / "moeverify", src / "moeverify", ignore=shutil.ignore_patterns("__pycache__"))
    cmd = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "--no-index", "."]
    proc = subprocess.run([*cmd, "-w", str(tmp_path / "out")], cwd=src, capture_output=True, text=True, timeout=CHILD_S)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (wheel,) = (tmp_path / "out").glob("moeverify-*.whl")
    assert "moeverify/py.typed" in zipfile.ZipFile(wheel).namelist()
