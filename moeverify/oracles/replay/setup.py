"""What the replay oracles share: exact builds, per-variant setup, guarded subchecks.

A ``Setup`` is what every subcheck of one router variant needs on this rank: the options, the
implementation under test, the variant, the scenario layout and this rank's micro-batches. Models
are built in fp32 without dropout (``build``), so passes can be compared bit for bit.
"""

from __future__ import annotations

import dataclasses
import gc

import torch

from moeverify import models, views
from moeverify.checks import ReplayOptions
from moeverify.errors import RankDisagreement
from moeverify.layout import Layout
from moeverify.models import family_shape, hf_config_dict
from moeverify.oracles.replay import drive as rd
from moeverify.oracles.replay.impls import ReplayImpl
from moeverify.patches.routers import find_routers
from moeverify.oracles.results import Tally
from moeverify.router_variants import RouterVariant
from moeverify.runtime.agreement import agree

# fp32, no dropout: bit-for-bit comparisons need deterministic, full-precision passes
_EXACT = dict(bf16=False, fp16=False, params_dtype=torch.float32, pipeline_dtype=torch.float32,
              hidden_dropout=0.0, attention_dropout=0.0)


@dataclasses.dataclass(kw_only=True)
class Setup:
    """What every subcheck of one variant shares on this rank."""

    ctx: object
    opts: ReplayOptions
    impl: ReplayImpl
    variant: RouterVariant
    layout: Layout
    coords: views.RankCoords
    batches: rd.Batches
    items: list

    @property
    def prefix(self) -> str:
        return f"[{self.variant.name}] "

    def stage_moe_layers(self) -> tuple[int, ...]:
        """The MoE decoder layers this rank's pipeline stage holds (none on a dense stage)."""
        shape = family_shape(self.ctx.scenario.model)
        return views.layers_of(self.layout, pp_rank=self.coords.pp, num_layers=shape.num_layers,
                               moe_layers=shape.moe_layers)


def build(setup: Setup, layout: Layout, *, overrides: dict, extra: dict | None = None) -> list:
    scenario = setup.ctx.scenario
    built = models.build(scenario.model, layout, seed=scenario.seed,
                         overrides={**_EXACT, **setup.variant.overrides, **overrides, **(extra or {})})
    if setup.variant.random_expert_bias:
        _seed_expert_bias(built.model_chunks, seed=scenario.seed)
    return built.model_chunks


def _seed_expert_bias(chunks: list, *, seed: int) -> None:
    """Seeded non-zero expert biases (a fresh model's are zeros, which would not steer routing)."""
    for layer, (_, router) in find_routers(chunks).items():
        if router.expert_bias is not None:
            gen = torch.Generator().manual_seed(7919 * (seed + 1) + layer)
            with torch.no_grad():
                router.expert_bias.copy_(0.1 * torch.randn(router.expert_bias.shape, generator=gen))


def perturb_routers(chunks: list, *, seed: int) -> None:
    """Add seeded noise of the weights' own scale to every router weight (identical on every rank)."""
    for layer, (_, router) in find_routers(chunks).items():
        gen = torch.Generator().manual_seed(104_729 * (seed + 1) + layer)
        with torch.no_grad():
            w = router.weight
            w.add_(w.detach().float().std() * torch.randn(w.shape, generator=gen).to(w.device, w.dtype))


def num_layers(chunks: list) -> int:
    return int(chunks[0].config.num_layers)


def make_setup(ctx, opts: ReplayOptions, impl: ReplayImpl, variant: RouterVariant, coords: views.RankCoords) -> Setup:
    scenario, layout = ctx.scenario, ctx.scenario.layout
    batches = rd.Batches(seq_len=opts.seq_len, batch=opts.batch, microbatches=opts.num_microbatches(layout),
                         dp=layout.dp(ctx.world_size), vocab_size=_vocab_size(scenario.model), seed=scenario.seed,
                         padding=variant.padding)
    items = rd.local_microbatches(batches, layout, dp_rank=coords.dp, cp_rank=coords.cp)
    return Setup(ctx=ctx, opts=opts, impl=impl, variant=variant, layout=layout, coords=coords,
                 batches=batches, items=items)


def release(impl) -> None:
    """Free the model ``impl`` was bound to (and whatever the caller dropped) before the next build: ``unbind``, then
    a collection (modules, hooks and probes hold each other in cycles that reference counting never frees)."""
    impl.unbind()
    gc.collect()


def guarded(setup: Setup, tallies: dict[str, Tally], fn, *args):
    """``fn(*args)``; an exception raised on every rank fails the subchecks in ``tallies`` (those that
    depend on it) instead, and the oracle goes on.

    An implementation that refuses or crashes on a variant fails that variant (verl raises
    ValueError on sqrtsoftplus, for example): routing config is identical on every rank, so such
    errors are raised on all of them. An error on some ranks only is no result: ``agree`` raises
    ``RankDisagreement`` naming them, and the check ends (quickly, not at the collective timeout).
    """
    error = None
    try:
        out = fn(*args)
    except RankDisagreement:
        raise
    except Exception as e:  # noqa: BLE001
        error, out = e, None
    agree(error, what=f"replay {setup.prefix}{getattr(fn, '__name__', 'step').lstrip('_')}")
    if error is not None:
        for t in tallies.values():
            t.fail(f"{setup.prefix}{type(error).__name__}: {str(error)[:500]}")
    return out


def _vocab_size(model) -> int:  # a ModelRef
    return int(hf_config_dict(model)["vocab_size"])
