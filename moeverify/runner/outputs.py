"""The run's result files (``--json``, ``--junit``): checked before anything runs, kept current after every
result, and written on every way out (a passing run, a failure, Ctrl-C or SIGTERM).

Each write goes to a temporary file beside the target and is renamed over it, so a reader (or a crash
of the parent) sees the previous complete file or the new one, never half of one.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from moeverify.errors import UsageError
from moeverify.files import atomic_write, check_output_file
from moeverify.runner import junit, report


class Outputs:
    """``--json`` and ``--junit`` of one run. ``Outputs(...)`` refuses bad paths (exit 2) and writes an
    empty result list to each, so a run that cannot keep its results never starts."""

    def __init__(self, *, json_path: str | None, junit_path: str | None):
        self._targets: list[tuple[str, Path]] = []
        if json_path:
            self._targets.append(("--json", check_output_file("--json", json_path)))
        if junit_path:
            self._targets.append(("--junit", check_output_file("--junit", junit_path)))
        if len({p for _, p in self._targets}) < len(self._targets):
            raise UsageError("--json and --junit name the same file; give them different paths")
        try:
            self.write([])
        except OSError as exc:
            raise UsageError(f"cannot write the result files: {exc}") from None

    def write(self, results: Sequence[report.Result]) -> None:
        for flag, path in self._targets:
            atomic_write(path, report.to_json(results) if flag == "--json" else junit.to_bytes(results))
