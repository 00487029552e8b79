"""Build a tiny family into Megatron model chunks through Megatron-Bridge, under a Layout.

Version assumptions (megatron-bridge 0.6.2): ``AutoBridge.from_hf_pretrained`` ->
``to_megatron_provider(load_weights=True)`` -> set parallel sizes on the provider -> ``finalize()`` ->
``provide_distributed_model(wrap_with_ddp=False)``. The latter is deprecated in favour of a ModelBuilder
that 0.6.2 does not yet make usable for bridge-converted providers, so its warning is silenced here only.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import logging
import tempfile
import warnings
from pathlib import Path
from typing import Any

from moeverify import runtime
from moeverify.errors import UsageError
from moeverify.models import bridge_limits, family_specs, seeded
from moeverify.models.families import family_shape, hf_checkpoint, hf_config_dict
from moeverify.models.mtp_spec import cpu_mtp_block_spec, cpu_mtp_gaps
from moeverify.routing import layer_numbering
from moeverify.spec.layout import Layout, ModelShape
from moeverify.spec.models import user
from moeverify.spec.models.configs import check_family, model_spec
from moeverify.spec.models.ref import ModelRef, as_ref

# Settings that select TE-only (or apex-only) kernels; switched off wherever real TE is absent
# (every CPU rank, and GPU nodes without TE), where the local block spec is used instead.
_NO_TE_PROVIDER_SETTINGS = dict(
    moe_grouped_gemm=False,
    gradient_accumulation_fusion=False,
    cross_entropy_loss_fusion=False,
    masked_softmax_fusion=False,
    persist_layer_norm=False,
    apply_rope_fusion=False,
    moe_router_fusion=False,
    moe_permute_fusion=False,
    bias_dropout_fusion=False,
)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Built:
    """A family built under a layout: what oracles and users need."""

    family: str
    layout: Layout
    bridge: Any  # megatron.bridge AutoBridge
    model_chunks: list  # one Megatron module per VPP chunk
    hf_path: Path
    config: Any  # the provider (a TransformerConfig)
    shape: ModelShape


def _apply_layout(provider, layout: Layout) -> None:
    provider.tensor_model_parallel_size = layout.tp
    provider.pipeline_model_parallel_size = layout.pp
    provider.virtual_pipeline_model_parallel_size = layout.vpp if layout.pp > 1 else None
    provider.context_parallel_size = layout.cp
    provider.expert_model_parallel_size = layout.ep
    provider.expert_tensor_parallel_size = layout.expert_tp
    provider.sequence_parallel = layout.sp
    provider.num_layers_in_first_pipeline_stage = layout.pp_first
    provider.num_layers_in_last_pipeline_stage = layout.pp_last
    provider.pipeline_model_parallel_layout = layout.pp_layout


def _apply_overrides(provider, settings: dict, *, what: str) -> None:
    for name, value in settings.items():
        if not hasattr(provider, name):
            raise UsageError(f"{what}: the model config has no attribute {name!r}")
        setattr(provider, name, value)


def _unmapped_experts(provider, registry, *, grouped: bool) -> list[str]:
    """Expert parameters of the first MoE layer that the bridge's mapping registry has no mapping for
    (megatron-bridge 0.6.2 names): built as ``SequentialMLP`` (``local_experts.0.linear_fc1.weight``) or, with
    ``grouped``, as ``TEGroupedMLP`` (``linear_fc1.weight0``)."""
    pattern = _moe_pattern(provider)
    if not pattern:
        return []
    prefix = f"decoder.layers.{pattern[0]}.mlp.experts."
    names = (
        [f"{prefix}{fc}.weight0" for fc in ("linear_fc1", "linear_fc2")]
        if grouped
        else [f"{prefix}local_experts.0.{fc}.weight" for fc in ("linear_fc1", "linear_fc2")]
    )
    return [name for name in names if registry.megatron_to_hf_lookup(name) is None]


def cpu_grouped_experts(provider, family: str, registry) -> bool:
    """Whether the CPU path builds routed experts as ``TEGroupedMLP`` over ``moeverify.models.grouped_linear``
    rather than as ``SequentialMLP`` (megatron-core's local spec): where the bridge maps them for grouped GEMM
    only (GLM-4.5, MiniMax-M2, OLMoE), and where experts have biases (GPT-OSS): megatron-core 0.19.2's
    ``SequentialMLP`` with ``add_bias_linear`` adds the bias in place into the view
    ``_ReduceFromModelParallelRegion`` returns, which autograd refuses in every backward. A bridge that maps
    neither form is refused, naming the parameters."""
    unmapped_local = _unmapped_experts(provider, registry, grouped=False)
    if not unmapped_local and not (provider.num_moe_experts and provider.add_bias_linear):
        return False
    unmapped_grouped = _unmapped_experts(provider, registry, grouped=True)
    if unmapped_grouped and unmapped_local:
        raise UsageError(
            f"{family}: Megatron-Bridge maps its routed experts neither as SequentialMLP (no mapping for "
            f"{', '.join(unmapped_local)}) nor as grouped GEMM (no mapping for "
            f"{', '.join(unmapped_grouped)}): its weights could not be converted"
        )
    return not unmapped_grouped


def _check_expert_form(provider, family: str, registry) -> None:
    """An override of ``moe_grouped_gemm`` (``replay_experts: grouped``) the CPU spec can build and the bridge can
    load: grouped experts where the bridge maps that form, ``SequentialMLP`` where it maps that one and the experts
    have no biases (megatron-core 0.19.2's ``SequentialMLP`` fails every backward with them)."""
    grouped = bool(provider.moe_grouped_gemm)
    unmapped = _unmapped_experts(provider, registry, grouped=grouped)
    if unmapped:
        raise UsageError(
            f"{family}: routed experts built {'grouped' if grouped else 'as SequentialMLP'} "
            f"(moe_grouped_gemm={grouped}), but Megatron-Bridge maps no {', '.join(unmapped)}: "
            "its weights could not be loaded; build them the other way"
        )
    if not grouped and provider.num_moe_experts and provider.add_bias_linear:
        raise UsageError(
            f"{family}: routed experts with biases built as SequentialMLP (moe_grouped_gemm=False): "
            "megatron-core 0.19.2's SequentialMLP adds the bias in place into a view and every backward fails; "
            "build them grouped"
        )


def _refuse_cpu_spec_gaps(provider, family: str, *, rebuilt: dict | None = None):
    """Refuse a model the CPU layer spec cannot build as the bridge means it (never a different model); else
    the ``FamilySpec`` that rebuilds its layer spec (``family_specs.cpu_rebuilds``, or ``rebuilt``)."""
    fn = family_specs.spec_function(provider)
    rebuilt = family_specs.cpu_rebuilds() if rebuilt is None else rebuilt
    family_spec = next((v for k, v in rebuilt.items() if fn is k), None)
    gaps = [] if family_spec is not None else [f"its own layer spec {family_specs.spec_name(fn)}"]
    # Attention sinks and sliding windows are rebuilt by LocalCoreAttention (local_spec.py).
    # Zero-centered norms are LocalNorm's ZeroCenteredRMSNorm; gated delta net layers are linear_attention.py's.
    if getattr(provider, "layernorm_zero_centered_gamma", False) and provider.normalization != "RMSNorm":
        gaps.append(f"layernorm_zero_centered_gamma=True with {provider.normalization} (built for RMSNorm only)")
    variant = getattr(provider, "experimental_attention_variant", None)
    linear = bool(getattr(family_spec, "linear_attention", False))
    if variant and not (variant == "gated_delta_net" and linear):
        gaps.append(f"experimental_attention_variant={variant!r}")
    if linear and variant != "gated_delta_net":
        gaps.append(
            f"its layer spec with experimental_attention_variant={variant!r} (the CPU path builds gated_delta_net)"
        )
    gaps += cpu_mtp_gaps(provider)  # MTP blocks are mtp_spec.py's local_mtp_block_spec
    if gaps:
        raise UsageError(
            f"{family}: without Transformer Engine moeverify builds layers from its own CPU spec, which "
            f"does not reproduce {'; '.join(gaps)}: it would verify another model. Run it where "
            "Transformer Engine is installed (a GPU node), or mark the scenario gpu_only with this reason"
        )
    return family_spec


def _cpu_path(provider, family: str, registry) -> tuple[dict, Any]:
    """Refuse what the CPU spec cannot rebuild; else the provider settings and the block spec it builds with."""
    from moeverify.models.local_spec import local_block_spec  # lazy: megatron

    family_spec = _refuse_cpu_spec_gaps(provider, family)
    family_specs.cover_cuda_call_sites()
    grouped = cpu_grouped_experts(provider, family, registry)
    settings = {**_NO_TE_PROVIDER_SETTINGS, "moe_grouped_gemm": grouped}
    return settings, functools.partial(local_block_spec, family=family_spec)


def _moe_pattern(provider) -> tuple[int, ...]:
    """Global MoE layer numbers of the provider (``layer_numbering.moe_layers``)."""
    if not provider.num_moe_experts:
        return ()
    try:
        return layer_numbering.moe_layers(num_layers=provider.num_layers, moe_layer_freq=provider.moe_layer_freq)
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def _linear_heads(provider) -> tuple[int, int] | tuple[()]:
    if getattr(provider, "experimental_attention_variant", None) != "gated_delta_net":
        return ()
    return (provider.linear_num_key_heads, provider.linear_num_value_heads)


def _check_shape(provider, shape: ModelShape, family: str) -> None:
    """The shape the layout was validated against must be the model Megatron-Bridge built."""
    built = ModelShape(
        num_layers=provider.num_layers,
        num_heads=provider.num_attention_heads,
        num_query_groups=provider.num_query_groups or provider.num_attention_heads,
        num_experts=provider.num_moe_experts or 0,
        moe_layers=_moe_pattern(provider),
        linear_heads=_linear_heads(provider),
    )
    if built != shape:
        diffs = [
            f"{f.name} {getattr(shape, f.name)!r} (from the HF config) != {getattr(built, f.name)!r} (built)"
            for f in dataclasses.fields(ModelShape)
            if getattr(shape, f.name) != getattr(built, f.name)
        ]
        raise UsageError(
            f"{family}: the model Megatron-Bridge built differs from the shape read from its HF "
            f"config: {'; '.join(diffs)}"
        )


def _bridge_for(model: str | ModelRef, hf_path: Path):
    """``AutoBridge.from_hf_pretrained(hf_path)``; an architecture Megatron-Bridge has no bridge for is a
    ``UsageError`` naming it (megatron-bridge 0.6.2 raises a ValueError whose first line says so)."""
    runtime.import_bridge()
    from megatron.bridge import AutoBridge  # lazy: megatron

    family = as_ref(model).key
    if (prepare := model_spec(model).prepare) is not None:
        prepare()  # e.g. the in-code config that stands in for Kimi-K2's remote code (never trusted)
    try:
        bridge = AutoBridge.from_hf_pretrained(str(hf_path))
    except ValueError as exc:
        first = next((line.strip(" ✗") for line in str(exc).splitlines() if line.strip()), type(exc).__name__)
        raise UsageError(f"{family}: Megatron-Bridge cannot convert it: {first}") from exc
    if seeded.is_seeded(hf_path):
        from moeverify.models import seeded_state  # lazy: megatron.bridge (imported above, after import_bridge)

        seeded_state.install(bridge, hf_path)
    return bridge


def _provider(bridge, family: str, *, load_weights: bool):
    """``bridge.to_megatron_provider``; a bridge that cannot read the config (a key its family's configs carry and
    this one lacks) is the user's config to fix, named with the bridge that asked, not a traceback."""
    config_errors = (AttributeError, KeyError, TypeError, ValueError) if not load_weights else (AttributeError,)
    try:  # (loading weights, other errors are the weights', and keep their own messages)
        return bridge.to_megatron_provider(load_weights=load_weights)
    except config_errors as exc:
        raise UsageError(
            f"{family}: {type(bridge._model_bridge).__name__} could not make a Megatron config from "
            f"its config.json: {type(exc).__name__}: {exc}"
        ) from None


def _refuse_unconvertible(ref: ModelRef, bridge, provider) -> None:
    """A config the bridge would build as another model is refused with the key that it ignores
    (``bridge_limits``); the built-in families are converted as they are."""
    if ref.is_user:
        bridge_limits.refuse_unconvertible(
            family=ref.key,
            config=hf_config_dict(ref),
            bridge=bridge,
            provider=provider,
            built_moe_layers=_moe_pattern(provider),
        )


def preflight(model: str | ModelRef, *, te_real: bool) -> None:
    """Refuse, in the launching process and before any rank starts, what every rank's ``build`` would refuse
    once it had started: an architecture without a bridge, a config the bridge would build as another model
    (``bridge_limits``), and (``te_real`` False) a model the CPU layer spec cannot rebuild. Reads the config
    only: no weights are written or loaded."""
    ref = check_family(model)
    family = ref.key
    path = user.load(ref).weights_dir if ref.is_user else None
    with tempfile.TemporaryDirectory(prefix="moeverify-preflight-") as tmp:
        if path is None:
            path = Path(tmp)
            (path / "config.json").write_text(json.dumps(hf_config_dict(ref)))
        logging.disable(logging.WARNING)  # the launcher's terminal is for moeverify's own lines
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                bridge = _bridge_for(ref, path)
                provider = _provider(bridge, family, load_weights=False)
                _refuse_unconvertible(ref, bridge, provider)
                if not te_real:
                    _cpu_path(provider, family, bridge._model_bridge.mapping_registry())
        finally:
            logging.disable(logging.NOTSET)


def _fresh_moe_metrics() -> None:
    """Drop megatron-core's process-global MoE metrics tracker before a model is built: megatron-core 0.19.2's
    ``MoEMetricsTracker`` sizes each metric (aux losses per layer) by the first model that records into it and
    ``clear()`` keeps that size, so a later model with more routers in the same process (an MTP layer) indexes
    past it (IndexError in ``moe_logging.record``). The next router call makes a new one."""
    from megatron.core.transformer.moe.moe_logging import destroy_moe_metrics_tracker  # lazy: megatron

    destroy_moe_metrics_tracker()


def build(
    model: str | ModelRef, layout: Layout, *, seed: int = 0, overrides: dict | None = None, load_weights: bool = True
) -> Built:
    """Build ``family`` under ``layout`` (call inside ``moeverify.runtime.parallel(layout)``).

    Args:
        model: a family of ``moeverify.models.FAMILIES`` (by name or reference) or a user model's reference.
        layout: the parallel layout; validated against the family's shape.
        seed: weight seed of the tiny HF checkpoint.
        overrides: provider / TransformerConfig attributes set before the model is provided
            (e.g. ``{"moe_router_score_function": "sigmoid"}``).
        load_weights: load the HF checkpoint's weights (else Megatron's own init).
    """
    rt = runtime.current()
    ref = check_family(model)
    family = ref.key
    shape = family_shape(ref)
    layout.validate(world_size=rt.world_size, shape=shape)
    hf_path = hf_checkpoint(ref, seed)
    bridge = _bridge_for(ref, hf_path)
    provider = _provider(bridge, family, load_weights=load_weights)
    _refuse_unconvertible(ref, bridge, provider)
    _apply_layout(provider, layout)
    if not rt.te_real:
        settings, block_spec = _cpu_path(provider, family, bridge._model_bridge.mapping_registry())
        _apply_overrides(provider, settings, what="settings without Transformer Engine")
        provider.transformer_layer_spec = block_spec
    provider.use_cpu_initialization = rt.backend == "cpu"
    if rt.dist_backend == "gloo":
        # On gloo, batched p2p (batch_isend_irecv) under PP x VPP matches messages exchanged with the same
        # peer in the wrong order: micro-batches after the first group get another message's tensor in the
        # training schedule (forward-only passes are right). Measured by the replay oracle's equivalence.
        provider.batch_p2p_comm = False
    _apply_overrides(provider, overrides or {}, what="build overrides")
    if not rt.te_real and "moe_grouped_gemm" in (overrides or {}):
        _check_expert_form(provider, family, bridge._model_bridge.mapping_registry())
    provider.finalize()
    _check_shape(provider, shape, family)
    _fresh_moe_metrics()
    with warnings.catch_warnings(), contextlib.ExitStack() as scoped:
        warnings.simplefilter("ignore", DeprecationWarning)
        if not rt.te_real:
            scoped.enter_context(cpu_mtp_block_spec(bridge._model_bridge.mapping_registry()))
        chunks = provider.provide_distributed_model(wrap_with_ddp=False, use_cpu_initialization=rt.backend == "cpu")
    return Built(
        family=family,
        layout=layout,
        bridge=bridge,
        model_chunks=list(chunks),
        hf_path=hf_path,
        config=provider,
        shape=shape,
    )
