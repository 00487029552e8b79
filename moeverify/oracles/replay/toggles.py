"""Settings a built model takes as if it had been built with them: a recompute mode, Megatron-Core's native
``RouterReplay``. They let the replay oracle run the recompute and native_parity subchecks on the build it already
has, instead of building (and at production size restoring 61 GB into) a model per mode.

Version assumptions (megatron-core 0.19.2, checked where they are used and by
``tests/unit/test_replay_toggles.py``, which compares a toggled build with one built with the setting, attribute by
attribute):

- ``TransformerBlock`` reads ``recompute_granularity == "full"`` (and the method and layer count) from its config at
  every forward; selective recompute is fixed at construction, per module: ``MoELayer.moe_layer_recompute`` is
  ``granularity == "selective" and "moe" in recompute_modules`` (the only flag the ``moe`` mode sets);
- ``TopKRouter.__init__`` sets ``router_replay = RouterReplay()`` when ``moe_enable_routing_replay`` is on, else
  None, and ``set_layer_number`` gives it the router's layer number; nothing else of a training pass reads the flag.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

from moeverify.errors import EnvironmentProblem
from moeverify.patches.routers import find_routers
from moeverify.spec.checks import RECOMPUTE_MODES

if TYPE_CHECKING:  # megatron ships no types: Any to mypy, named for the reader
    from megatron.core.transformer.moe.router import TopKRouter

_RECOMPUTE_KEYS = ("recompute_granularity", "recompute_method", "recompute_num_layers", "recompute_modules")


def _configs(chunks: list) -> list:
    return list(
        {
            id(m.config): m.config
            for chunk in chunks
            for m in chunk.modules()
            if hasattr(getattr(m, "config", None), "recompute_granularity")
        }.values()
    )


def _moe_layers(chunks: list) -> list:
    from megatron.core.transformer.moe.moe_layer import MoELayer  # lazy: megatron

    return [m for chunk in chunks for m in chunk.modules() if isinstance(m, MoELayer)]


@contextlib.contextmanager
def recompute(chunks: list, mode: str):
    """``chunks`` run under recompute ``mode`` (``RECOMPUTE_MODES``) for the duration; their settings are put back
    after. Refused on a model built with a recompute mode of its own (the toggle assumes none)."""
    if mode not in RECOMPUTE_MODES:
        raise ValueError(f"unknown recompute mode {mode!r}; expected one of {sorted(RECOMPUTE_MODES)}")
    configs, moe = _configs(chunks), _moe_layers(chunks)
    built = {c.recompute_granularity for c in configs} | {
        bool(m.moe_layer_recompute) for m in moe if hasattr(m, "moe_layer_recompute")
    }
    if built - {None, False}:
        raise EnvironmentProblem(
            f"recompute toggle: the model was built with recompute settings {sorted(map(str, built))}"
            "; expected none (the toggle adds one mode to a model built without)"
        )
    if any(not hasattr(m, "moe_layer_recompute") for m in moe):
        raise EnvironmentProblem(
            "recompute toggle: MoELayer has no moe_layer_recompute attribute; expected "
            "megatron-core 0.19.2's (selective recompute is fixed at construction there)"
        )
    saved = [{k: getattr(c, k) for k in _RECOMPUTE_KEYS} for c in configs]
    try:
        for config in configs:
            for key, value in RECOMPUTE_MODES[mode].items():
                setattr(config, key, value)
        for m in moe:
            m.moe_layer_recompute = m.config.recompute_granularity == "selective" and "moe" in (
                m.config.recompute_modules or ()
            )
        yield
    finally:
        for config, values in zip(configs, saved, strict=True):
            for key, value in values.items():
                setattr(config, key, value)
        for m in moe:
            m.moe_layer_recompute = False


@contextlib.contextmanager
def native_replay(chunks: list):
    """Megatron-Core's own ``RouterReplay`` on every router of ``chunks`` for the duration (what building with
    ``moe_enable_routing_replay`` gives); removed after, from the routers and from ``RouterReplay``'s process-wide
    instance list. Refused on routers that have a replay object already."""
    from megatron.core.transformer.moe.router_replay import RouterReplay  # lazy: megatron

    routers: list[TopKRouter] = [router for _, router in find_routers(chunks).values()]
    taken = [r.layer_number for r in routers if getattr(r, "router_replay", None) is not None]
    if any("router_replay" not in r.__dict__ for r in routers):
        raise EnvironmentProblem(
            "native replay toggle: a TopKRouter has no router_replay attribute; expected "
            "megatron-core 0.19.2's TopKRouter.__init__ (it sets one, None when off)"
        )
    if taken:
        raise EnvironmentProblem(
            f"native replay toggle: routers of layers {taken} have a router_replay object "
            "already; expected a model built without moe_enable_routing_replay"
        )
    made = []
    try:
        for router in routers:
            router.router_replay = RouterReplay()
            made.append(router.router_replay)
            if router.layer_number is not None:  # as TransformerLayer's set_layer_number gave it at construction
                router.set_layer_number(router.layer_number)
        yield
    finally:
        for router in routers:
            router.router_replay = None
        instances = RouterReplay.global_router_replay_instances
        instances[:] = [r for r in instances if not any(r is m for m in made)]
