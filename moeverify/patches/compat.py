"""Which Megatron-Core routing code layout is installed, checked before anything is patched.

The patch hooks ``TopKRouter.routing`` and hands Megatron's own routing function a replay object
through its ``router_replay=`` argument (the hook Megatron-Core 0.16+ consults inside
``topk_routing_with_score_function``). Everything the patch relies on is checked here, by
signature and attribute, so an unknown layout fails loudly with what was expected instead of
routing natively while the caller believes it replays.

Layouts read: megatron-core 0.16.0, 0.17.0, 0.18.0 and 0.19.2 all have ``TopKRouter.routing(self,
logits, padding_mask=None)`` passing ``router_replay=self.router_replay`` to
``topk_routing_with_score_function``, and ``TopKRouter.__init__`` setting ``self.router_replay``;
0.15.0 has no replay hook and is refused.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any

from moeverify.errors import EnvironmentProblem

# Names Megatron passes to ``router_replay.get_replay_topk`` and the topk function's keywords.
_TOPK_PARAMS = (
    "logits",
    "topk",
    "use_pre_softmax",
    "num_groups",
    "group_topk",
    "scaling_factor",
    "score_function",
    "expert_bias",
    "fused",
    "router_replay",
)
_REPLAY_CALL = "router_replay=self.router_replay"


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class RouterApi:
    """The Megatron-Core objects the patch touches, found and checked once."""

    version: str
    router_cls: type  # megatron.core.transformer.moe.router.TopKRouter
    routing: Any  # the unpatched TopKRouter.routing function
    native_replay_cls: type | None  # megatron.core.transformer.moe.router_replay.RouterReplay


def megatron_version() -> str:
    try:
        from megatron.core import package_info  # lazy: megatron
    except ImportError as exc:  # pragma: no cover - the project pins megatron-core
        raise EnvironmentProblem(f"router replay needs megatron-core >= 0.16 installed; import failed: {exc}") from exc
    return str(package_info.__version__)


def _check_routing_signature(routing: Any, version: str) -> None:
    params = list(inspect.signature(routing).parameters)
    if params[:2] != ["self", "logits"]:
        raise EnvironmentProblem(
            f"megatron-core {version}: TopKRouter.routing parameters {params} != expected "
            "(self, logits, padding_mask=None); this code layout is not supported by the router-replay patch"
        )


def _check_topk_function(moe_utils: Any, version: str) -> None:
    fn = getattr(moe_utils, "topk_routing_with_score_function", None)
    if fn is None:
        raise EnvironmentProblem(
            f"megatron-core {version}: moe_utils.topk_routing_with_score_function not found; expected the "
            "routing function of megatron-core 0.16-0.19"
        )
    missing = [p for p in _TOPK_PARAMS if p not in inspect.signature(fn).parameters]
    if missing:
        raise EnvironmentProblem(
            f"megatron-core {version}: topk_routing_with_score_function lacks parameter(s) {missing}; "
            "the router-replay hook needs megatron-core >= 0.16 (its router_replay= argument)"
        )


def _check_router_source(routing: Any, version: str) -> None:
    try:
        source = inspect.getsource(routing)
    except (OSError, TypeError) as exc:
        raise EnvironmentProblem(f"megatron-core {version}: cannot read TopKRouter.routing source: {exc}") from exc
    if _REPLAY_CALL not in source:
        raise EnvironmentProblem(
            f"megatron-core {version}: TopKRouter.routing does not pass `{_REPLAY_CALL}` to its top-k "
            "function; the replay hook would never be consulted (expected megatron-core 0.16-0.19 layout)"
        )


def detect(*, allow_replaced: bool = False) -> RouterApi:
    """Find and check the routing entry point; raise ``EnvironmentProblem`` naming what was expected.

    Args:
        allow_replaced: accept a ``TopKRouter.routing`` that is already this project's patch.
    """
    version = megatron_version()
    import torch  # lazy: torch

    if not callable(getattr(torch._C, "_current_graph_task_id", None)):
        raise EnvironmentProblem(
            f"torch {torch.__version__}: torch._C._current_graph_task_id is missing; router "
            "replay needs it to tell a recompute (inside backward) from a forward"
        )
    from moeverify.patches import regions  # lazy: torch (deferred: pulls in torch's autograd/multiprocessing machinery)

    problem = regions.probe()
    if problem is not None:
        raise EnvironmentProblem(
            f"torch {torch.__version__}: {problem}; router replay matches a recompute to its "
            "forward through torch's checkpoint regions (torch 2.14 layout expected)"
        )
    try:
        from megatron.core.transformer.moe import moe_utils  # lazy: megatron
        from megatron.core.transformer.moe import router as router_mod  # lazy: megatron
    except ImportError as exc:
        raise EnvironmentProblem(f"megatron-core {version}: cannot import transformer.moe.router: {exc}") from exc
    router_cls = getattr(router_mod, "TopKRouter", None)
    if router_cls is None or not callable(getattr(router_cls, "routing", None)):
        raise EnvironmentProblem(
            f"megatron-core {version}: megatron.core.transformer.moe.router.TopKRouter.routing not found"
        )
    routing = router_cls.__dict__.get("routing")
    original = getattr(routing, "__moeverify_original__", None)
    if original is not None and allow_replaced:
        routing = original
    elif getattr(routing, "__module__", None) != router_mod.__name__:
        raise EnvironmentProblem(
            f"megatron-core {version}: TopKRouter.routing was replaced by {getattr(routing, '__module__', '?')}."
            f"{getattr(routing, '__qualname__', '?')} (expected megatron's own); another router-replay patch "
            "(e.g. verl's router_replay_patch) is active in this process: run it in a separate process"
        )
    _check_routing_signature(routing, version)
    _check_topk_function(moe_utils, version)
    _check_router_source(routing, version)
    try:
        from megatron.core.transformer.moe.router_replay import RouterReplay as native  # lazy: megatron
    except ImportError:
        native = None
    return RouterApi(version=version, router_cls=router_cls, routing=routing, native_replay_cls=native)
