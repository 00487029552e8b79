"""A user's plugin loaded for real before any rank starts, in a child Python, as a rank would load it.

``plugins.check`` reads a plugin's source without running it (a missing module or file, a syntax error, no such
top-level name). What only running it can tell, an import that raises or an attribute that is not callable, would
otherwise end every rank inside moeverify's own frames. ``probe`` runs ``plugins.load`` in a child process
(``python -m moeverify.runner.probe``: the launching process stays torch-free and runs none of the user's code) from
the directory and with the ``PYTHONPATH`` the ranks get, and turns its refusal into a ``UsageError`` (exit 2).

A rank loads plugins after importing Megatron-Bridge (through ``runtime.import_bridge``, which works where
Transformer Engine is absent): a plugin whose bare import failed on an ``ImportError`` is loaded again after that
import, and only a second refusal counts, so a plugin that imports ``megatron.bridge`` itself is not refused where
the ranks would load it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

import moeverify
from moeverify.errors import UsageError
from moeverify.spec import plugins, timeouts

_MARK = "moeverify-probe: "  # the child's verdict line (the plugin may print too)
_BRIDGED = "moeverify-probe: megatron.bridge imported\n"  # on stderr: what the plugin printed comes after it
_TAIL = 1500


def probe(spec: str, *, what: str, builtins: Mapping[str, str] | None = None) -> None:
    """Refuse (``UsageError``) a plugin ``spec`` whose loading on a rank would raise; a built-in name passes."""
    if isinstance(spec, str) and spec in (builtins or {}):
        return
    verdict = _child(spec, what=what, bridge=False)
    if verdict is not None and verdict.get("import_error"):
        verdict = _child(spec, what=what, bridge=True)
    if verdict is not None:
        raise UsageError(verdict["error"])


def _child(spec: str, *, what: str, bridge: bool) -> dict | None:
    """The child's refusal (``{"error": message, "import_error": bool}``), or None when it loaded ``spec``."""
    env = dict(os.environ)
    root = str(Path(moeverify.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
    limit = timeouts.STARTUP_S
    cmd = [sys.executable, "-m", "moeverify.runner.probe", what, spec, *(["--bridge"] if bridge else [])]
    try:
        proc = subprocess.run(
            cmd, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True, errors="replace", timeout=limit
        )
    except subprocess.TimeoutExpired:
        return {
            "error": f"{what} {spec!r}: loading it did not finish within {limit:.0f} s "
            "(MOEVERIFY_STARTUP_TIMEOUT_S, a rank's start-up): an import that waits for something?"
        }
    verdicts = [line[len(_MARK) :] for line in proc.stdout.splitlines() if line.startswith(_MARK)]
    if proc.returncode == 0 and verdicts:
        return None
    if verdicts:
        return json.loads(verdicts[-1])
    output = proc.stderr or proc.stdout
    tail = output[output.rfind(_BRIDGED) + len(_BRIDGED) :] if _BRIDGED in output else output  # not the bridge's
    tail = tail.strip()[-_TAIL:]
    return {
        "error": f"{what} {spec!r}: loading it ended the process (exit code {proc.returncode}) before it "
        "could report" + (f"; its output ends with:\n{tail}" if tail else "")
    }


def main(argv: list[str] | None = None) -> int:
    """``python -m moeverify.runner.probe WHAT SPEC [--bridge]``: load SPEC, print the verdict line, exit 0 or 2."""
    argv = sys.argv[1:] if argv is None else argv
    what, spec, bridge = argv[0], argv[1], "--bridge" in argv[2:]
    try:
        if bridge:
            from moeverify.runtime import import_bridge  # lazy: torch, megatron (what a rank has imported)

            import_bridge()
            print(_BRIDGED, end="", file=sys.stderr, flush=True)
        plugins.load(spec, what=what)
        if what == "replay implementation":  # a factory of no argument: what it returns is checked here too
            _made_replay_impl(spec)
    except UsageError as exc:
        print(
            _MARK + json.dumps({"error": str(exc), "import_error": isinstance(exc.__cause__, ImportError)}), flush=True
        )
        return 2
    print(_MARK + json.dumps({"ok": True}), flush=True)
    return 0


def _made_replay_impl(spec: str) -> None:
    """Call a replay implementation's factory as the oracle does (``impls.make_impl``): one that raises, or returns
    no ``ReplayImpl``, is refused before any rank starts (a rank would end on it)."""
    from moeverify.oracles.replay.impls import make_impl  # lazy: torch, megatron

    try:
        make_impl(spec)
    except UsageError:
        raise
    except Exception as exc:  # noqa: BLE001 (the user's factory: whatever it raises is the finding)
        raise UsageError(f"replay implementation {spec!r}: its factory raised {type(exc).__name__}: {exc}") from exc


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    os._exit(code)  # the verdict is out: threads or exit handlers the plugin started do not hold the launch
