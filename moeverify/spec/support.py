"""The package versions moeverify supports, declared once (``pyproject.toml`` declares the same ranges, a unit test
keeps them equal; ``requirements/`` is the exact lock CI runs).

Tested: the lock (torch 2.14.1, megatron-core 0.19.2, megatron-bridge 0.6.2, transformers 5.12.1) on CPU ranks
in every CI run, and torch 2.11.0+cu130 with the same megatron stack on one H200 (docs/gpu/). The router-replay
patch reads megatron-core 0.16-0.19 (``moeverify.patches.compat``); the oracles build models through
megatron-bridge 0.6, which needs megatron-core 0.19.
"""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class Supported:
    dist: str
    low: str  # inclusive
    high: str  # exclusive
    required: bool = True

    def spec(self) -> str:
        return f">={self.low},<{self.high}"

    def admits(self, version: str) -> bool:
        return release(self.low) <= release(version) < release(self.high)


SUPPORTED: tuple[Supported, ...] = (
    Supported("torch", "2.11", "2.15"),
    Supported("megatron-core", "0.19", "0.20"),
    Supported("transformers", "5.12", "6"),
    Supported("megatron-bridge", "0.6.2", "0.7"),  # an extra: installed with --no-deps (README)
    Supported("verl", "0.9.1", "0.10", required=False),  # an optional peer: the `verl` subject and replay impl
)


def release(version: str) -> tuple[int, ...]:
    """The numeric release of a version string: ``"2.11.0+cu130"`` -> ``(2, 11, 0)``, ``"0.19.2rc1"`` ->
    ``(0, 19, 2)``."""
    found = re.match(r"\s*v?(\d+(?:\.\d+)*)", version)
    if not found:
        raise ValueError(f"not a version: {version!r}")
    parts = [int(p) for p in found.group(1).split(".")]
    while len(parts) > 1 and parts[-1] == 0:
        parts.pop()
    return tuple(parts)


def check(installed: dict[str, str]) -> list[str]:
    """Problems of ``{dist: version or "not installed"}`` against ``SUPPORTED`` (empty: all supported)."""
    problems = []
    for item in SUPPORTED:
        version = installed.get(item.dist, "not installed")
        if version == "not installed":
            if item.required:
                problems.append(f"{item.dist} is not installed (supported {item.spec()})")
        elif not item.admits(version):
            problems.append(f"{item.dist} {version} is outside the supported range {item.spec()}")
    return problems
