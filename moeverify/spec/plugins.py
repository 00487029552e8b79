"""One way to name user code: ``package.module:attr`` or ``path/to/file.py:attr``.

Subjects, replay implementations and extra checks are all loaded here, with one grammar and one error
format. The runner loads every named plugin once in the parent before torchrun starts, so a missing
module, a syntax error or a missing factory is a usage error (exit 2), not a crash on every rank.
"""

from __future__ import annotations

import ast
import hashlib
import importlib
import importlib.util
import os
import sys
from collections.abc import Callable, Mapping, Sequence

from moeverify.errors import UsageError

GRAMMAR = "package.module:attr or path/to/file.py:attr"


def parse(spec: str, *, what: str, builtins: Sequence[str] = ()) -> tuple[str, str]:
    """``(module or file, attr)`` of ``spec``; ``ValueError`` with the expected forms if it has neither."""
    target, sep, attr = spec.rpartition(":") if isinstance(spec, str) else ("", "", "")
    if not sep or not target or not attr or not attr.isidentifier():
        known = f"{', '.join(builtins)}, " if builtins else ""
        raise ValueError(f"{what} {spec!r} is not {known}{GRAMMAR}")
    if target.endswith(".py"):
        if not os.path.isfile(target):
            raise ValueError(f"{what} {spec!r}: file {target} does not exist")
    elif not all(part.isidentifier() for part in target.split(".")):
        raise ValueError(f"{what} {spec!r}: {target!r} is not a module name (or a path ending in .py)")
    return target, attr


def _module(target: str, *, what: str, spec: str):
    if target.endswith(".py"):
        path = os.path.abspath(target)
        name = (
            f"moeverify_plugin_{os.path.splitext(os.path.basename(path))[0]}_"
            f"{hashlib.sha1(path.encode()).hexdigest()[:8]}"
        )
        if name in sys.modules:
            return sys.modules[name]
        mod_spec = importlib.util.spec_from_file_location(name, path)
        if mod_spec is None or mod_spec.loader is None:
            raise UsageError(f"{target}: Python cannot load this file as a module")
        module = importlib.util.module_from_spec(mod_spec)
        sys.modules[name] = module
        try:
            mod_spec.loader.exec_module(module)
        except BaseException as exc:  # noqa: BLE001 (a user's file: any error is theirs to fix)
            del sys.modules[name]
            raise UsageError(f"{what} {spec!r}: loading {target} raised {type(exc).__name__}: {exc}") from exc
        return module
    try:
        return importlib.import_module(target)
    except ModuleNotFoundError as exc:
        raise UsageError(f"{what} {spec!r}: no module named {exc.name!r}") from exc
    except BaseException as exc:  # noqa: BLE001
        raise UsageError(f"{what} {spec!r}: importing {target} raised {type(exc).__name__}: {exc}") from exc


def load(spec: str, *, what: str, builtins: Mapping[str, str] | None = None) -> Callable:
    """The callable ``spec`` names (a built-in name is looked up in ``builtins`` first)."""
    builtins = builtins or {}
    resolved = builtins.get(spec, spec) if isinstance(spec, str) else spec
    try:
        target, attr = parse(resolved, what=what, builtins=tuple(builtins))
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    module = _module(target, what=what, spec=spec)
    if not hasattr(module, attr):
        raise UsageError(f"{what} {spec!r}: {target} has no attribute {attr!r}")
    value = getattr(module, attr)
    if not callable(value):
        raise UsageError(f"{what} {spec!r}: {target}:{attr} is a {type(value).__name__}, not a callable factory")
    return value


def _source_of(target: str) -> tuple[str, str] | None:
    """(path, source text) of a plugin's module without importing it; None if it has no Python source."""
    if target.endswith(".py"):
        path = target
    else:
        try:
            found = importlib.util.find_spec(target)
        except (ImportError, ValueError):  # a parent package is missing or broken
            found = None
        if found is None:
            top = target.split(".")[0]
            raise UsageError(
                f"no module named {target!r}"
                + (f" (package {top!r} not found)" if top != target and importlib.util.find_spec(top) is None else "")
            )
        origin = found.origin
        if not origin or not origin.endswith(".py"):
            return None  # a compiled or namespace module: only importing it can tell
        path = origin
    try:
        with open(path, "rb") as f:
            return path, f.read().decode("utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"cannot read {path}: {exc}") from None


def _top_level(body):
    """Module-level statements, also those inside top-level if/try/with/for blocks (not in functions)."""
    for node in body:
        yield node
        if isinstance(node, ast.If | ast.For | ast.While | ast.With):
            yield from _top_level(node.body + getattr(node, "orelse", []))
        elif isinstance(node, ast.Try):
            yield from _top_level(node.body + node.orelse + node.finalbody + [s for h in node.handlers for s in h.body])


def check(spec: str, *, what: str, builtins: Mapping[str, str] | None = None) -> None:
    """Refuse, without running any of it, a plugin that cannot load: a bad name, a missing module or
    file, a syntax error, or no top-level ``attr``. The parent calls this before torchrun starts; the
    ranks then ``load`` it for real."""
    builtins = builtins or {}
    if spec in builtins:
        return
    try:
        target, attr = parse(spec, what=what, builtins=tuple(builtins))
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    try:
        found = _source_of(target)
    except UsageError as exc:
        raise UsageError(f"{what} {spec!r}: {exc}") from None
    if found is None:
        return
    path, source = found
    try:
        tree = ast.parse(source, filename=path)
    except SyntaxError as exc:
        raise UsageError(f"{what} {spec!r}: {path}:{exc.lineno}: syntax error: {exc.msg}") from None
    defined: dict[str, str] = {}
    for node in _top_level(tree.body):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            defined[node.name] = "callable"
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            for t in node.targets if isinstance(node, ast.Assign) else [node.target]:
                for name in ast.walk(t):
                    if isinstance(name, ast.Name):
                        defined[name.id] = "value"
        elif isinstance(node, ast.Import | ast.ImportFrom):
            for alias in node.names:
                defined[(alias.asname or alias.name).split(".")[0]] = "import"
    star = any(isinstance(n, ast.ImportFrom) and any(a.name == "*" for a in n.names) for n in _top_level(tree.body))
    if attr not in defined and "__getattr__" not in defined and not star:
        raise UsageError(f"{what} {spec!r}: {path} defines no top-level {attr!r}")
