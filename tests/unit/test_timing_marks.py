"""Every unit test that waits on a child process, a thread, a signal or the clock carries the ``timing`` marker, so
``make test`` runs it with the CPUs busy (``make test-load``) and a bound that only holds on an idle host shows up
there, not on a user's loaded machine. A test waits when its body, or a function of its module it calls, sleeps,
sets a timeout, reads a clock or an alarm."""

from __future__ import annotations

import ast
from pathlib import Path

# Calls that wait or read a clock, and the keyword that bounds a wait (``subprocess.run(..., timeout=)``, ``.get``).
WAIT_CALLS = {"sleep", "monotonic", "perf_counter", "alarm", "setitimer", "communicate", "Popen", "pthread_kill"}
WAIT_KEYWORDS = {"timeout"}


# Objects whose ``sleep`` is not the clock: an inference engine's sleep mode (``receiver.sleep()``, vLLM's API).
NOT_CLOCKS = {"receiver", "engine", "llm"}


def _waits(fn: ast.AST) -> bool:
    for call in (n for n in ast.walk(fn) if isinstance(n, ast.Call)):
        name = call.func.attr if isinstance(call.func, ast.Attribute) else getattr(call.func, "id", "")
        owner = getattr(call.func.value, "id", "") if isinstance(call.func, ast.Attribute) else ""
        if owner in NOT_CLOCKS:
            continue
        if name in WAIT_CALLS or any(k.arg in WAIT_KEYWORDS for k in call.keywords):
            return True
    return False


def _marked(decorators) -> bool:
    return any("timing" in ast.unparse(d) for d in decorators)


def unmarked_waits(text: str) -> list[str]:
    """Names of the test functions of a module's source that wait without the ``timing`` marker."""
    tree = ast.parse(text)
    if any(
        isinstance(n, ast.Assign)
        and any(getattr(t, "id", "") == "pytestmark" for t in n.targets)
        and "timing" in ast.unparse(n.value)
        for n in tree.body
    ):
        return []
    functions = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}
    waits = {name for name, fn in functions.items() if _waits(fn)}
    out = []
    for name, fn in functions.items():
        if not name.startswith("test_") or _marked(fn.decorator_list):
            continue
        called = {c.func.id for c in ast.walk(fn) if isinstance(c, ast.Call) and isinstance(c.func, ast.Name)}
        if name in waits or called & (waits - {name}):
            out.append(name)
    return out


def test_every_waiting_unit_test_is_marked_timing():
    here = Path(__file__).parent
    found = {p.name: bad for p in sorted(here.glob("test_*.py")) if (bad := unmarked_waits(p.read_text()))}
    assert found == {}, "mark these @pytest.mark.timing (and bound their waits with tests/unit/waiting.py)"


def test_the_finder_sees_a_wait_in_a_helper_and_accepts_a_marker():
    text = (
        "import time\ndef _helper():\n    time.sleep(1)\ndef test_a():\n    _helper()\n"
        "@pytest.mark.timing\ndef test_b():\n    time.sleep(1)\ndef test_c():\n    pass\n"
    )
    assert unmarked_waits(text) == ["test_a"]
    assert unmarked_waits("pytestmark = pytest.mark.timing\n" + text) == []


def test_an_engine_sleep_mode_is_not_the_clock():
    assert unmarked_waits("def test_a():\n    receiver.sleep()\n    receiver.wake_up()\n") == []
    assert unmarked_waits("def test_a():\n    time.sleep(0.1)\n") == ["test_a"]
