"""Routing semantics under replay: which router settings replay supports, and a reference.

Legend of shape suffixes: T = tokens, E = experts, K = top-k, G = expert groups.

Replay replaces only the *selection* (which K experts a token goes to). Everything else a router
computes is kept and evaluated on the current weights:
- probabilities are gathered from the dense scores of the current logits at the replayed ids
  (softmax after top-k: softmax over the K gathered logits; softmax before top-k: the gathered
  softmax; sigmoid / sqrtsoftplus: gathered scores normalised over K when K > 1), then scaled by
  ``moe_router_topk_scaling_factor``; the expert bias never enters the probabilities;
- the aux losses (aux_loss, seq_aux_loss, global_aux_loss) are computed by Megatron from the
  logits with its own native top-k, so they do not depend on the replayed ids;
- the z-loss depends on the logits only;
- the expert-bias token counts (``local_tokens_per_expert``) count the *replayed* selection
  (padding rows excluded, the mask applied per token: ``moeverify.patches.token_counts``), so an
  aux-loss-free bias update follows the routes actually used;
- capacity-factor dropping runs after selection on the replayed routing map and probabilities.

``reference_routing`` restates these rules from the maths, independently of Megatron's code, so
tests can decide the right answer without trusting the code under test.

What decides replayability is what Megatron routes by: ``TopKRouter`` copies some settings from its
config when it is built (``ROUTER_COPIES``) and reads only its own copies afterwards, so a config
changed after the build no longer describes the router. ``RoutingMode.from_router`` and
``router_problem`` read those copies, and the config only for what Megatron reads from it per call.
"""

from __future__ import annotations

import dataclasses

import torch

from moeverify.errors import UsageError

SCORE_FUNCTIONS = ("softmax", "sigmoid", "sqrtsoftplus")
# Load-balancing types whose selection goes through the replay hook.
_HOOKED_TYPES = ("aux_loss", "seq_aux_loss", "global_aux_loss", "none")
# Settings megatron-core 0.19.2's TopKRouter copies from its config at build time and routes by afterwards:
# the router's attribute -> the config field it was copied from.
ROUTER_COPIES = {
    "num_experts": "num_moe_experts",
    "topk": "moe_router_topk",
    "routing_type": "moe_router_load_balancing_type",
    "score_function": "moe_router_score_function",
    "enable_expert_bias": "moe_router_enable_expert_bias",
}
# Copies whose disagreement with the config mixes two settings within one routing call or MoE layer (the
# router views logits by config.num_moe_experts and selects router.topk; the dispatcher sizes by the config).
_MUST_AGREE = ("num_experts", "topk")


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class RoutingMode:
    """The router settings that decide how a route becomes probabilities."""

    num_experts: int
    topk: int
    score_function: str = "softmax"
    pre_softmax: bool = False
    num_groups: int | None = None
    group_topk: int | None = None
    scaling_factor: float | None = None
    expert_bias: bool = False
    load_balancing: tuple[str, ...] = ("aux_loss",)
    fused: bool = False
    capacity_factor: float | None = None

    def __post_init__(self) -> None:
        self._validate()

    def _validate(self) -> None:
        if not 1 <= self.topk <= self.num_experts:
            raise UsageError(f"need 1 <= topk <= num_experts, got topk {self.topk}, num_experts {self.num_experts}")
        if self.group_topk and (not self.num_groups or self.num_experts % self.num_groups):
            raise UsageError(
                f"group-limited routing needs num_groups dividing num_experts {self.num_experts}, "
                f"got num_groups {self.num_groups}"
            )

    @classmethod
    def from_config(cls, config) -> RoutingMode:
        """Read the routing settings of a Megatron ``TransformerConfig``."""
        balancing = config.moe_router_load_balancing_type
        return cls(
            num_experts=config.num_moe_experts,
            topk=config.moe_router_topk,
            score_function=config.moe_router_score_function,
            pre_softmax=bool(config.moe_router_pre_softmax),
            num_groups=config.moe_router_num_groups,
            group_topk=config.moe_router_group_topk,
            scaling_factor=config.moe_router_topk_scaling_factor,
            expert_bias=bool(config.moe_router_enable_expert_bias),
            load_balancing=tuple(balancing) if isinstance(balancing, list) else (balancing,),
            fused=bool(config.moe_router_fusion),
            capacity_factor=config.moe_expert_capacity_factor,
        )

    @classmethod
    def from_router(cls, router) -> RoutingMode:
        """The settings a built ``TopKRouter`` routes by: its own copies (``ROUTER_COPIES``), else its config."""
        config = router.config
        return cls(
            num_experts=router.num_experts,
            topk=router.topk,
            score_function=router.score_function,
            pre_softmax=bool(config.moe_router_pre_softmax),
            num_groups=config.moe_router_num_groups,
            group_topk=config.moe_router_group_topk,
            scaling_factor=config.moe_router_topk_scaling_factor,
            expert_bias=getattr(router, "expert_bias", None) is not None,
            load_balancing=balancing_types(router.routing_type),
            fused=bool(config.moe_router_fusion),
            capacity_factor=config.moe_expert_capacity_factor,
        )


def balancing_types(balancing) -> tuple:
    return tuple(balancing) if isinstance(balancing, list | tuple) else (balancing,)


def problem_of(*, score_function: str, load_balancing: tuple, fused: bool) -> str | None:
    if score_function not in SCORE_FUNCTIONS:
        return f"score function {score_function!r} is unknown to router replay; supported: {list(SCORE_FUNCTIONS)}"
    unhooked = [t for t in load_balancing if t not in _HOOKED_TYPES]
    if unhooked:
        return (
            f"load-balancing type(s) {unhooked} select experts outside the replay hook "
            f"(sinkhorn / quantile_balancing); replay supports {list(_HOOKED_TYPES)}"
        )
    if fused:
        return (
            "moe_router_fusion=True takes a fused top-k path that returns before replay is consulted; set "
            "config.moe_router_fusion = False, or build the session with ReplaySession(..., disable_fusion=True)"
        )
    return None


def refuse_unreplayable(mode: RoutingMode, *, where: str) -> None:
    """Raise ``UsageError`` for router settings whose selection would bypass the replay hook."""
    problem = problem_of(score_function=mode.score_function, load_balancing=mode.load_balancing, fused=mode.fused)
    if problem is not None:
        raise UsageError(f"{where}: {problem}")


def router_problem(router, *, fusion: bool = True) -> str | None:
    """Why replay cannot serve ``router`` as Megatron routes it now, or None; cheap enough for every call.

    Reads the router's own copies of its settings (what Megatron routes by), not its config: a router whose
    ``routing_type`` was changed after the build to ``sinkhorn`` routes past the hook whatever the config says.
    ``fusion=False`` leaves the (config-read) fused path to the caller's own check.
    """
    config = router.config
    problem = problem_of(
        score_function=router.score_function,
        load_balancing=balancing_types(router.routing_type),
        fused=fusion and bool(config.moe_router_fusion),
    )
    if problem is not None:
        return f"{problem} (read from the router's own attributes, which Megatron routes by)"
    for name in _MUST_AGREE:
        field = ROUTER_COPIES[name]
        if getattr(router, name) != getattr(config, field):
            return (
                f"the router's {name} = {getattr(router, name)!r} disagrees with its config.{field} = "
                f"{getattr(config, field)!r} (changed after the model was built); Megatron reads both in one "
                f"MoE layer: rebuild the model with the setting you want, or set router.{name} and "
                f"config.{field} alike"
            )
    return None


def _scores(logits_TE: torch.Tensor, mode: RoutingMode) -> torch.Tensor:
    x = logits_TE.double()
    if mode.score_function == "softmax":
        return torch.exp(x - x.max(dim=-1, keepdim=True).values).div_(
            torch.exp(x - x.max(dim=-1, keepdim=True).values).sum(-1, keepdim=True)
        )
    if mode.score_function == "sigmoid":
        return 1.0 / (1.0 + torch.exp(-x))
    return torch.log1p(torch.exp(x)).sqrt()


def _select(select_TE: torch.Tensor, mode: RoutingMode) -> torch.Tensor:
    """Native selection: plain top-k, or top-k inside the best ``group_topk`` groups."""
    T, E = select_TE.shape
    if mode.group_topk:
        assert mode.num_groups  # RoutingMode refuses group_topk without num_groups
        per_group = E // mode.num_groups
        grouped_TGe = select_TE.view(T, mode.num_groups, per_group)
        best = grouped_TGe.sort(dim=-1, descending=True).values[..., : mode.topk // mode.group_topk]
        group_score_TG = best.sum(-1)
        keep_TG = torch.zeros_like(group_score_TG, dtype=torch.bool)
        keep_TG.scatter_(1, group_score_TG.argsort(dim=-1, descending=True)[:, : mode.group_topk], True)
        keep_TE = keep_TG.repeat_interleave(per_group, dim=1)
        select_TE = select_TE.masked_fill(~keep_TE, float("-inf"))
    return select_TE.argsort(dim=-1, descending=True, stable=True)[:, : mode.topk]


def reference_routing(
    logits_TE: torch.Tensor,
    mode: RoutingMode,
    *,
    expert_bias_E: torch.Tensor | None = None,
    topk_ids_TK: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference ``(probs_TK, ids_TK)`` in float64: native selection, or the given ids replayed.

    Ties are broken towards the lower expert id; tests use continuous random logits, where ties
    have probability zero.
    """
    scores_TE = _scores(logits_TE, mode)
    if topk_ids_TK is None:
        if mode.score_function == "softmax" and not mode.pre_softmax:
            select_TE = logits_TE.double()
        else:
            select_TE = scores_TE
        if expert_bias_E is not None and mode.score_function != "softmax":
            select_TE = select_TE + expert_bias_E.double()
        topk_ids_TK = _select(select_TE, mode)
    ids_TK = topk_ids_TK.to(torch.int64)
    if mode.score_function == "softmax" and not mode.pre_softmax:
        probs_TK = torch.softmax(logits_TE.double().gather(1, ids_TK), dim=-1)
    else:
        probs_TK = scores_TE.gather(1, ids_TK)
        if mode.score_function != "softmax" and mode.topk > 1:
            probs_TK = probs_TK / probs_TK.sum(-1, keepdim=True)
    if mode.scaling_factor:
        probs_TK = probs_TK * mode.scaling_factor
    return probs_TK, ids_TK


def dense(probs_TK: torch.Tensor, ids_TK: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(probs_TE, routing_map_TE)``: the dense form Megatron's router returns."""
    probs_TE = torch.zeros(ids_TK.shape[0], num_experts, dtype=probs_TK.dtype).scatter(1, ids_TK, probs_TK)
    map_TE = torch.zeros(ids_TK.shape[0], num_experts, dtype=torch.bool).scatter(1, ids_TK, True)
    return probs_TE, map_TE
