"""Import megatron.bridge where Transformer Engine's torch extension does not exist.

megatron-bridge 0.6.2 imports ``transformer_engine.pytorch`` unconditionally in exactly one module on its
import path, ``megatron/bridge/peft/lora_layers.py`` (LoRA fused branches and type hints only). We serve
a placeholder to that one importer, and remove it from ``sys.modules`` right after the import, so that
megatron-core keeps seeing no TE (a placeholder visible to megatron-core would make it believe TE exists:
it reads ``te.__version__``). Where real TE is importable it is used untouched.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types

_TE_IMPORTER = "megatron.bridge.peft.lora_layers"  # the one importer, as of megatron-bridge 0.6.2
_TE_NAMES = ("transformer_engine", "transformer_engine.pytorch")


def real_te_available() -> bool:
    """True when Transformer Engine and its compiled torch extension are importable."""
    if "transformer_engine" in sys.modules and getattr(
        sys.modules["transformer_engine"], "_moeverify_placeholder", False
    ):
        return False
    return (
        importlib.util.find_spec("transformer_engine") is not None
        and importlib.util.find_spec("transformer_engine_torch") is not None
    )


class _PlaceholderMeta(type):
    """Any attribute of a placeholder class is another placeholder class (``te.ops.Sequential``)."""

    def __getattr__(cls, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        sub = _PlaceholderMeta(name, (), {"__module__": "transformer_engine (placeholder)"})
        setattr(cls, name, sub)
        return sub


class _PlaceholderModule(types.ModuleType):
    _moeverify_placeholder = True

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        value = _PlaceholderMeta(name, (), {"__module__": self.__name__})
        setattr(self, name, value)
        return value


class _Loader(importlib.abc.Loader):
    def create_module(self, spec):
        module = _PlaceholderModule(spec.name)
        module.__path__ = []  # a package, so ``transformer_engine.pytorch`` resolves under it
        return module

    def exec_module(self, module) -> None:
        pass


def _importer_name() -> str | None:
    """``__name__`` of the first frame outside importlib: the module whose import statement is running."""
    frame: types.FrameType | None = sys._getframe(2)
    while frame is not None:
        if not frame.f_code.co_filename.startswith("<frozen importlib"):
            return frame.f_globals.get("__name__")
        frame = frame.f_back
    return None


class _ScopedFinder(importlib.abc.MetaPathFinder):
    """Serves the TE placeholder only when the importer is ``_TE_IMPORTER``."""

    served = False

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in _TE_NAMES or _importer_name() != _TE_IMPORTER:
            return None
        self.served = True
        return importlib.machinery.ModuleSpec(fullname, _Loader(), is_package=True)


def import_bridge():
    """Import and return ``megatron.bridge`` (idempotent)."""
    if "megatron.bridge" in sys.modules:
        return sys.modules["megatron.bridge"]
    if real_te_available():
        return importlib.import_module("megatron.bridge")
    finder = _ScopedFinder()
    sys.meta_path.insert(0, finder)
    try:
        bridge = importlib.import_module("megatron.bridge")
    finally:
        sys.meta_path.remove(finder)
        for name in _TE_NAMES:
            module = sys.modules.get(name)
            if module is not None and getattr(module, "_moeverify_placeholder", False):
                del sys.modules[name]
    return bridge
