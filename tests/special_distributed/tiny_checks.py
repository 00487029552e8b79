"""The environment under which ``moeverify run`` (and every rank it starts) knows the tiny checks of
``test_runner_checks.py``: ``tiny_checks_site/sitecustomize.py`` registers them at interpreter start-up."""

from __future__ import annotations

import os
from pathlib import Path

HERE = Path(__file__).resolve().parent


def env() -> dict[str, str]:
    """``os.environ`` with the tiny-checks hook and ``test_runner_checks`` importable."""
    paths = [str(HERE / "tiny_checks_site"), str(HERE), os.environ.get("PYTHONPATH", "")]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p)}
