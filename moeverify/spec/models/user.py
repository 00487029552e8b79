"""The user's own model: an HF model directory or a ``config.json``, with ``--model-set`` overrides.

A user model is a ``ModelRef`` (``ref.py``: the path and the overrides), which stands where a built-in
family does: in ``families.hf_config_dict`` / ``family_shape`` / ``hf_checkpoint`` and in ``models.build``.
Its key (``model:NAME``, ``NAME`` the directory's name, plus a short hash of the overrides when there are
some) names it in scenario names and messages only. The scenario carries the reference to every rank, which
reads the model from it again (``load``); nothing is registered.

Weights:
- a directory holding ``*.safetensors`` files: its real weights, read through Megatron-Bridge's own
  loading path (per tensor, from the safetensors files; nothing is copied). ``--model-set`` is refused
  there: the weights would not fit an altered config.
- a directory without weights, or a ``config.json`` given as a file: deterministic random weights per seed,
  written once to the cache dir as the built-in families are (bf16, an expert-bias tensor in fp32).
- pickled weights only (``pytorch_model.bin``, ``*.pt``): refused; a user's pickle is never loaded.

Refused with the reason (``UsageError``, the CLI exits 2): a missing or unreadable config, a config that is
not a JSON object or names no ``architectures``/``model_type``, an architecture transformers does not
have (remote code is never run), an override key the architecture's config class does not have, an
override key that neither the architecture's config nor its modeling code knows (a typo would be
ignored), an override value of another type than the config's.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import importlib.util
import inspect
import json
import os
import re
import struct
import sys
from pathlib import Path
from typing import Any

import yaml

from moeverify.errors import UsageError, more
from moeverify.spec.layout import ModelShape
from moeverify.spec.models.ref import PREFIX, ModelRef

CONFIG = "config.json"
_PICKLED = ("pytorch_model.bin", "*.pt", "*.pth", "pytorch_model-*.bin")


@dataclasses.dataclass(frozen=True, kw_only=True)
class UserModel:
    """One user model as read: its reference (path and overrides) and its normalised config."""

    ref: ModelRef
    config: dict = dataclasses.field(compare=False, hash=False, repr=False)

    @property
    def path(self) -> Path:  # the directory, or the config.json file given
        return self.ref.user_path

    @property
    def overrides(self) -> tuple[tuple[str, Any], ...]:
        return self.ref.overrides

    @property
    def key(self) -> str:
        return self.ref.key

    @property
    def name(self) -> str:
        return self.ref.name

    @property
    def weights_dir(self) -> Path | None:
        """The directory of real safetensors weights, or None (random weights per seed)."""
        if self.path.is_file():
            return None
        return self.path if any(self.path.glob("*.safetensors")) else None

    def describe(self) -> str:
        sets = " ".join(f"{k}={json.dumps(v)}" for k, v in self.overrides)
        weights = "real weights" if self.weights_dir else "random weights per seed"
        return f"{self.path} ({weights}{', set ' + sets if sets else ''})"


def is_user_key(key: object) -> bool:
    return isinstance(key, str) and key.startswith(PREFIX)


def read(path: str | Path, overrides: dict | None = None, *, where: str = "--model") -> UserModel:
    """Read and check the model at ``path`` with ``overrides`` (``UsageError`` naming ``where``)."""
    path = Path(path).expanduser()
    if not path.exists():
        raise UsageError(f"{where}: {path} does not exist (expected an HF model directory or a config.json)")
    return load(ModelRef.user(path.resolve(), overrides), where=where)


# A memo of what was read, by value: the same reference and the same config file read the same model.
_READ: dict[tuple[ModelRef, tuple[int, int] | None], UserModel] = {}


def load(ref: ModelRef, *, where: str = "scenario model") -> UserModel:
    """The user model of ``ref`` (read once per process while its config file is unchanged)."""
    if not ref.is_user:
        raise UsageError(f"{where}: {ref.key} is a built-in family, not a user model")
    path = ref.user_path
    config_path = path if path.is_file() else path / CONFIG
    try:
        stat = config_path.stat()
        stamp = (stat.st_mtime_ns, stat.st_size)
    except OSError:
        stamp = None
    model = _READ.get((ref, stamp))
    if model is None:
        model = _READ[(ref, stamp)] = _read(ref, where=where)
    return model


def _read(ref: ModelRef, *, where: str) -> UserModel:
    path = ref.user_path
    if not path.exists():
        raise UsageError(f"{where}: {path} does not exist (expected an HF model directory or a config.json)")
    config_path = path if path.is_file() else path / CONFIG
    if path.is_dir() and not config_path.is_file():
        raise UsageError(f"{where}: {path} has no {CONFIG} (expected an HF model directory)")
    config = _read_config(config_path, where=where)
    items = ref.overrides
    model = UserModel(ref=ref, config={})
    if items and model.weights_dir is not None:
        raise UsageError(
            f"{where}: {path} holds real weights, which would not fit a config changed by "
            f"--model-set {', '.join(k for k, _ in items)}; give {config_path} (the config alone, "
            "random weights per seed) or drop the overrides"
        )
    if model.weights_dir is None and path.is_dir():
        pickled = sorted(p.name for pattern in _PICKLED for p in path.glob(pattern))
        if pickled:
            raise UsageError(
                f"{where}: {path} holds only pickled weights ({', '.join(pickled[:3])}); moeverify "
                "never unpickles a user's file: convert them to safetensors, or give the "
                f"{CONFIG} file alone for random weights"
            )
    if model.weights_dir is not None:
        check_weights(model.weights_dir, where=where)
    _check_overrides(config, items, where=where)
    return dataclasses.replace(model, config=_normalised(config, items, where=where))


INDEX = "model.safetensors.index.json"  # the name transformers writes (models.checkpoint reads the same)
_HEADER_MAX = 100 << 20  # safetensors' own limit on a header's length


def _safetensors_names(path: Path, *, where: str) -> set[str]:
    """The tensor names a safetensors file's header lists (the header alone is read)."""
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            head = f.read(8)
            n = struct.unpack("<Q", head)[0] if len(head) == 8 else None
            if n is None or n > min(size - 8, _HEADER_MAX):
                raise UsageError(
                    f"{where}: {path}: not a safetensors file (expected an 8-byte header length and a "
                    f"JSON header of at most the file's {size} bytes)"
                )
            header = json.loads(f.read(n))
    except OSError as exc:
        raise UsageError(f"{where}: {path}: cannot read: {exc.strerror or exc}") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise UsageError(f"{where}: {path}: not a safetensors file (its header is not JSON: {exc})") from None
    if not isinstance(header, dict):
        raise UsageError(
            f"{where}: {path}: not a safetensors file (expected a JSON object header, got {type(header).__name__})"
        )
    return {name for name in header if name != "__metadata__"}


def check_weights(directory: Path, *, where: str = "--model") -> None:
    """Refuse (``UsageError``) a directory of safetensors weights Megatron-Bridge could not read on the ranks: a file
    whose header is not a safetensors header; with ``model.safetensors.index.json``, an index that is not a
    ``weight_map`` of tensor name -> file, or that names a file the directory lacks or a tensor its file does not
    hold. Headers only are read (no tensor data, no torch)."""
    directory = Path(directory)
    index = directory / INDEX
    if not index.exists():
        for path in sorted(directory.glob("*.safetensors")):
            _safetensors_names(path, where=where)
        return
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8")).get("weight_map")
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"{where}: {index}: cannot read: {exc}") from None
    except json.JSONDecodeError as exc:
        raise UsageError(f"{where}: {index}: not valid JSON: {exc}") from None
    except AttributeError:
        weight_map = None
    if (
        not isinstance(weight_map, dict)
        or not weight_map
        or not all(isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items())
    ):
        raise UsageError(
            f'{where}: {index}: expected a JSON object whose "weight_map" maps each tensor name to '
            f"the safetensors file holding it, got weight_map {str(weight_map)[:200]}"
        )
    by_file: dict[str, list[str]] = {}
    for name, fname in weight_map.items():
        by_file.setdefault(fname, []).append(name)
    for fname, names in sorted(by_file.items()):
        path = directory / fname
        if Path(fname).is_absolute() or ".." in Path(fname).parts or not path.is_file():
            raise UsageError(
                f"{where}: {index}: weight_map names {names[0]!r}"
                + more(len(names), 1, what="tensors")
                + f" in {fname!r}, which is not a file in {directory}"
            )
        held = _safetensors_names(path, where=where)
        missing = [name for name in names if name not in held]
        if missing:
            raise UsageError(
                f"{where}: {index}: weight_map names {missing[0]!r} in {fname}, which does not hold it"
                + more(len(missing), 1, what="tensors of that file missing too")
                + f": expected it in the file's header, which lists {len(held)} tensors"
                + (f" ({', '.join(repr(n) for n in sorted(held)[:3])}, ...)" if held else "")
            )


def parse_sets(items: list[str] | tuple[str, ...], *, where: str = "--model-set") -> dict:
    """``key=value`` strings to a dict; values read as YAML scalars/lists (4, 0.5, true, [1, 2], null)."""
    out: dict = {}
    for item in items:
        key, sep, text = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise UsageError(f"{where}: expected key=value, got {item!r}")
        if key in out:
            raise UsageError(f"{where}: {key} given twice")
        try:
            out[key] = yaml.safe_load(text) if text.strip() else text
        except yaml.YAMLError as exc:
            raise UsageError(f"{where}: {key}: value {text!r} is not a plain value: {exc}") from None
    return out


def _read_config(config_path: Path, *, where: str) -> dict:
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"{where}: {config_path}: cannot read: {exc}") from None
    except json.JSONDecodeError as exc:
        raise UsageError(f"{where}: {config_path}: not valid JSON: {exc}") from None
    if not isinstance(config, dict):
        raise UsageError(f"{where}: {config_path}: expected a JSON object, got {type(config).__name__}")
    archs = config.get("architectures")
    if not (isinstance(archs, list) and len(archs) == 1 and isinstance(archs[0], str)):
        raise UsageError(
            f"{where}: {config_path}: 'architectures' must name exactly one model class "
            f'(e.g. ["Qwen3MoeForCausalLM"]), got {archs!r}'
        )
    if not isinstance(config.get("model_type"), str):
        raise UsageError(f"{where}: {config_path}: 'model_type' is missing")
    import transformers  # lazy: transformers

    if not hasattr(transformers, archs[0]):
        raise UsageError(
            f"{where}: {config_path}: transformers {transformers.__version__} has no class "
            f"{archs[0]} (models that need remote code are not run)"
        )
    try:
        transformers.AutoConfig.for_model(config["model_type"])
    except (ValueError, KeyError):
        raise UsageError(
            f"{where}: {config_path}: transformers {transformers.__version__} does not know "
            f"model_type {config['model_type']!r}"
        ) from None
    return config


def _check_overrides(config: dict, items: tuple[tuple[str, Any], ...], *, where: str) -> None:
    import transformers  # lazy: transformers

    empty = transformers.AutoConfig.for_model(config["model_type"])
    defaults = dict(empty.to_dict(), **{alias: None for alias in getattr(empty, "attribute_map", {})})
    source = None
    for key, value in items:
        if key in ("architectures", "model_type"):
            raise UsageError(
                f"{where}: {key}: names the model's class, not a setting of it (an override would change the "
                f"name alone); give a config.json of the architecture to check"
            )
        if key not in config and key not in defaults:
            source = _modeling_source(config) if source is None else source
            known = re.search(rf"\b{re.escape(key)}\b", source) is not None
        else:
            known = True
        if not known:
            close = difflib.get_close_matches(key, sorted(set(defaults) | set(config)), n=3)
            raise UsageError(
                f"{where}: {key}: {config['model_type']}'s config has no such key"
                + (f" (did you mean {', '.join(close)}?)" if close else "")
            )
        canonical = getattr(empty, "attribute_map", {}).get(key, key)
        current = config.get(canonical, config.get(key, defaults.get(canonical)))
        if current is not None and value is not None and not _same_kind(current, value):
            kind = type(current).__name__
            raise UsageError(
                f"{where}: {key}={json.dumps(value)}: expected {'an' if kind[0] in 'aeiou' else 'a'} "
                f"{kind} like the config's {json.dumps(current)}"
            )


def _normalised(config: dict, items: tuple[tuple[str, Any], ...], *, where: str) -> dict:
    """The config as its transformers class reads it, overrides applied under their canonical names.

    A config class may spell a key two ways (transformers 5's Qwen3-MoE saves ``num_local_experts`` and
    maps ``num_experts`` onto it): an override under either name must win, and every override must read
    back unchanged from the class, else it would be silently lost.
    """
    import transformers  # lazy: transformers

    aliases = dict(getattr(transformers.AutoConfig.for_model(config["model_type"]), "attribute_map", {}))
    merged = dict(config)
    for key, value in items:
        canonical = aliases.get(key, key)
        for alias in [k for k, v in aliases.items() if v == canonical] + [canonical]:
            merged.pop(alias, None)
        merged[canonical] = value
    _follow_layer_count(config, merged, dict(items), where=where)
    kwargs = {k: v for k, v in merged.items() if k not in ("model_type", "transformers_version")}
    try:
        obj = transformers.AutoConfig.for_model(config["model_type"], **kwargs)
    except Exception as exc:  # noqa: BLE001 (TypeError, ValueError, huggingface_hub's validation errors: the config's)
        raise UsageError(
            f"{where}: {config['model_type']}'s config class refuses this config: {type(exc).__name__}: {exc}"
        ) from None
    for key, value in items:
        got = getattr(obj, key, None)
        if got != value and not (isinstance(got, tuple) and list(got) == value):
            raise UsageError(
                f"{where}: {key}={json.dumps(value)} does not hold: {config['model_type']}'s config "
                f"class reads it back as {got!r}"
            )
    out = obj.to_dict()
    out["architectures"] = list(config["architectures"])
    return out


_PER_LAYER_LISTS = ("layer_types", "mlp_layer_types")  # one entry per decoder layer (hybrid attention, dense/MoE)


def _follow_layer_count(config: dict, merged: dict, overrides: dict, *, where: str) -> None:
    """``num_hidden_layers`` made smaller keeps the first layers of the per-layer lists the config spells out
    (Qwen3-Next's linear/full attention pattern, a dense prefix), unless they are set too; made larger, there is
    no pattern to guess: the lists must be given."""
    if "num_hidden_layers" not in overrides:
        return
    old, new = config.get("num_hidden_layers"), overrides["num_hidden_layers"]
    for key in _PER_LAYER_LISTS:
        values = config.get(key)
        if key in overrides or not isinstance(values, list) or len(values) != old or not isinstance(new, int):
            continue
        if new > old:
            raise UsageError(
                f"{where}: num_hidden_layers={new} is more than the config's {old}, whose {key} has one "
                f"entry per layer: give --model-set {key}=[...] with {new} entries too"
            )
        merged[key] = values[:new]


def _modeling_source(config: dict) -> str:
    """The source of the architecture's modeling module: a key it reads is a real setting."""
    import transformers  # lazy: transformers

    cls = getattr(transformers, config["architectures"][0])
    return inspect.getsource(sys.modules[cls.__module__])


def _same_kind(current: Any, value: Any) -> bool:
    if isinstance(current, bool) or isinstance(value, bool):
        return isinstance(current, bool) and isinstance(value, bool)
    if isinstance(current, (int, float)):
        return isinstance(value, int) if isinstance(current, int) else isinstance(value, (int, float))
    return type(current) is type(value) or (isinstance(current, (list, tuple)) and isinstance(value, (list, tuple)))


# ----------------------------------------------------------------------------------------- shape
_EXPERT_KEYS = ("num_experts", "n_routed_experts", "num_local_experts", "moe_num_experts")
_TOPK_KEYS = ("num_experts_per_tok", "moe_k")
# Sizes every config states as a positive integer; a layer count past any released model's is refused before the
# layer pattern (one entry a layer) is read: a typo's 10**12 layers would fill the memory.
_SIZE_KEYS = ("num_hidden_layers", "num_attention_heads", "hidden_size", "vocab_size", "num_key_value_heads")
MAX_LAYERS = 10_000


def _check_sizes(config: dict, *, where: str) -> None:
    for key in _SIZE_KEYS:
        value = config.get(key)
        if value is None and key != "num_hidden_layers":
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise UsageError(f"{where}: {key}={value!r}: expected a positive integer")
    if config["num_hidden_layers"] > MAX_LAYERS:
        raise UsageError(
            f"{where}: num_hidden_layers={config['num_hidden_layers']}: more than {MAX_LAYERS} decoder layers "
            "is no model's (a typo?)"
        )
    for key in _EXPERT_KEYS:
        value = config.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value < 0:
            raise UsageError(f"{where}: {key}={value}: expected 0 or more experts")


def shape_of(config: dict, *, where: str = "model") -> ModelShape:
    """Layer, head and expert counts of an HF config, with which global layers are MoE layers.

    The MoE-layer rules are transformers' (what the HF model builds): a layer-pattern key the architecture's
    modeling code never reads is no rule (transformers 5's DeepSeek-V2 ignores ``moe_layer_freq``). What
    Megatron-Bridge builds is checked against it before any rank starts (``bridge_limits``) and on every rank
    (``builder``).
    """
    try:
        layers = int(config["num_hidden_layers"])
        heads = int(config["num_attention_heads"])
    except (KeyError, TypeError, ValueError) as exc:
        raise UsageError(f"{where}: config needs integer num_hidden_layers and num_attention_heads ({exc})") from None
    _check_sizes(config, where=where)
    groups = config.get("num_key_value_heads") or heads
    experts = next((config[k] for k in _EXPERT_KEYS if config.get(k)), 0)
    if isinstance(experts, list):  # e.g. a per-modality list
        experts = experts[0]
    top_k = next((config[k] for k in _TOPK_KEYS if config.get(k) is not None), None)
    if experts and isinstance(top_k, int) and not isinstance(top_k, bool) and not 1 <= top_k <= int(experts):
        raise UsageError(f"{where}: top-k {top_k} of {experts} experts: expected 1 .. {experts}")
    linear: tuple[int, int] | tuple[()] = ()
    if "linear_attention" in (config.get("layer_types") or ()) or config.get("linear_num_key_heads"):
        linear = (int(config.get("linear_num_key_heads") or 0), int(config.get("linear_num_value_heads") or 0))
    return ModelShape(
        num_layers=layers,
        num_heads=heads,
        num_query_groups=int(groups),
        num_experts=int(experts),
        moe_layers=_moe_layers(pattern_read(config), layers) if experts else (),
        linear_heads=linear,
    )


# Keys that say which decoder layers are MoE, with the value under which each says nothing (every layer MoE).
PATTERN_KEYS: dict[str, object] = {
    "mlp_layer_types": None,
    "first_k_dense_replace": 0,
    "moe_layer_freq": 1,
    "moe_layer_start_index": 0,
    "moe_layer_end_index": None,
    "moe_layer_interval": 1,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
}


def neutral(key: str, layers: int) -> Any:
    """The value of layer-pattern ``key`` under which it makes no layer dense."""
    if key == "mlp_layer_types":
        return ["sparse"] * layers
    return layers - 1 if key == "moe_layer_end_index" else PATTERN_KEYS[key]


def pattern_read(config: dict) -> dict:
    """``config`` without the layer-pattern keys that neither its transformers modeling code nor its config class
    reads. Applies to a config as transformers' config class writes it (``transformers_version`` set: every user
    model, normalised when read), whose derived keys are spelled out (GLM-4.7-Flash's ``mlp_layer_types``);
    the built-in families' hand-written kwargs are read as written, their rules pinned by their tests."""
    model_type = config.get("model_type")
    written = isinstance(model_type, str) and "transformers_version" in config
    source = _pattern_source(model_type) if written else None
    if source is None:
        return config
    return {k: v for k, v in config.items() if k not in PATTERN_KEYS or re.search(rf"\b{k}\b", source)}


@functools.cache
def _pattern_source(model_type: str) -> str | None:
    """The text of transformers' modeling and configuration modules of ``model_type`` (read, not imported);
    None where transformers has none (a model type registered in code): the keys are then read as written."""
    from transformers.models.auto.configuration_auto import model_type_to_module_name  # lazy: transformers

    name = model_type_to_module_name(model_type)
    texts = []
    for kind in ("modeling", "configuration"):
        try:
            spec = importlib.util.find_spec(f"transformers.models.{name}.{kind}_{name}")
        except (ImportError, ValueError):
            return None
        if spec is None or not spec.origin:
            return None
        texts.append(Path(spec.origin).read_text(encoding="utf-8"))
    return "\n".join(texts)


def _moe_layers(config: dict, layers: int) -> tuple[int, ...]:
    if "mlp_layer_types" in config and isinstance(config["mlp_layer_types"], list):
        return tuple(i for i, kind in enumerate(config["mlp_layer_types"]) if kind == "sparse")
    if "first_k_dense_replace" in config:
        freq = config.get("moe_layer_freq") or 1
        first = int(config["first_k_dense_replace"] or 0)
        return tuple(i for i in range(first, layers) if i % int(freq) == 0)
    if "moe_layer_start_index" in config:
        start = int(config["moe_layer_start_index"])
        end = config.get("moe_layer_end_index")
        end = layers - 1 if end in (None, -1) else int(end)
        step = int(config.get("moe_layer_interval") or 1)  # transformers' Ernie-4.5: (i + 1) % interval == 0
        return tuple(i for i in range(start, end + 1) if (i + 1) % step == 0)
    if "decoder_sparse_step" in config or "mlp_only_layers" in config:
        step = int(config.get("decoder_sparse_step") or 1)
        dense = set(config.get("mlp_only_layers") or ())
        return tuple(i for i in range(layers) if i not in dense and (i + 1) % step == 0)
    return tuple(range(layers))
