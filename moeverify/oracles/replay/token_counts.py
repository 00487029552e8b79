"""The ``token_counts`` replay subcheck: expert-bias token counts and aux-loss inputs under replay.

A replayed training pass must leave the same load-balancing state as native routing of the same
routes: the aux-loss-free expert bias of the next optimizer step is computed from
``local_tokens_per_expert`` (counts of routed experts, padding tokens left out), and the aux losses
from per-expert token counts and scores. None of these enter the outputs or the gradients of the
pass that makes them (the bias update runs in the optimizer step), so ``equivalence`` cannot see a
wrong count: a replay implementation that counts padding tokens passes every other subcheck.

Per case (a padding mask on every micro-batch; a router call of as many tokens as experts, T == E,
where megatron-core 0.19.2's ``[T, E] & [T]`` mask lines tokens up with experts, and one of T != E,
where the same mask raises), on a 1-rank build (as ``validation``; it fixes T exactly):
- reference: Megatron's own routing on a pristine build of the same weights (``impls.pristine``), its
  count switched off for the pass (it cannot count with a padding mask); the counts are then decided
  from its routing maps and the padding mask each router received (``checks.reference_token_counts``);
- under test: the implementation's record pass, then its replayed training pass;
- compared bit for bit, per layer: ``local_tokens_per_expert`` after the replayed pass against the
  reference counts, the aux losses and z-loss Megatron tracks, and the ``global_aux_loss`` per-expert
  token totals (``global_tokens_per_expert``, ``ga_steps``).

Legend of shape suffixes: B = sequences, S = positions, T = tokens (router order), E = experts.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import TYPE_CHECKING

import torch

from moeverify import runtime
from moeverify.models import family_shape, family_traits
from moeverify.oracles.replay import drive as rd
from moeverify.oracles.replay import pass_checks as rc
from moeverify.oracles.replay import setup as st
from moeverify.oracles.replay.impls import pristine
from moeverify.oracles.results import Tally
from moeverify.spec.layout import Layout

if TYPE_CHECKING:  # megatron ships no types: Any to mypy, named for the reader
    from megatron.core.transformer.moe.router import TopKRouter

MICROBATCHES = 1  # one is enough: counts of a call; cost matters (the subcheck runs in every replay scenario)
# Finding F13 (README): megatron-core 0.19.2 keeps ``expert_bias`` in fp32 under ``Float16Module`` but not the counts
# its update is made from: ``local_tokens_per_expert`` becomes bf16 in a bf16 build and rounds once an expert's count
# passes 256 (fixed upstream after 0.19.2: Megatron-LM PR #7081). Seen with ``replay_dtype: bf16``.
FINDING = "F13"
TITLE = (
    "megatron-core 0.19.2 holds the expert-bias token counts (local_tokens_per_expert) in the model's dtype: "
    "bf16 counts round above 256"
)


@dataclasses.dataclass(kw_only=True)
class Observed:
    """What one pass left in the routers: see ``checks.check_token_counts``."""

    calls: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor | None]]  # (layer, mb) -> (map_TE, padding_T)
    counts: dict[int, torch.Tensor]  # layer -> local_tokens_per_expert (routers with expert bias)
    aux: dict[tuple[str, int], torch.Tensor]  # (tracked loss, layer) -> value
    global_counts: dict[int, tuple[torch.Tensor, torch.Tensor]]  # layer -> (global_tokens_per_expert, ga_steps)


# The load-balancing types whose aux loss megatron-core 0.19.2's TopKRouter computes and tracks
# (``TopKRouter.is_aux_loss_enabled``); any other type ("none", "sinkhorn", ...) has none.
AUX_LOSS_TYPES = ("aux_loss", "seq_aux_loss", "global_aux_loss")


def aux_loss_coeffs(config) -> dict[str, float]:
    """``{type: coefficient}`` of the aux losses a router built from ``config`` applies, as megatron-core 0.19.2's
    ``TopKRouter.get_aux_loss_coeff`` pairs them: ``moe_aux_loss_coeff`` belongs to the load-balancing type
    ``moe_router_load_balancing_type`` names (a list of types takes a list of coefficients, index by index, the
    first occurrence of a type counting). A coefficient under a type with no aux loss ("none": GPT-OSS's bridge
    leaves the default 0.001 beside it) applies nothing; only types of ``AUX_LOSS_TYPES`` with a coefficient > 0
    are returned."""
    kinds, coeffs = config.moe_router_load_balancing_type, config.moe_aux_loss_coeff
    if isinstance(kinds, str):
        kinds, coeffs = (kinds,), (coeffs,)
    elif not isinstance(coeffs, list | tuple):
        coeffs = (coeffs,) * len(kinds)  # TransformerConfig refuses this pairing; read it leniently
    out: dict[str, float] = {}
    for kind, coeff in zip(kinds, coeffs, strict=True):
        out.setdefault(kind, float(coeff or 0.0))
    return {kind: coeff for kind, coeff in out.items() if kind in AUX_LOSS_TYPES and coeff > 0}


def not_applicable(*, expert_bias: bool, config) -> str | None:
    """Why the subcheck has nothing to compare on a model, or None when it has something.

    Args:
        expert_bias: the model has an expert bias (``ModelTraits.expert_bias``).
        config: the built model's ``TransformerConfig`` (its router variant applied): whether the bias is
            enabled there, which aux losses its load-balancing type(s) and coefficient(s) switch on
            (``aux_loss_coeffs``: a coefficient alone switches on nothing), and its z-loss coefficient
            (``moe_z_loss_coeff``).
    """
    bias = expert_bias and bool(getattr(config, "moe_router_enable_expert_bias", False))
    aux = aux_loss_coeffs(config)
    z_loss = float(getattr(config, "moe_z_loss_coeff", None) or 0.0) > 0
    if bias or aux or z_loss:
        return None
    return (
        "the model has no expert bias (traits.expert_bias "
        f"{expert_bias}, moe_router_enable_expert_bias {getattr(config, 'moe_router_enable_expert_bias', None)}), "
        f"no aux loss (moe_aux_loss_coeff {config.moe_aux_loss_coeff!r} under moe_router_load_balancing_type "
        f"{config.moe_router_load_balancing_type!r}: Megatron-Core applies a coefficient only to the "
        f"{'/'.join(AUX_LOSS_TYPES)} type it is paired with) and no z-loss "
        f"(moe_z_loss_coeff {getattr(config, 'moe_z_loss_coeff', None)!r}): no token count or loss to compare"
    )


def run(setup: st.Setup, t: Tally, notes: dict) -> None:
    """Both cases on a nested 1-rank layout; fills ``t``, or marks it not applicable (``not_applicable``)."""
    expert_bias = family_traits(setup.model).expert_bias
    one = Layout()
    with runtime.parallel(one, seed=setup.ctx.scenario.seed):
        for case, (seq, batch) in _cases(setup).items():
            prefix = f"{setup.prefix}token_counts {case} (S={seq}, B={batch}): "
            items = _padded_items(setup, one, seq_len=seq, batch=batch)
            notes.setdefault("token_counts_cases", []).append(f"{case}: S={seq} B={batch}")
            try:  # every rank runs the same computation (dp = world), so a failure here is every rank's
                evidence = _one_case(setup, t, items, seq_len=seq, prefix=prefix, expert_bias=expert_bias)
                if evidence:
                    entry = notes.setdefault("findings", {}).setdefault(FINDING, {"title": TITLE, "evidence": []})
                    entry["evidence"] += [dict(e, case=case) for e in evidence]
            except _NotApplicable as why:  # decided on the first case's reference build, before any pass
                t.skip(str(why))
                notes["token_counts"] = f"not applicable: {why}"
                return
            except Exception as error:  # noqa: BLE001 - an implementation crashing on a case fails that case
                t.fail(f"{prefix}{type(error).__name__}: {str(error)[:300]}")


def _cases(setup: st.Setup) -> dict[str, tuple[int, int]]:
    """``{case: (S, B)}``: one router call of T == E tokens, and one of T != E."""
    experts = family_shape(setup.model).num_experts
    batch = 2 if experts % 2 == 0 and experts >= 4 else 1
    seq, other_batch = setup.batches.seq_len, setup.batches.batch
    if seq * other_batch == experts:
        seq += 2
    return {"T==E": (experts // batch, batch), "T!=E": (seq, other_batch)}


def _padded_items(setup: st.Setup, layout: Layout, *, seq_len: int, batch: int) -> list[rd.MicroBatch]:
    """Micro-batches with padding in every one: the last quarter (at least one token) of the last sequence,
    and position 1 of every second sequence."""
    glob = dataclasses.replace(
        setup.batches, seq_len=seq_len, batch=batch, dp=1, microbatches=MICROBATCHES, padding=False
    )
    pad_BS = torch.zeros(batch, seq_len, dtype=torch.bool)
    pad_BS[-1, seq_len - max(1, seq_len // 4) :] = True
    pad_BS[::2, 1] = True
    return [
        dataclasses.replace(item, padding_BS=pad_BS.clone())
        for item in rd.local_microbatches(glob, layout, dp_rank=0, cp_rank=0)
    ]


class _NotApplicable(Exception):
    """The built model has nothing for the subcheck to compare (``not_applicable``)."""


def _one_case(setup: st.Setup, t: Tally, items: list, *, seq_len: int, prefix: str, expert_bias: bool) -> list[dict]:
    one, impl = Layout(), setup.impl
    with pristine():
        chunks = st.build(setup, one, overrides={})
        if (why := not_applicable(expert_bias=expert_bias, config=chunks[0].config)) is not None:
            raise _NotApplicable(why)
        with _count_off(chunks):
            reference = _observe(chunks, lambda: rd.run_pass(chunks, items, seq_len=seq_len, forward_only=False))
    if not impl.builds_natively():  # else the reference's build is the one it would build
        del chunks  # one model alive at a time: the reference goes before the next build
        chunks = st.build(setup, one, overrides=impl.overrides())
    impl.bind(chunks)
    routes = rd.record_pass(chunks, items, seq_len=seq_len, impl=impl).routes
    got = _observe(chunks, lambda: rd.replay_pass(chunks, items, seq_len=seq_len, impl=impl, routes=routes))
    impl.unbind()
    return rc.check_token_counts(t, reference=reference, got=got, prefix=prefix)


@contextlib.contextmanager
def _count_off(chunks: list):
    """Megatron's own expert-bias count off for the duration (its gate, ``enable_expert_bias``)."""
    routers: list[TopKRouter] = [router for _, router in st.find_routers(chunks).values() if router.enable_expert_bias]
    for router in routers:
        router.enable_expert_bias = False
    try:
        yield
    finally:
        for router in routers:
            router.enable_expert_bias = True


def _observe(chunks: list, run_pass) -> Observed:
    """Run ``run_pass`` with the routers' counts zeroed and the loss tracker cleared; read what they hold."""
    from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker  # lazy: megatron

    routers: dict[int, tuple[int, TopKRouter]] = st.find_routers(chunks)
    for _, router in routers.values():
        if router.local_tokens_per_expert is not None:
            router.local_tokens_per_expert.zero_()
    tracker = get_moe_metrics_tracker()
    tracker.clear()
    calls: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor | None]] = {}
    handles: list[torch.utils.hooks.RemovableHandle] = []
    for layer, (_, router) in routers.items():
        handles.append(router.register_forward_hook(functools.partial(_seen, calls, layer), with_kwargs=True))
    try:
        run_pass()
    finally:
        for handle in handles:
            handle.remove()
    counts = {
        layer: router.local_tokens_per_expert.detach().cpu().clone()
        for layer, (_, router) in routers.items()
        if router.local_tokens_per_expert is not None
    }
    aux = {
        (name, layer): entry.values[layer].detach().cpu().clone()
        for name, entry in tracker.metrics.items()
        for layer in routers
        if layer < entry.values.numel()
    }
    global_counts = {
        layer: (router.global_tokens_per_expert.detach().cpu().clone(), router.ga_steps.detach().cpu().clone())
        for layer, (_, router) in routers.items()
        if router.global_tokens_per_expert is not None
    }
    return Observed(calls=calls, counts=counts, aux=aux, global_counts=global_counts)


def _seen(calls: dict, layer: int, module, args, kwargs, output) -> None:
    """Forward calls made with grad (the ones Megatron counts), in order per layer: map and padding received."""
    if not torch.is_grad_enabled():
        return
    padding = args[1] if len(args) > 1 else kwargs.get("padding_mask")
    _, map_TE = output
    mb = sum(1 for key in calls if key[0] == layer)
    calls[(layer, mb)] = (
        map_TE.detach().cpu().clone(),
        None if padding is None else padding.detach().reshape(-1).cpu().clone(),
    )
