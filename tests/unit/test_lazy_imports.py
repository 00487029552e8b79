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

HEAVY = ("torch", "megatron", "transformers", "safetensors", "rich", "matplotlib", "huggingface_hub")
LAZY = re.compile(r"#\s*lazy:\s*(\w+)")

NOT_YET: frozenset[str] = frozenset()


def _unexplained(path: Path) -> list[str]:
    """``line: source`` of each function-local import without a ``# lazy: <heavy dependency>`` comment."""
    text = path.read_text()
    lines = text.splitlines()
    out = []
    for fn in ast.walk(ast.parse(text)):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        for node in ast.walk(fn):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                why = LAZY.search(lines[node.lineno - 1])
                if why is None or why.group(1) not in HEAVY:
                    out.append(f"{node.lineno}: {lines[node.lineno - 1].strip()}")
    return sorted(set(out))


def _modules(repo_root: Path) -> dict[str, Path]:
    package = repo_root / "moeverify"
    return {p.relative_to(package).as_posix(): p for p in sorted(package.rglob("*.py"))}


def test_function_local_imports_say_which_heavy_import_they_put_off(repo_root):
    modules = _modules(repo_root)
    assert len(modules) > 100 and "cli.py" in modules and "commands/dump.py" in modules
    found = {name: bad for name, path in modules.items() if name not in NOT_YET and (bad := _unexplained(path))}
    assert found == {}, "function-local imports only for " + ", ".join(HEAVY) + ", each with '# lazy: <which>'"


def test_not_yet_lists_only_modules_that_still_need_it(repo_root):
    modules = _modules(repo_root)
    assert sorted(NOT_YET - set(modules)) == []  # a module moved or deleted leaves the list
    assert sorted(name for name in NOT_YET if not _unexplained(modules[name])) == []  # clean: leaves the list


def test_an_uncommented_or_light_local_import_is_found(tmp_path):
    """Control: the walk sees imports in nested functions and methods, and a comment that names no heavy import."""
    module = tmp_path / "m.py"
    module.write_text("import os\n\n\nclass C:\n    def f(self):\n        def g():\n"
                      "            from moeverify import views\n        import torch  # lazy: torch\n"
                      "        import json  # lazy: json\n")
    assert _unexplained(module) == ["7: from moeverify import views", "9: import json  # lazy: json"]
