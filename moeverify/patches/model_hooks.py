"""Forward hooks on every Megatron ``GPTModel`` built while installed: the one patch of ``GPTModel.__init__``.

Autopatch needs each model-chunk forward's inputs (token identity: ``identity.py`` for whole-job record/replay,
``injob.py`` for in-job R2/R3). Models built before ``install`` get no hooks; models built meanwhile keep theirs
after ``uninstall`` (a hook consults its owner, which goes quiet when uninstalled).
"""

from __future__ import annotations

from collections.abc import Callable


class ModelInitHooks:
    """Patches ``GPTModel.__init__`` (reversibly) so that every model built afterwards registers ``pre_hook``
    (``(chunk, args, kwargs)``) and, if given, ``post_hook`` (``(chunk, args, kwargs, output)``, always called)."""

    def __init__(self, pre_hook: Callable, post_hook: Callable | None = None):
        self._pre, self._post = pre_hook, post_hook
        self._original = None

    def install(self) -> None:
        from megatron.core.models.gpt.gpt_model import GPTModel  # lazy: megatron

        if self._original is not None:
            return
        original = self._original = GPTModel.__init__
        pre, post = self._pre, self._post

        def __init__(model, *args, **kwargs):
            original(model, *args, **kwargs)
            model.register_forward_pre_hook(pre, with_kwargs=True)
            if post is not None:
                model.register_forward_hook(post, with_kwargs=True, always_call=True)

        __init__.__wrapped__ = original  # type: ignore[attr-defined]  # undone by uninstall()
        GPTModel.__init__ = __init__

    def uninstall(self) -> None:
        if self._original is not None:
            from megatron.core.models.gpt.gpt_model import GPTModel  # lazy: megatron

            GPTModel.__init__ = self._original
            self._original = None
