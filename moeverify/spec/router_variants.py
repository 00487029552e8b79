"""Router variants the replay oracles run over: TransformerConfig overrides per named variant.

Every score function megatron-core 0.19.2's ``topk_routing_with_score_function`` offers (softmax
with top-k before or after the softmax, sigmoid, sqrtsoftplus), with and without the aux-loss-free
expert bias, group-limited top-k, padding masks handed to the router, and router scores that tie in every row.
``default`` is the family's own router as its HF config describes it. A scenario runs ``DEFAULT_VARIANTS`` unless its
options say ``router_variants: [...]`` or ``router_variants: full``. Pure Python (no torch): scenario files and the
``router_variants`` option are checked against this table before torchrun starts.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

from moeverify.errors import UsageError


class _Traits(Protocol):  # moeverify.spec.models.traits.ModelTraits, as far as the variants read it
    @property
    def expert_bias(self) -> bool: ...  # read-only: ModelTraits is frozen


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class RouterVariant:
    name: str
    overrides: dict = dataclasses.field(default_factory=dict)
    padding: bool = False  # hand the router a padding mask (last quarter of every second sequence)
    random_expert_bias: bool = False  # give the expert bias seeded non-zero values so it steers routing
    # router weight rows equal in pairs (expert 2j+1's row is expert 2j's): the two experts' logits tie in every
    # row, so the slot order of tied scores is exercised (tied values sum alike, their gradients in slot order)
    tied_scores: bool = False

    def not_applicable(self, family: str, *, traits: _Traits) -> str | None:
        """Why this variant cannot be built for ``family``, a model with ``traits`` (None when it can)."""
        if self.overrides.get("moe_router_enable_expert_bias") and not traits.expert_bias:
            return (
                f"{family}'s HF checkpoint has no expert-bias tensor (e_score_correction_bias) for the bridge to load"
            )
        return None


_PLAIN = dict(
    moe_router_enable_expert_bias=False,
    moe_router_num_groups=None,
    moe_router_group_topk=None,
    moe_router_pre_softmax=False,
    moe_router_topk_scaling_factor=None,
)

VARIANTS: dict[str, RouterVariant] = {
    v.name: v
    for v in (
        RouterVariant(name="default", random_expert_bias=True),
        RouterVariant(name="softmax", overrides=dict(_PLAIN, moe_router_score_function="softmax")),
        RouterVariant(
            name="softmax_pre", overrides=dict(_PLAIN, moe_router_score_function="softmax", moe_router_pre_softmax=True)
        ),
        RouterVariant(name="sigmoid", overrides=dict(_PLAIN, moe_router_score_function="sigmoid")),
        RouterVariant(
            name="sigmoid_bias",
            random_expert_bias=True,
            overrides=dict(_PLAIN, moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True),
        ),
        RouterVariant(name="sqrtsoftplus", overrides=dict(_PLAIN, moe_router_score_function="sqrtsoftplus")),
        RouterVariant(
            name="sqrtsoftplus_bias",
            random_expert_bias=True,
            overrides=dict(_PLAIN, moe_router_score_function="sqrtsoftplus", moe_router_enable_expert_bias=True),
        ),
        RouterVariant(
            name="group_topk",
            overrides=dict(
                _PLAIN, moe_router_score_function="sigmoid", moe_router_num_groups=2, moe_router_group_topk=1
            ),
        ),
        RouterVariant(name="padding", padding=True, random_expert_bias=True),
        RouterVariant(
            name="tied_scores", tied_scores=True, overrides=dict(_PLAIN, moe_router_score_function="softmax")
        ),
    )
}

DEFAULT_VARIANTS: tuple[str, ...] = ("default",)


def select(option: object) -> tuple[RouterVariant, ...]:
    """Variants named by the ``router_variants`` option: None (defaults), ``"full"``, a name or a list."""
    if option is None:
        names = DEFAULT_VARIANTS
    elif option == "full":
        names = tuple(VARIANTS)
    elif isinstance(option, str):
        names = tuple(n.strip() for n in option.split(",") if n.strip())
    elif isinstance(option, list | tuple):
        names = tuple(str(n) for n in option)
    else:
        raise UsageError(f"router_variants must be 'full', a name or a list of names, got {option!r}")
    unknown = [n for n in names if n not in VARIANTS]
    if unknown or not names:
        raise UsageError(f"unknown router variant(s) {unknown or names}; known: {', '.join(VARIANTS)}, or 'full'")
    return tuple(VARIANTS[n] for n in names)
