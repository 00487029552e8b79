"""Function-local imports only put off a heavy third-party import, and say which (``# lazy: torch``).

An import hidden in a function to dodge an import cycle, or one that puts off nothing (the module is loaded
anyway), hides the real dependency order that the layers contract in pyproject.toml checks. Modules in
``NOT_YET`` still hold uncommented function-local imports (the debt of issue 23); a module leaves the list once
clean, and no module may join it.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

HEAVY = ("torch", "megatron", "transformers", "safetensors", "rich", "matplotlib", "huggingface_hub", "verl")
LAZY = re.compile(r"#\s*lazy:\s*([\w.]+)")  # a package, or a submodule its import does not load

NOT_YET: frozenset[str] = frozenset()
# Run by a real engine's own python and never imported by moeverify: its imports are the engine's (vLLM, numpy,
# torch, safetensors), loaded where the engine's steps need them.
ENGINE_SIDE = frozenset({"engines/vllm_child.py"})


def _local_imports(path: Path) -> list[tuple[int, str, re.Match | None]]:
    """``(line, source, tag)`` of each function-local import; the tag may sit on any line of the statement (a long
    import is wrapped by the formatter)."""
    text = path.read_text()
    lines = text.splitlines()
    out = {}
    for fn in ast.walk(ast.parse(text)):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        for node in ast.walk(fn):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                source = "\n".join(lines[node.lineno - 1 : node.end_lineno])
                out[node.lineno] = (node.lineno, lines[node.lineno - 1].strip(), LAZY.search(source))
    return [out[n] for n in sorted(out)]


def _unexplained(path: Path) -> list[str]:
    """``line: source`` of each function-local import without a ``# lazy: <heavy dependency>`` comment."""
    return [
        f"{n}: {line}"
        for n, line, why in _local_imports(path)
        if why is None or why.group(1).split(".")[0] not in HEAVY
    ]


def _top_level_imports(path: Path) -> set[str]:
    """Dotted names a module imports when it is loaded (module level, ``if TYPE_CHECKING`` blocks left out)."""
    out: set[str] = set()

    def visit(body):
        for node in body:
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                visit(node.orelse)
            elif isinstance(node, ast.Import):
                out.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                out.add(node.module)
                out.update(f"{node.module}.{a.name}" for a in node.names)
            elif isinstance(node, (ast.If, ast.Try, ast.With)):
                visit(getattr(node, "body", []))
                visit(getattr(node, "orelse", []))
                for handler in getattr(node, "handlers", []):
                    visit(handler.body)

    visit(ast.parse(path.read_text()).body)
    return out


def _loaded_with(repo_root: Path) -> dict[str, set[str]]:
    """For each module (``a/b.py``), the heavy modules loading it imports (dotted), through moeverify's own modules."""
    package = repo_root / "moeverify"
    by_dotted = {}
    for p in package.rglob("*.py"):
        parts = p.relative_to(repo_root).with_suffix("").parts
        by_dotted[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = p
    direct = {d: _top_level_imports(p) for d, p in by_dotted.items()}

    def own(name: str) -> list[str]:  # a dotted import loads every package above it too
        parts = name.split(".")
        return [".".join(parts[:i]) for i in range(1, len(parts) + 1) if ".".join(parts[:i]) in by_dotted]

    out: dict[str, set[str]] = {}
    for dotted, path in by_dotted.items():
        seen, todo, heavy = set(), [dotted], set()
        while todo:
            mod = todo.pop()
            if mod in seen:
                continue
            seen.add(mod)
            for name in direct[mod]:
                if name.split(".")[0] in HEAVY:
                    heavy.add(name)
                todo.extend(own(name))
        out[path.relative_to(package).as_posix()] = heavy
    return out


def _vacuous(path: Path, loaded: set[str]) -> list[str]:
    """``line: source`` of each ``# lazy: X`` import whose X the module loads anyway at import (``X`` or a module
    under it imported at module level; ``# lazy: torch._dynamo`` defers a submodule ``import torch`` leaves out)."""
    return [
        f"{n}: {line}"
        for n, line, why in _local_imports(path)
        if why and any(name == why.group(1) or name.startswith(why.group(1) + ".") for name in loaded)
    ]


def _modules(repo_root: Path) -> dict[str, Path]:
    package = repo_root / "moeverify"
    return {p.relative_to(package).as_posix(): p for p in sorted(package.rglob("*.py"))}


def test_function_local_imports_say_which_heavy_import_they_put_off(repo_root):
    modules = _modules(repo_root)
    assert len(modules) > 100 and "cli.py" in modules and "commands/dump.py" in modules
    found = {
        name: bad for name, path in modules.items() if name not in NOT_YET | ENGINE_SIDE and (bad := _unexplained(path))
    }
    assert found == {}, "function-local imports only for " + ", ".join(HEAVY) + ", each with '# lazy: <which>'"


def test_a_lazy_import_puts_off_something(repo_root):
    """``# lazy: X`` where loading the module loads X anyway (itself or through moeverify's modules) defers
    nothing: it hides a real dependency behind a false comment."""
    loaded = _loaded_with(repo_root)
    assert "torch" in loaded["routing/routes.py"] and not loaded["cli.py"]  # the walk sees both kinds
    found = {name: bad for name, path in _modules(repo_root).items() if (bad := _vacuous(path, loaded[name]))}
    assert found == {}, "these lazy imports put off nothing (import them at module level): " + repr(found)


def test_a_vacuous_lazy_tag_is_found(tmp_path):
    module = tmp_path / "m.py"
    module.write_text(
        "import torch\n\n\ndef f():\n    import megatron  # lazy: megatron\n    import torch.nn  # lazy: torch\n"
    )
    module.write_text(module.read_text() + "    import torch._dynamo  # lazy: torch._dynamo\n")
    loaded = {r for r in _top_level_imports(module) if r.split(".")[0] in HEAVY}
    assert _vacuous(module, loaded) == ["6: import torch.nn  # lazy: torch"]


def test_not_yet_lists_only_modules_that_still_need_it(repo_root):
    modules = _modules(repo_root)
    assert sorted(NOT_YET - set(modules)) == []  # a module moved or deleted leaves the list
    assert sorted(name for name in NOT_YET if not _unexplained(modules[name])) == []  # clean: leaves the list


def test_an_uncommented_or_light_local_import_is_found(tmp_path):
    """Control: the walk sees imports in nested functions and methods, and a comment that names no heavy import."""
    module = tmp_path / "m.py"
    module.write_text(
        "import os\n\n\nclass C:\n    def f(self):\n        def g():\n"
        "            from moeverify import views\n        import torch  # lazy: torch\n"
        "        import json  # lazy: json\n"
    )
    assert _unexplained(module) == ["7: from moeverify import views", "9: import json  # lazy: json"]
