"""What the replay oracles share: exact builds, per-variant setup, guarded subchecks.

A ``Setup`` is what every subcheck of one router variant needs on this rank: the options, the
implementation under test, the variant, the scenario layout and this rank's micro-batches. Models
are built in fp32 (or bf16, ``replay_dtype``) without dropout (``build``), so passes can be compared bit for bit.

A variant's subchecks share one build where they can (native parity and recompute switch settings on it:
``toggles``); the whole-model subchecks (backward_order, validation, token_counts, cross_layout) build the model
again. Only then does the first build under a layout keep a copy of every parameter and buffer (``WeightCopy``,
``Setup.keep_copies``); later builds under that layout skip Megatron's init and the bridge's load and copy those
tensors in, after checking that the new build has exactly the same names, shapes and dtypes (else it loads through
the bridge as the first did). One copy of this rank's model, against one load and conversion per build. The copy
stays on the GPU only while the device keeps room for it and for the model's gradients besides (``copy_home``);
else it is held in host memory (a production-depth bf16 build: the model, its gradients and a copy would not fit
one GPU together); then a later build takes the tensors the build before it still holds on the GPU, where they are
the loaded ones (``handover``), and only the others from the host.
"""

from __future__ import annotations

import dataclasses
import gc
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch

from moeverify import models
from moeverify.errors import RankDisagreement
from moeverify.models import family_shape, hf_config_dict
from moeverify.oracles.context import CheckContext
from moeverify.oracles.replay import drive as rd
from moeverify.oracles.replay import handover
from moeverify.oracles.replay.impls import ReplayImpl
from moeverify.oracles.results import Tally
from moeverify.patches.routers import find_routers
from moeverify.routing import views
from moeverify.runtime.outcome import agree
from moeverify.spec.checks import ReplayOptions
from moeverify.spec.layout import Layout
from moeverify.spec.models.ref import ModelRef
from moeverify.spec.router_variants import RouterVariant

if TYPE_CHECKING:  # megatron ships no types: Any to mypy, named for the reader
    from megatron.core.transformer.moe.router import TopKRouter

# fp32, no dropout: bit-for-bit comparisons need deterministic, full-precision passes
_EXACT = dict(
    bf16=False,
    fp16=False,
    params_dtype=torch.float32,
    pipeline_dtype=torch.float32,
    hidden_dropout=0.0,
    attention_dropout=0.0,
)
# ``replay_dtype: bf16``: Megatron's own bf16 build (Float16Module), half the memory; passes of one process stay
# deterministic, so every comparison is still bitwise
_BF16 = dict(_EXACT, bf16=True, params_dtype=torch.bfloat16, pipeline_dtype=torch.bfloat16)
SETTINGS = {"fp32": _EXACT, "bf16": _BF16}


@dataclasses.dataclass(kw_only=True)
class Setup:
    """What every subcheck of one variant shares on this rank."""

    ctx: CheckContext
    opts: ReplayOptions
    impl: ReplayImpl
    variant: RouterVariant
    layout: Layout
    coords: views.RankCoords
    batches: rd.Batches
    items: list
    weights: dict = dataclasses.field(default_factory=dict)  # Layout -> WeightCopy of its first build
    keep_copies: bool = True  # a first build keeps a WeightCopy (off when no later build will use it)
    kept: handover.Kept | None = None  # the last build's tensors, where the next build may take them (``handover``)
    handed_over: int = 0  # tensors later builds took from the build before them on the device
    builds: dict = dataclasses.field(default_factory=lambda: {"loaded": 0, "copied": 0})
    seconds: dict = dataclasses.field(default_factory=dict)  # step -> wall seconds spent in it alone (``guarded``)
    _open: list = dataclasses.field(default_factory=list)  # seconds the steps running now spent in nested steps

    @property
    def prefix(self) -> str:
        return f"[{self.variant.name}] "

    @property
    def model(self) -> ModelRef:
        """The scenario's model (``Scenario`` fills it in from its family when it is made)."""
        model = self.ctx.scenario.model
        assert model is not None, "a Scenario's model is filled in when it is made"
        return model

    def stage_moe_layers(self) -> tuple[int, ...]:
        """The MoE decoder layers this rank's pipeline stage holds (none on a dense stage)."""
        shape = family_shape(self.model)
        return views.layers_of(
            self.layout, pp_rank=self.coords.pp, num_layers=shape.num_layers, moe_layers=shape.moe_layers
        )


# bytes of weight copies above which a build first collects garbage: a model some subcheck dropped is still held by
# its reference cycles until a collection, and at production width it is another copy of the model on the device
# (a collection costs a fraction of a second, too much to pay before every tiny build)
COLLECT_ABOVE = 256 << 20


# a weight copy stays on the GPU when, with it made, the device still has this many times the copy's bytes free: the
# model's gradients (the copy's size: Megatron's bf16 and fp32 builds without a DDP wrapper keep ``param.grad`` in
# the parameter's dtype) and room for activations
ROOM_AFTER_COPY = 1.25


def copy_home(nbytes: int, *, free: int) -> str:
    """Where a weight copy of ``nbytes`` is held when the model lives on a GPU with ``free`` bytes free."""
    return "cuda" if free - nbytes >= ROOM_AFTER_COPY * nbytes else "cpu"


@dataclasses.dataclass(frozen=True, slots=True)
class WeightCopy:
    """Every parameter and buffer of a freshly loaded build, by (chunk, name), cloned on the GPU when it fits there
    with room to spare (``copy_home``), else in host memory; a CPU model's copy stays on the CPU."""

    tensors: dict[tuple[int, str], torch.Tensor]
    prints: dict | None = None  # the loaded large tensors' prints, where a later build may take them over

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    @property
    def device(self) -> str:
        return next(iter(self.tensors.values())).device.type if self.tensors else "cpu"

    @classmethod
    def of(cls, chunks: list) -> WeightCopy:
        tensors = _tensors(chunks)
        home = None
        if any(t.is_cuda for t in tensors.values()):
            nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
            home = copy_home(nbytes, free=torch.cuda.mem_get_info()[0])
        prints = handover.prints(tensors) if handover.applies(tensors, home or "cpu") else None
        with torch.no_grad():
            return cls({key: t.detach().to(home or t.device, copy=True) for key, t in tensors.items()}, prints)

    def restore(self, chunks: list, *, kept: handover.Kept | None = None) -> int | None:
        """Copy into ``chunks`` when they hold exactly these names, shapes and dtypes, else touch nothing (None):
        each tensor from ``kept`` where it is the loaded one (``handover.intact``), else from this copy. Returns how
        many came from ``kept``."""
        mine = _tensors(chunks)
        if mine.keys() != self.tensors.keys() or any(
            (t.shape, t.dtype) != (self.tensors[k].shape, self.tensors[k].dtype) for k, t in mine.items()
        ):
            return None
        same = handover.intact(kept, self.prints) if kept is not None and self.prints else set()
        taken = kept.tensors if kept is not None else {}
        with torch.no_grad():
            for key, t in mine.items():
                t.copy_(taken[key] if key in same else self.tensors[key])
        return len(same)


def _tensors(chunks: list) -> dict[tuple[int, str], torch.Tensor]:
    out = {}
    for c, chunk in enumerate(chunks):
        out.update({(c, f"param:{name}"): p for name, p in chunk.named_parameters()})
        out.update({(c, f"buffer:{name}"): b for name, b in chunk.named_buffers()})
    return out


def build_settings(opts: ReplayOptions, variant: RouterVariant, overrides: dict, extra: dict | None = None) -> dict:
    """The build overrides of one replay build: the check's dtype and expert form, then the router variant's, the
    implementation's and the subcheck's own settings (a later one wins)."""
    experts = {"moe_grouped_gemm": True} if opts.experts == "grouped" else {}
    return {**SETTINGS[opts.dtype], **experts, **variant.overrides, **overrides, **(extra or {})}


def build(setup: Setup, layout: Layout, *, overrides: dict, extra: dict | None = None) -> list:
    """A fresh model under ``layout`` with the variant's settings, ``overrides`` and ``extra``: the checkpoint's
    weights loaded through Megatron-Bridge the first time, copied from that build's ``WeightCopy`` after."""
    scenario = setup.ctx.scenario
    settings = build_settings(setup.opts, setup.variant, overrides, extra)
    if sum(c.nbytes for c in setup.weights.values()) > COLLECT_ABOVE:
        gc.collect()  # a model the last subcheck dropped (modules and hooks hold each other in cycles) goes first
    chunks, copy = None, setup.weights.get(layout)
    kept, setup.kept = setup.kept, None
    if kept is not None and (copy is None or kept.layout != layout or not handover.room_for(kept, copy.nbytes)):
        kept = None  # freed before the build: no room for two models' weights, or not this build's
    if copy is not None:
        chunks = models.build(
            scenario.model,
            layout,
            seed=scenario.seed,
            load_weights=False,
            overrides={**settings, "perform_initialization": False},
        ).model_chunks
        taken = copy.restore(chunks, kept=kept)
        kept = None
        if taken is not None:
            setup.builds["copied"] += 1
            setup.handed_over += taken
        else:  # another structure (an option that adds a tensor): load it as the first build did
            chunks = None
    if chunks is None:
        chunks = models.build(scenario.model, layout, seed=scenario.seed, overrides=settings).model_chunks
        setup.builds["loaded"] += 1
        if layout not in setup.weights and setup.keep_copies:
            setup.weights[layout] = WeightCopy.of(chunks)
    if setup.variant.random_expert_bias:
        _seed_expert_bias(chunks, seed=scenario.seed)
    if setup.variant.tied_scores:
        _tie_router_rows(chunks)
    if (copy := setup.weights.get(layout)) is not None and copy.prints is not None:
        setup.kept = handover.keep(_tensors(chunks), layout)
    return chunks


def _tie_router_rows(chunks: list) -> None:
    """Expert 2j+1's router row := expert 2j's (the ``tied_scores`` variant): their logits tie in every row."""
    routers: dict[int, tuple[int, TopKRouter]] = find_routers(chunks)
    for _, router in routers.values():
        with torch.no_grad():
            pairs = router.weight.shape[0] // 2  # an odd last expert keeps its own row
            router.weight[1 : 2 * pairs : 2] = router.weight[0 : 2 * pairs : 2]


def _seed_expert_bias(chunks: list, *, seed: int) -> None:
    """Seeded non-zero expert biases (a fresh model's are zeros, which would not steer routing)."""
    routers: dict[int, tuple[int, TopKRouter]] = find_routers(chunks)
    for layer, (_, router) in routers.items():
        if router.expert_bias is not None:
            gen = torch.Generator().manual_seed(7919 * (seed + 1) + layer)
            with torch.no_grad():
                router.expert_bias.copy_(0.1 * torch.randn(router.expert_bias.shape, generator=gen))


def perturb_routers(chunks: list, *, seed: int) -> None:
    """Add seeded noise of the weights' own scale to every router weight (identical on every rank)."""
    routers: dict[int, tuple[int, TopKRouter]] = find_routers(chunks)
    for layer, (_, router) in routers.items():
        gen = torch.Generator().manual_seed(104_729 * (seed + 1) + layer)
        with torch.no_grad():
            w = router.weight
            w.add_(w.detach().float().std() * torch.randn(w.shape, generator=gen).to(w.device, w.dtype))


def num_layers(chunks: list) -> int:
    return int(chunks[0].config.num_layers)


def make_setup(
    ctx: CheckContext, opts: ReplayOptions, impl: ReplayImpl, variant: RouterVariant, coords: views.RankCoords
) -> Setup:
    scenario, layout = ctx.scenario, ctx.scenario.layout
    batches = rd.Batches(
        seq_len=opts.seq_len,
        batch=opts.batch,
        microbatches=opts.num_microbatches(layout),
        dp=layout.dp(ctx.world_size),
        vocab_size=_vocab_size(scenario.model),
        seed=scenario.seed,
        padding=variant.padding,
    )
    items = rd.local_microbatches(batches, layout, dp_rank=coords.dp, cp_rank=coords.cp)
    return Setup(
        ctx=ctx, opts=opts, impl=impl, variant=variant, layout=layout, coords=coords, batches=batches, items=items
    )


def release(impl: ReplayImpl) -> None:
    """Free the model ``impl`` was bound to (and whatever the caller dropped) before the next build: ``unbind``, then
    a collection (modules, hooks and probes hold each other in cycles that reference counting never frees)."""
    impl.unbind()
    gc.collect()


def guarded[T](setup: Setup, tallies: Mapping[str, Tally], fn: Callable[..., T], *args: Any) -> T | None:
    """``fn(*args)``; an exception raised on every rank fails the subchecks in ``tallies`` (those that
    depend on it) instead, and the oracle goes on.

    An implementation that refuses or crashes on a variant fails that variant (verl raises
    ValueError on sqrtsoftplus, for example): routing config is identical on every rank, so such
    errors are raised on all of them. An error on some ranks only is no result: ``agree`` raises
    ``RankDisagreement`` naming them, and the check ends (quickly, not at the collective timeout).
    """
    error, step = None, getattr(fn, "__name__", "step").lstrip("_")
    if step == "run":  # a subcheck module's entry point (token_counts.run): named by its module
        step = fn.__module__.rsplit(".", 1)[-1]
    start = time.perf_counter()
    setup._open.append(0.0)
    try:
        out = fn(*args)
    except RankDisagreement:
        raise
    except Exception as e:  # noqa: BLE001
        error, out = e, None
    finally:
        took, nested = time.perf_counter() - start, setup._open.pop()
        setup.seconds[step] = round(setup.seconds.get(step, 0.0) + took - nested, 3)
        if setup._open:
            setup._open[-1] += took
    agree(error, what=f"replay {setup.prefix}{step}")
    if error is not None:
        for t in tallies.values():
            t.fail(f"{setup.prefix}{type(error).__name__}: {str(error)[:500]}")
    return out


def _vocab_size(model) -> int:  # a ModelRef
    return int(hf_config_dict(model)["vocab_size"])
