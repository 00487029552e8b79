"""The plan file that a parent hands to one torchrun attempt, and the files the ranks write back.

An attempt directory holds ``plan.json`` (scenarios, options, backend, timeout, first index),
``results.jsonl`` (rank 0: one line per finished check) and per rank ``rank{R}.events.jsonl``
(start/end of every check, with the rank's peak RSS) and ``rank{R}.stacks.txt`` (empty unless the
rank raised, hung or crashed: then its traceback or all its thread stacks).
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from moeverify.spec.scenario import Scenario, scenario_from_dict, scenario_to_dict


@dataclasses.dataclass(frozen=True, kw_only=True)
class Plan:
    """What one torchrun attempt runs: ``scenarios[start:]`` with run-wide ``options``."""

    scenarios: tuple[Scenario, ...]
    options: Mapping[str, Any]
    backend: str  # "cpu" | "cuda"
    timeout_s: float  # per scenario, enforced on every rank by a watchdog
    start: int = 0

    def write(self, directory: Path) -> Path:
        path = Path(directory) / "plan.json"
        data = {
            "scenarios": [scenario_to_dict(s) for s in self.scenarios],
            "options": dict(self.options),
            "backend": self.backend,
            "timeout_s": self.timeout_s,
            "start": self.start,
        }
        path.write_text(json.dumps(data, indent=1))
        return path

    @classmethod
    def read(cls, path: str | Path) -> Plan:
        data = json.loads(Path(path).read_text())
        return cls(
            scenarios=tuple(scenario_from_dict(s) for s in data["scenarios"]),
            options=data["options"],
            backend=data["backend"],
            timeout_s=float(data["timeout_s"]),
            start=int(data["start"]),
        )


def results_path(directory: Path) -> Path:
    return Path(directory) / "results.jsonl"


def events_path(directory: Path, rank: int) -> Path:
    return Path(directory) / f"rank{rank}.events.jsonl"


def stacks_path(directory: Path, rank: int) -> Path:
    return Path(directory) / f"rank{rank}.stacks.txt"


def append_line(path: Path, data: Mapping) -> None:
    """Append one JSON line and make it durable: a rank may be killed right after."""
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(data) + "\n")
        f.flush()
        os.fsync(f.fileno())


def read_lines(path: Path) -> Iterator[dict]:
    """JSON lines written so far; a torn last line (rank killed mid-write) is ignored."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        return
    for line in text.splitlines():
        try:
            yield json.loads(line)
        except json.JSONDecodeError:
            continue
