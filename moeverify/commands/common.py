"""What the commands share: exit codes, the repository root, output path flags and the ``--model``/``--model-set``
flags."""

from __future__ import annotations

import argparse
from pathlib import Path

from moeverify.errors import UsageError
from moeverify.spec.models import user
from moeverify.spec.models.ref import ModelRef

EXIT_USAGE = 2
EXIT_INTERRUPTED = 130
REPO_ROOT = Path(__file__).resolve().parents[2]


def output_path(text: str) -> str:
    """argparse ``type`` of every flag or argument naming a file or directory to write: an empty path is refused
    (it would silently write nothing, or the current directory)."""
    if not text.strip():
        raise argparse.ArgumentTypeError(f"expected a path to write, got {text!r}")
    return text


def user_model_ref(args) -> ModelRef | None:
    """``--model`` with its ``--model-set`` overrides, read and checked (None without --model)."""
    if args.model_set and not args.model:
        raise UsageError("--model-set overrides the config of --model PATH; give --model")
    if not args.model:
        return None
    return user.read(args.model, user.parse_sets(args.model_set)).ref
