"""README.md and docs/*.md say only what runs: every relative link resolves (file and ``#anchor``), every command
in a ``bash``/``sh``/``console`` block parses, every ``python`` block compiles and its ``moeverify`` imports resolve.

Commands are checked by what reads them for real: ``moeverify ...`` (also ``python -m moeverify``, under
``srun``) by the CLI's own parser, ``torchrun ...`` (also ``python -m torch.distributed.run``) by torch's own
launcher parser and then its script or module, ``make X`` against the Makefile's targets, ``python -m M`` by
finding ``M``, ``python bench/X.py ARGS`` by the script's own parser (its ``main(argv)`` stopped once parsed). A
path under one of the repository's source folders (``scenarios/...``, ``tests/...``, a ``path/file.py:attr``
plugin and its ``attr``) must exist; other paths are the reader's (``train.py``, ``~/ckpt/...``); a shell
variable (``$NODE_RANK``) stands for 1. A command word the test does not know fails it: a new kind of command gets
its check here.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import functools
import importlib
import importlib.util
import re
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

import pytest

from moeverify import cli

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SOURCE_DIRS = ("bench", "docs", "examples", "moeverify", "requirements", "scenarios", "tests", "tools")
SHELLS = ("bash", "sh", "shell", "console")
# Command words checked for their paths only: the reader's own tools, whose arguments moeverify does not define.
EXTERNAL = {"pip", "pip3", "git", "cd", "mkdir", "ls", "cat", "cp", "rm"}
WRAPPERS = {"srun", "nice", "time", "env"}  # run the command that follows their own options

_FENCE = re.compile(r"^```([\w-]*)[^\n]*\n(.*?)^```[ \t]*$", re.S | re.M)
_LINK = re.compile(r"!?\[(?:[^\]\\]|\\.)*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
_HEADING = re.compile(r"^(#{1,6})\s+(.+?)\s*#*\s*$", re.M)
_ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
_VARIABLE = re.compile(r"\$(?:\{[A-Za-z_][A-Za-z0-9_]*\}|[A-Za-z_][A-Za-z0-9_]*)")


@dataclass(frozen=True)
class Block:
    page: Path
    line: int  # of the block's first content line, 1-based
    lang: str
    text: str

    def where(self, offset: int = 0) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line + offset}"


def _blocks(page: Path) -> list[Block]:
    text = page.read_text()
    return [
        Block(page, text.count("\n", 0, m.start(2)) + 1, m.group(1).lower(), m.group(2)) for m in _FENCE.finditer(text)
    ]


def _prose(text: str) -> str:
    """The page without its fenced blocks and inline code, where links and headings live."""
    text = _FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), text)
    return re.sub(r"`[^`\n]*`", "", text)


@functools.cache
def _anchors(page: Path) -> frozenset[str]:
    """GitHub's heading ids of a page: lower case, punctuation dropped, spaces to '-', repeats numbered."""
    seen: dict[str, int] = {}
    out = set()
    for m in _HEADING.finditer(_FENCE.sub("", page.read_text())):
        title = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", m.group(2))  # a link in a heading: its text
        slug = re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return frozenset(out)


def _links(page: Path) -> list[str]:
    return [m.group(1) for m in _LINK.finditer(_prose(page.read_text()))]


def _link_problem(page: Path, target: str) -> str | None:
    if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto: ...
        return None
    path, _, anchor = target.partition("#")
    dest = (page.parent / path).resolve() if path else page
    if not dest.exists():
        return f"{target}: {dest.relative_to(ROOT) if dest.is_relative_to(ROOT) else dest} does not exist"
    if anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
        return f"{target}: no heading with id {anchor!r} in {dest.relative_to(ROOT)}"
    return None


# ---- commands ----


def _command_lines(block: Block) -> list[tuple[int, str]]:
    """(line offset, command) of a shell block: continuations joined, comment lines and console output left out."""
    out: list[tuple[int, str]] = []
    pending, start = "", 0
    for i, raw in enumerate(block.text.splitlines()):
        line = raw
        if block.lang == "console" and not pending:
            if not line.startswith("$ "):
                continue  # output
            line = line[2:]
        if not pending:
            start = i
            if not line.strip() or line.lstrip().startswith("#"):
                continue
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        out.append((start, pending + line))
        pending = ""
    assert not pending, f"{block.where(start)}: a continuation line ends the block"
    return out


@functools.cache
def _make_targets() -> frozenset[str]:
    text = (ROOT / "Makefile").read_text()
    return frozenset(re.findall(r"^([A-Za-z0-9_.-]+)\s*:(?!=)", text, re.M))


def _module_exists(name: str) -> bool:
    """Whether module ``name`` can be found, without importing it (a top-level spec, then its files)."""
    top, *rest = name.split(".")
    if top == "moeverify":
        base = ROOT / "moeverify"
    else:
        spec = importlib.util.find_spec(top)
        if spec is None:
            return False
        if not rest:
            return True
        if not spec.submodule_search_locations:
            return False
        base = Path(next(iter(spec.submodule_search_locations)))
    path = base.joinpath(*rest)
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file() or (not rest and base.is_dir())


def _check_paths(tokens: list[str], where: str) -> None:
    """Every token naming a path under a source folder exists; a ``file.py:attr`` plugin defines ``attr``."""
    for token in tokens:
        value = token.split("=", 1)[1] if token.startswith("--") and "=" in token else token
        path, _, attr = value.partition(":") if re.match(r"^[\w./-]+\.py:\w+$", value) else (value, "", "")
        if path.split("/", 1)[0] not in SOURCE_DIRS or "/" not in path or any(c in path for c in "*?[{$<"):
            continue
        assert (ROOT / path).exists(), f"{where}: {path} does not exist in the repository"
        if attr:
            tree = ast.parse((ROOT / path).read_text())
            defined = {n.name for n in tree.body if isinstance(n, ast.FunctionDef | ast.ClassDef)}
            assert attr in defined, f"{where}: {path} defines no top-level {attr!r}"


def _check_moeverify(argv: list[str], where: str) -> None:
    try:
        cli.build_parser(argv[0] if argv else None).parse_args(argv)
    except cli.ParseError as exc:
        raise AssertionError(f"{where}: moeverify {shlex.join(argv)}: {exc}") from None
    except SystemExit as exc:  # --help, --version
        assert exc.code in (0, None), f"{where}: moeverify {shlex.join(argv)} exits {exc.code}"


def _check_torchrun(argv: list[str], where: str) -> None:
    from torch.distributed.run import get_args_parser  # lazy: torch

    try:
        args = get_args_parser().parse_args(argv)
    except SystemExit:
        raise AssertionError(f"{where}: torchrun {shlex.join(argv)}: torch's launcher refuses it") from None
    if args.module:
        assert _module_exists(args.training_script), f"{where}: no module {args.training_script}"
        if args.training_script == "moeverify":
            _check_moeverify(args.training_script_args, where)
    else:
        _check_paths([args.training_script], where)
        if args.training_script.split("/", 1)[0] in SOURCE_DIRS:
            _check_script(args.training_script, args.training_script_args, where)


class _Parsed(BaseException):
    """Raised once a script's command line is parsed: the check stops there, before the script's work."""


@contextlib.contextmanager
def _stop_after_parsing():
    """argparse's ``parse_args`` (and a direct ``parse_known_args``) parse as usual, then raise ``_Parsed``."""
    parse_args, parse_known_args = argparse.ArgumentParser.parse_args, argparse.ArgumentParser.parse_known_args
    depth = 0

    def parse_args_then_stop(self, args=None, namespace=None):
        nonlocal depth
        depth += 1
        try:
            parse_args(self, args, namespace)
        finally:
            depth -= 1
        raise _Parsed

    def parse_known_args_then_stop(self, args=None, namespace=None):
        nonlocal depth
        depth += 1
        try:
            result = parse_known_args(self, args, namespace)
        finally:
            depth -= 1
        if depth == 0:
            raise _Parsed
        return result

    with (
        mock.patch.object(argparse.ArgumentParser, "parse_args", parse_args_then_stop),
        mock.patch.object(argparse.ArgumentParser, "parse_known_args", parse_known_args_then_stop),
    ):
        yield


def _check_script(script: str, argv: list[str], where: str) -> None:
    """A repository script with ``main(argv)`` parses ``argv`` with its own parser (its work never starts).

    A script that returns before parsing (a GPU benchmark on a host without one) or has no ``main(argv)`` is
    checked for its path only."""
    path = ROOT / script
    tree = ast.parse(path.read_text())
    if not any(isinstance(n, ast.FunctionDef) and n.name == "main" and n.args.args for n in tree.body):
        return
    saved_path, saved_modules = list(sys.path), set(sys.modules)
    try:
        spec = importlib.util.spec_from_file_location(f"_docs_{path.stem}", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        with _stop_after_parsing():
            module.main(argv)
    except _Parsed:
        pass
    except SystemExit as exc:
        raise AssertionError(f"{where}: {script} {shlex.join(argv)}: its parser refuses it (exit {exc.code})") from None
    finally:
        sys.path[:] = saved_path  # bench scripts put bench/ on the path; its modules go with it
        for name in set(sys.modules) - saved_modules:
            file = getattr(sys.modules[name], "__file__", None) or ""
            if file.startswith(str(path.parent)):
                del sys.modules[name]


def _check_python(argv: list[str], where: str) -> None:
    if not argv or argv[0] != "-m":
        if argv:
            _check_paths(argv[:1], where)
            if argv[0].split("/", 1)[0] in SOURCE_DIRS:
                _check_script(argv[0], argv[1:], where)
        return
    module, rest = argv[1], argv[2:]
    assert _module_exists(module), f"{where}: python -m {module}: no such module"
    if module == "moeverify":
        _check_moeverify(rest, where)
    elif module == "torch.distributed.run":
        _check_torchrun(rest, where)


def check_command(command: str, where: str) -> None:
    """Parse one shell command as the tool it names would; AssertionError naming ``where`` when it would not."""
    tokens = [_VARIABLE.sub("1", t) for t in shlex.split(command, comments=True)]  # $NODE_RANK: a value to parse
    while tokens and _ASSIGNMENT.match(tokens[0]):
        tokens.pop(0)  # VAR=value before the command
    assert tokens, f"{where}: an assignment without a command: {command!r}"
    word, argv = tokens[0], tokens[1:]
    _check_paths(argv, where)
    name = Path(word).name if word.startswith(".venv/bin/") else word
    if name in WRAPPERS:
        inner = next((i for i, t in enumerate(argv) if not t.startswith("-") and not _ASSIGNMENT.match(t)), None)
        assert inner is not None, f"{where}: {word} runs nothing"
        return check_command(shlex.join(argv[inner:]), where)
    if name == "moeverify":
        _check_moeverify(argv, where)
    elif name == "torchrun":
        _check_torchrun(argv, where)
    elif name in ("python", "python3"):
        _check_python(argv, where)
    elif name == "make":
        targets = [a for a in argv if not a.startswith("-") and "=" not in a]
        missing = sorted(set(targets) - _make_targets())
        assert not missing, f"{where}: make {' '.join(missing)}: no such target in the Makefile"
    elif name in ("bash", "sh"):
        assert argv and (ROOT / argv[0]).is_file(), f"{where}: {command!r}: no script {argv[:1]}"
    elif name == "pytest":
        _check_paths([a.split("::")[0] for a in argv], where)
    else:
        assert name in EXTERNAL, f"{where}: {word!r}: a command this test does not know (add its check)"


# ---- python ----


def _resolve_import(module: str, names: list[str], where: str) -> None:
    try:
        mod = importlib.import_module(module)
    except ImportError as exc:
        raise AssertionError(f"{where}: import {module}: {exc}") from None
    for name in names:
        if name == "*" or hasattr(mod, name):
            continue
        assert _module_exists(f"{module}.{name}"), f"{where}: from {module} import {name}: no such name"


def check_python(block: Block) -> int:
    """Compile the block and resolve its ``moeverify`` imports; the number of imports resolved."""
    code = compile(block.text, block.where(), "exec", flags=ast.PyCF_ONLY_AST, dont_inherit=True)
    compile(code, block.where(), "exec", dont_inherit=True)
    resolved = 0
    for node in ast.walk(code):
        where = block.where(getattr(node, "lineno", 1) - 1)
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "moeverify":
                    _resolve_import(alias.name, [], where)
                    resolved += 1
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "moeverify":
            _resolve_import(node.module, [a.name for a in node.names], where)
            resolved += 1
    return resolved


# ---- the tests ----


def _all_blocks() -> list[Block]:
    return [b for page in PAGES for b in _blocks(page)]


def test_docs_relative_links_resolve_to_files_and_headings():
    problems, checked = [], 0
    for page in PAGES:
        for target in _links(page):
            checked += 1
            problem = _link_problem(page, target)
            if problem:
                problems.append(f"{page.relative_to(ROOT)}: {problem}")
    assert not problems, "\n".join(problems)
    assert checked >= 40, f"only {checked} links found: the link pattern no longer matches the pages"


_CITED_PAGE = re.compile(r"(?<![\w/.-])((?:docs/)?[\w.-]+\.md)\b((?:,? \"[^\"]+\")(?: and \"[^\"]+\")*)?")


def _headings(page: Path) -> frozenset[str]:
    return frozenset(m.group(2) for m in _HEADING.finditer(_FENCE.sub("", page.read_text())))


def test_code_cites_pages_and_headings_that_exist():
    """A page the code's docstrings and comments cite (``docs/export.md, "Subjects"``) exists, and so does every
    heading named after it: a moved or renamed section fails here, not in a reader's hands."""
    problems, checked = [], 0
    for path in sorted((ROOT / "moeverify").rglob("*.py")):
        text = re.sub(r"\s*\n\s*(?:#\s*)?", " ", path.read_text())  # a citation wrapped over lines reads as one
        for m in _CITED_PAGE.finditer(text):
            checked += 1
            page = ROOT / m.group(1) if "/" in m.group(1) or m.group(1) == "README.md" else ROOT / "docs" / m.group(1)
            where = f"{path.relative_to(ROOT)}: {m.group(0)}"
            if not page.is_file():
                problems.append(f"{where}: {page.relative_to(ROOT)} does not exist")
                continue
            named = re.findall(r"\"([^\"]+)\"", m.group(2) or "")
            problems += [
                f"{where}: no heading {h!r} in {page.relative_to(ROOT)}" for h in named if h not in _headings(page)
            ]
    assert not problems, "\n".join(problems)
    assert checked >= 20, f"only {checked} citations found: the pattern no longer matches the code"


def test_docs_shell_commands_parse():
    problems, checked = [], 0
    for block in _all_blocks():
        if block.lang not in SHELLS:
            continue
        for offset, command in _command_lines(block):
            checked += 1
            try:
                check_command(command, block.where(offset))
            except AssertionError as exc:
                problems.append(str(exc))
    assert not problems, "\n".join(problems)
    assert checked >= 50, f"only {checked} commands found in the pages' shell blocks"


def test_docs_python_blocks_compile_and_their_moeverify_imports_resolve():
    blocks = [b for b in _all_blocks() if b.lang == "python"]
    resolved = sum(check_python(b) for b in blocks)
    assert len(blocks) >= 10 and resolved >= 10, (len(blocks), resolved)


def test_docs_readme_stays_a_first_screen_with_the_two_commands_and_three_uses():
    text = (ROOT / "README.md").read_text()
    assert len(text.encode()) <= 12 * 1024, f"README.md is {len(text.encode())} bytes: move detail into docs/"
    assert "make demo" in text and "make test" in text
    for page in ("docs/use-release-suite.md", "docs/use-rl-job.md", "docs/use-dumps.md", "docs/benchmarks.md"):
        assert f"]({page}" in text, f"README.md does not link {page}"


def test_docs_readme_findings_are_the_findings_page_ids():
    ids = set(re.findall(r"\(([A-Z][0-9]+)\)", (ROOT / "README.md").read_text()))
    page = set(re.findall(r"\(([FM][0-9]+)\)", (ROOT / "docs" / "findings.md").read_text()))
    assert ids and ids == page, f"README only: {sorted(ids - page)}; docs/findings.md only: {sorted(page - ids)}"


def _layout_rows() -> dict[str, str]:
    """docs/design.md's layout table: first cell -> the row's text."""
    text = (ROOT / "docs" / "design.md").read_text()
    section = text.split("## Layout of the code", 1)[1].split("\n## ", 1)[0]
    rows = [line.split(" | ", 1) for line in section.splitlines() if line.startswith("| `")]
    return {first.strip("| "): rest for first, rest in rows}


def test_docs_design_layout_table_names_every_folder_package_scenario_file_and_tool():
    rows = _layout_rows()
    named = {name.strip("`") for first in rows for name in re.findall(r"`[^`]+`", first)}
    folders = {p.name + "/" for p in ROOT.iterdir() if p.is_dir() and p.name in SOURCE_DIRS}
    packages = {f"moeverify/{p.parent.name}/" for p in (ROOT / "moeverify").glob("*/__init__.py")}
    missing = sorted(f for f in folders if not any(n.startswith(f) for n in named)) + sorted(packages - named)
    assert not missing, f"docs/design.md's layout table has no row for {missing}"
    for folder in ("scenarios", "tools"):
        entries = {p.name + ("/" if p.is_dir() else "") for p in (ROOT / folder).iterdir() if p.name != "__pycache__"}
        unnamed = sorted(e for e in entries if f"`{e}`" not in rows[f"`{folder}/`"])
        assert not unnamed, f"docs/design.md's layout table: the {folder}/ row does not name {unnamed}"


# ---- the checks themselves: each refuses what it exists to refuse ----


@pytest.mark.parametrize(
    ("command", "match"),
    [
        ("moeverify run scenarios/smoke.yaml --no-such-flag", "unrecognized arguments"),
        ("moeverify dump diff A", "required"),
        ("moeverify run scenarios/no_such.yaml", "scenarios/no_such.yaml does not exist"),
        ("make no-such-target", "no such target"),
        ("python -m moeverify.no_such_module", "no such module"),
        ("torchrun --nproc-per-node 2 -m moeverify.patches.no_such train.py", "no module"),
        ("X=1 python -m moeverify run --backend tpu", "invalid choice"),
        ("srun -N2 moeverify run --bogus", "unrecognized arguments"),
        (".venv/bin/python examples/no_such.py", "does not exist"),
        ("python bench/router_replay.py --scope nowhere", "its parser refuses it"),
        ("python bench/memory.py --layers one", "its parser refuses it"),
        ("moeverify run --subject tests/special_distributed/stale_subject.py:nope", "defines no top-level 'nope'"),
        ("frobnicate --all", "does not know"),
    ],
)
def test_check_command_refuses(command, match):
    with pytest.raises(AssertionError, match=match):
        check_command(command, "page.md:1")


def test_check_command_accepts_the_documented_forms():
    for command in (
        "moeverify run scenarios/release.yaml --list",
        "MOEVERIFY_ROUTER_REPLAY=r2 torchrun --nproc-per-node 8 -m moeverify.patches.autopatch train.py ARGS",
        "python -m torch.distributed.run --nproc-per-node 4 bench/export_oracle.py",
        "srun -N2 --ntasks-per-node=1 moeverify run scenarios/release.yaml --json out.json",
        "make engine-check",
        "python bench/router_replay.py --device cuda --dtype bf16 --scope router --scoring sigmoid --experts 128",
        "moeverify --version",
    ):
        check_command(command, "page.md:1")


def test_link_problem_names_a_missing_file_and_a_missing_heading():
    page = ROOT / "README.md"
    assert _link_problem(page, "https://example.com/x") is None
    assert _link_problem(page, "docs/scenarios.md#several-nodes") is None
    assert "does not exist" in _link_problem(page, "docs/no_such.md")
    assert "no heading with id 'no-such-heading'" in _link_problem(page, "docs/scenarios.md#no-such-heading")


def test_check_python_refuses_a_name_moeverify_lacks():
    block = Block(ROOT / "README.md", 1, "python", "from moeverify.patches import no_such_name\n")
    with pytest.raises(AssertionError, match="no such name"):
        check_python(block)
    with pytest.raises(SyntaxError):
        check_python(Block(ROOT / "README.md", 1, "python", "def f(:\n"))
