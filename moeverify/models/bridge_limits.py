"""What the installed Megatron-Bridge builds from an HF config, against what the config says (and transformers builds).

A bridge turns an HF config into a Megatron provider: its mapping table reads some keys, its own code sets others.
Where it sets a value in place of what the config says, or never reads a key transformers' model obeys, the model
it builds is another model, and the checkpoint's weights do not fit it: every rank would fail on a shape (or, worse,
load and verify the other model). ``refuse_unconvertible`` finds both kinds from the provider, before any rank
starts, and refuses with the key, its value, what the bridge builds instead and the way out:

- **the MoE-layer pattern**: the layers transformers builds as MoE (``user.shape_of``, from the keys its modeling
  code reads: ``mlp_only_layers``, ``decoder_sparse_step``, ``first_k_dense_replace``, ``moe_layer_start_index``
  / ``_end_index`` / ``_interval``, ``mlp_layer_types``) against the provider's ``moe_layer_freq``; the keys that
  explain the difference are those whose neutral value gives the bridge's pattern (Megatron-Bridge 0.6.2's
  Qwen3-MoE and Qwen3-Next bridges build every layer as MoE; its Ernie-4.5 bridge reads the start index only);
- **mapped keys the bridge then overrides**: a key of the bridge's own config mapping (``CONFIG_MAPPING``) that
  changes the weights or the forward, whose mapped value the bridge's provider code replaced (Megatron-Bridge
  0.6.2's Qwen3-MoE bridge sets ``add_qkv_bias = False`` whatever ``attention_bias`` says).
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable, Sequence
from typing import Any

from moeverify.errors import UsageError
from moeverify.spec.models import user

FINDING = "F11"  # the README's findings table: the bridge builds another model than its config says


def _attribute(name: str) -> Callable[[Any], Any]:
    """Reads ``name`` of a provider, None where it has none."""
    return lambda provider: getattr(provider, name, None)


# Provider attributes that change the weights or the forward (not dropout, init, aux-loss or MTP settings), and
# how to read the value the provider will build with (a q/k/v bias is there with add_bias_linear too).
_ARCHITECTURE: dict[str, Callable[[Any], Any]] = {
    name: _attribute(name)
    for name in (
        "num_layers",
        "hidden_size",
        "ffn_hidden_size",
        "num_attention_heads",
        "num_query_groups",
        "kv_channels",
        "vocab_size",
        "layernorm_epsilon",
        "share_embeddings_and_output_weights",
        "add_bias_linear",
        "qk_layernorm",
        "rotary_base",
        "rotary_percent",
        "num_moe_experts",
        "moe_router_topk",
        "moe_ffn_hidden_size",
        "moe_router_score_function",
        "moe_router_num_groups",
        "moe_router_group_topk",
        "moe_router_topk_scaling_factor",
        "q_lora_rank",
        "kv_lora_rank",
        "qk_head_dim",
        "qk_pos_emb_head_dim",
        "v_head_dim",
    )
}
_ARCHITECTURE["add_qkv_bias"] = lambda provider: bool(provider.add_qkv_bias or provider.add_bias_linear)


def refuse_unconvertible(*, family: str, config: dict, bridge, provider, built_moe_layers: Sequence[int]) -> None:
    """Raise ``UsageError`` when ``bridge``'s ``provider`` is not the model ``config`` describes (see module doc).

    Args:
        family: the model's key, for the message.
        config: the HF config (a user model's normalised config.json).
        bridge: the ``AutoBridge`` made from it.
        provider: ``bridge.to_megatron_provider(...)``, before layout settings.
        built_moe_layers: the provider's MoE layers (``builder._moe_pattern``).
    """
    model_bridge = bridge._model_bridge
    name = type(model_bridge).__name__
    problems = _pattern_problems(config, tuple(built_moe_layers), bridge_name=name)
    problems += _override_problems(config, bridge.hf_pretrained.config, model_bridge, provider, bridge_name=name)
    if problems:
        raise UsageError(
            f"{family}: the installed Megatron-Bridge's {name} cannot convert this config as it is "
            f"(finding {FINDING}, README): " + "; ".join(problems)
        )


# ----------------------------------------------------------------------------------------------- MoE pattern
def _pattern_problems(config: dict, built: tuple[int, ...], *, bridge_name: str) -> list[str]:
    wanted = user.shape_of(config).moe_layers
    if not user.shape_of(config).num_experts or wanted == built:
        return []
    layers = int(config["num_hidden_layers"])
    read = user.pattern_read(config)
    present = [
        k
        for k in user.PATTERN_KEYS
        if k in read and read[k] != user.neutral(k, layers) and not (k == "moe_layer_end_index" and read[k] == -1)
    ]
    ignored = _explaining(config, present, built, layers=layers)
    what = (
        f"transformers builds MoE layers {_span(wanted, layers)}, {bridge_name} builds MoE layers "
        f"{_span(built, layers)}"
    )
    if ignored is None:
        keys = ", ".join(f"{k}={json.dumps(config[k])}" for k in present) or "no layer-pattern key"
        return [
            f"{what} (from {keys}): the checkpoint's dense and MoE layers would not fit the model it builds. "
            "Way out: a config whose layer pattern the bridge builds, or a Megatron-Bridge that reads it"
        ]
    keys = ", ".join(f"{k}={json.dumps(config[k])}" for k in ignored)
    sets = " ".join(f"--model-set {k}={json.dumps(user.neutral(k, layers))}" for k in ignored)
    return [
        f"{keys}: {bridge_name} ignores {', '.join(ignored)}: {what}, so the checkpoint's dense layers would not "
        f"fit the experts it builds there. Way out: verify the variant the bridge builds (the config.json alone "
        f"with {sets}, random weights; model_set in a scenario file), or a Megatron-Bridge that reads "
        f"{', '.join(ignored)}"
    ]


def _explaining(config: dict, present: list[str], built: tuple[int, ...], *, layers: int) -> tuple[str, ...] | None:
    """The fewest layer-pattern keys that, at their neutral values, give the pattern the bridge built."""
    for size in range(1, len(present) + 1):
        for keys in itertools.combinations(present, size):
            changed = dict(config, **{k: user.neutral(k, layers) for k in keys})
            if user.shape_of(changed).moe_layers == built:
                return keys
    return None


def _span(layers: Sequence[int], total: int) -> str:
    if tuple(layers) == tuple(range(total)):
        return f"0-{total - 1} (every layer)"
    return ", ".join(map(str, layers)) or "none"


# ---------------------------------------------------------------------------------------- mapped, then set
def _override_problems(config: dict, hf_config, model_bridge, provider, *, bridge_name: str) -> list[str]:
    try:
        mapped = model_bridge.hf_config_to_provider_kwargs(hf_config)
    except Exception:  # noqa: BLE001 (a config the mapping cannot read was refused by to_megatron_provider already)
        return []
    out = []
    for hf_key, megatron_key in getattr(type(model_bridge), "CONFIG_MAPPING", ()):
        if megatron_key not in _ARCHITECTURE or megatron_key not in mapped or hf_key not in config:
            continue
        want, got = mapped[megatron_key], _ARCHITECTURE[megatron_key](provider)
        if _same(want, got):
            continue
        value = json.dumps(got) if isinstance(got, (bool, int, float, str)) else "..."
        out.append(
            f"{hf_key}={json.dumps(config[hf_key])}: {bridge_name} maps it to {megatron_key}={want!r}, then "
            f"builds {megatron_key}={got!r}: another model than the checkpoint's. Way out: verify the variant "
            f"the bridge builds (the config.json alone with --model-set {hf_key}={value}, random weights), "
            f"or a Megatron-Bridge that keeps {hf_key}"
        )
    return out


def _same(want: Any, got: Any) -> bool:
    if want is None or got is None:
        return (want or 0) == (got or 0)  # "no groups" is None in one place and 0 in another
    if isinstance(want, bool) or isinstance(got, bool):
        return bool(want) == bool(got)
    return want == got
