"""``ModelRef``: which model a scenario runs, as a value that travels in the plan to every rank.

A model is either a built-in family (``FAMILIES``, by name) or a user model: an HF model directory or a
``config.json`` (an absolute path) with ``--model-set`` overrides. The reference is all a process needs to
read the same model again (``configs.hf_config_dict`` / ``family_shape`` / ``family_traits``,
``families.hf_checkpoint``, ``builder.build`` take it): there is no registry of models, and a model is never
looked up by its name. ``key`` is the name it is shown and reported under (``qwen3_moe``, ``model:NAME`` or
``model:NAME+HASH``); two user models of one key in one run are refused by ``scenario.load``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from moeverify.errors import UsageError

PREFIX = "model:"


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelRef:
    """A built-in family (``family``) or a user model (``path``, absolute, and its ``overrides``)."""

    family: str | None = None
    path: str | None = None
    overrides: tuple[tuple[str, Any], ...] = ()  # sorted by key; values as JSON reads them

    def __post_init__(self) -> None:
        if (self.family is None) == (self.path is None):
            raise ValueError(f"ModelRef needs a family or a path, not both or neither (got {self!r})")
        if self.family is not None and self.overrides:
            raise ValueError(f"ModelRef: a built-in family takes no overrides (got {self!r})")

    def __hash__(self) -> int:  # overrides may hold lists: hashed through their JSON form
        return hash((self.family, self.path, json.dumps(self.overrides, sort_keys=True)))

    @classmethod
    def builtin(cls, family: str) -> ModelRef:
        return cls(family=family)

    @classmethod
    def user(cls, path: str | Path, overrides: Mapping[str, Any] | None = None) -> ModelRef:
        return cls(path=os.path.abspath(path), overrides=tuple(sorted((overrides or {}).items())))

    @property
    def is_user(self) -> bool:
        return self.path is not None

    @property
    def user_path(self) -> Path:
        """A user model's path (``UsageError`` for a family, which has none)."""
        if self.path is None:
            raise UsageError(f"{self.key}: a built-in family, not a user model: it has no path")
        return Path(self.path)

    @property
    def name(self) -> str:
        """The family, or the user model's directory name (the config file's directory for a file)."""
        if self.family is not None:
            return self.family
        path = self.user_path
        return (path.parent if path.is_file() else path).name

    @property
    def key(self) -> str:
        """The name scenarios are shown under: the family, ``model:NAME`` or ``model:NAME+HASH``."""
        if self.family is not None:
            return self.family
        name = re.sub(r"[^A-Za-z0-9._-]+", "-", self.name) or "model"
        if not self.overrides:
            return f"{PREFIX}{name}"
        digest = hashlib.sha256(json.dumps(self.overrides, sort_keys=True).encode()).hexdigest()[:6]
        return f"{PREFIX}{name}+{digest}"

    def to_dict(self) -> dict | None:
        """The plan's JSON form of a user model (``{"path", "set"}``); None for a built-in family."""
        return {"path": self.path, "set": dict(self.overrides)} if self.is_user else None

    @classmethod
    def from_dict(cls, key: str, data: Mapping | None) -> ModelRef:
        """Inverse of ``to_dict``, with the scenario's ``key`` (a family's name when ``data`` is None)."""
        return cls.builtin(key) if data is None else cls.user(data["path"], dict(data.get("set") or {}))


def as_ref(model: str | ModelRef) -> ModelRef:
    """``model`` as a reference: a string names a built-in family (a user model travels as its ``ModelRef``)."""
    return model if isinstance(model, ModelRef) else ModelRef.builtin(model)
