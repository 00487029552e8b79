"""Shared pytest setup: markers, and the repository root for tests that run files from it."""

from __future__ import annotations

from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "distributed: runs real torchrun groups (tests/special_distributed)")
    config.addinivalue_line(
        "markers",
        "timing: waits on a child process, a thread, a signal or the clock; `make "
        "test-load` runs these with the CPUs busy (tests/unit/waiting.py)",
    )


@pytest.fixture
def repo_root() -> Path:
    return REPO_ROOT
