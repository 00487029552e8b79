"""Scenario files: YAML in, validated ``Scenario`` objects out.

The format is documented at the top of ``scenarios/release.yaml``. Everything is checked when the
file is loaded (keys, families, checks, layouts against the family's shape, duplicate names, world
sizes), so a bad file fails in a second with ``file:line``, the scenario and the rule, never an hour
into a run. Every error is a ``UsageError``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from moeverify.errors import LayoutError, UsageError
from moeverify.spec import options
from moeverify.spec.checks import CHECKS, check_names
from moeverify.spec.expectations import ExpectedFailure
from moeverify.spec.expectations import parse as parse_expect_fail
from moeverify.spec.layout import Layout, ModelShape
from moeverify.spec.models import user
from moeverify.spec.models.configs import FAMILIES, family_shape
from moeverify.spec.models.ref import ModelRef, as_ref
from moeverify.spec.yaml_file import Where, error, read_yaml

FORMAT_VERSION = 1
CPU_MAX_WORLD_SIZE = 8  # CPU ranks are processes: allowed up to 8 whatever the core count

_TOP_KEYS = frozenset({"version", "defaults", "scenarios", "matrix"})
_FIELD_KEYS = frozenset({"checks", "seed", "gpu_only", "options", "expect_fail"})
_DEFAULT_KEYS = (_FIELD_KEYS - {"expect_fail"}) | {"world_size", "moe_checks"}  # findings are per family
_SCENARIO_KEYS = _FIELD_KEYS | {"family", "model", "model_set", "world_size", "layout"}
_MATRIX_KEYS = _FIELD_KEYS | {"families", "models", "layouts", "world_size", "moe_checks"}
_MODEL_KEYS = frozenset({"path", "set"})
_MATRIX_LAYOUT_KEYS = frozenset({"world_size", "gpu_only"})
_LAYOUT_KEYS = frozenset(f.name for f in dataclasses.fields(Layout))


@dataclasses.dataclass(frozen=True, kw_only=True)
class Scenario:
    """One ``family/layout`` entry of a scenario file."""

    family: str
    layout: Layout
    world_size: int
    checks: tuple[str, ...]
    seed: int = 0
    gpu_only: str | None = None  # the reason, when this scenario cannot run on CPU ranks
    options: dict[str, Any] = dataclasses.field(default_factory=dict)  # per-scenario check options
    source: str = ""  # "file.yaml" where it was defined, for messages
    model: ModelRef | None = None  # the model run (filled from ``family`` for a built-in family: ``ref``)
    unfit: str | None = None  # why the user model given with --model cannot run this layout (skipped)
    expect_fail: tuple[ExpectedFailure, ...] = ()  # known findings that make a check fail (expectations.py)

    @property
    def ref(self) -> ModelRef:
        """The model run (``model``, never None once built)."""
        if self.model is None:
            raise UsageError(f"scenario {self.family}: no model reference")
        return self.model

    def __post_init__(self) -> None:
        if self.model is None:
            object.__setattr__(self, "model", ModelRef.builtin(self.family))
        elif self.model.key != self.family:
            raise UsageError(f"scenario {self.family}: its model reference reads as {self.model.key}")

    @property
    def name(self) -> str:
        return f"{self.family}/{self.layout.name(self.world_size)}"


# ------------------------------------------------------------------------------------- families
def _families() -> dict[str, ModelShape]:
    """Family name -> its ModelShape, from ``moeverify.models``."""
    return {name: family_shape(name) for name in FAMILIES}


# --------------------------------------------------------------------------------------- fields
def _check_keys(where: Where, mapping: object, allowed: Collection[str], what: str) -> Mapping:
    if not isinstance(mapping, Mapping):
        raise error(where, f"{what} must be a mapping, got {type(mapping).__name__}")
    unknown = sorted(str(k) for k in mapping if k not in allowed)
    if unknown:
        raise error(where, f"unknown {what} key(s) {unknown}; allowed: {sorted(allowed)}")
    return mapping


def _int_field(where: Where, value: object, name: str, *, minimum: int, maximum: int | None = None) -> int:
    if (
        not isinstance(value, int)
        or isinstance(value, bool)
        or value < minimum
        or (maximum is not None and value > maximum)
    ):
        bound = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
        raise error(where, f"{name} must be an integer {bound}, got {value!r}")
    return value


MAX_SEED = 2**31 - 1  # Megatron offsets the seed per rank (tp, ep, pp) before torch's 64-bit seeding


def _checks_field(where: Where, value: object, known: Collection[str], *, name: str = "checks") -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(c, str) for c in value):
        raise error(where, f"{name} must be a list of check names, got {value!r}")
    for check in value:
        if check not in known:
            raise error(where, f"unknown check {check!r}; known checks: {', '.join(sorted(known))}")
    dups = sorted({c for c in value if value.count(c) > 1})
    if dups:
        raise error(where, f"check(s) {dups} listed twice in {name}")
    return tuple(value)


def _options_field(where: Where, value: object) -> dict[str, Any]:
    if not isinstance(value, Mapping):
        raise error(where, f"options must be a mapping, got {type(value).__name__}")
    return {key: options.validate(where, key, item) for key, item in value.items()}  # normalised values


def _gpu_only_field(where: Where, value: object) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not value.strip():
        raise error(where, f"gpu_only must be a reason (non-empty string) or null, got {value!r}")
    return value.strip()


def _user_model(where: Where, value: object, sets: object = None) -> ModelRef:
    """Read and check the user model of ``model: PATH`` (or ``{path, set}``), relative to the file."""
    if isinstance(value, Mapping):
        entry = _check_keys(where, value, _MODEL_KEYS, "model")
        if sets is not None:
            raise error(where, "give the overrides once: model: {path, set} or model_set, not both")
        value, sets = entry.get("path"), entry.get("set")
    if not isinstance(value, str) or not value.strip():
        raise error(where, f"model must be a path (an HF model directory or a config.json), got {value!r}")
    if sets is not None and not isinstance(sets, Mapping):
        raise error(where, f"model_set must be a mapping of config keys to values, got {type(sets).__name__}")
    path = Path(value).expanduser()
    if not path.is_absolute():
        path = Path(where.path).resolve().parent / path
    return user.read(path, dict(sets or {}), where=str(where)).ref


def _shape_of(family: object, families: Mapping[str, ModelShape]) -> ModelShape | None:
    if isinstance(family, ModelRef) and not family.is_user:
        family = family.family
    if isinstance(family, ModelRef):
        return user.shape_of(user.load(family).config, where=family.key)
    return families.get(family) if isinstance(family, str) else None


def _key(family: object) -> object:
    """A spec's family as scenario names spell it (a user model's key)."""
    return family.key if isinstance(family, ModelRef) else family


# -------------------------------------------------------------------------------------- entries
@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class _Spec:
    """One scenario before validation against its family: merged fields, plus where it came from."""

    where: Where
    family: object
    world_size: object
    layout: object
    fields: Mapping


def _layout_of(where: Where, mapping: object) -> Layout:
    mapping = _check_keys(where, mapping if mapping is not None else {}, _LAYOUT_KEYS, "layout")
    try:
        return Layout.from_mapping(dict(mapping))
    except LayoutError as exc:
        raise error(where, f"invalid layout: {exc}") from None
    except TypeError as exc:
        raise error(where, f"invalid layout: {exc}") from None


def _build(
    spec: _Spec,
    *,
    families: Mapping[str, ModelShape],
    checks: Collection[str],
    moe_checks: Sequence[str] = (),
    fit_or_skip: bool = False,
) -> Scenario:
    """A validated scenario; with ``fit_or_skip`` (``--model``) a layout its model does not admit is marked
    ``unfit``, and ``expect_fail`` is not applied: the file's findings are about the file's own families."""
    where = spec.where
    shape = _shape_of(spec.family, families)
    family = _key(spec.family)
    if shape is None:
        raise error(where, f"unknown family {family!r}; known families: {', '.join(families)}")
    if spec.world_size is None:
        raise error(where, "world_size is missing (set it on the scenario or in defaults)")
    world_size = _int_field(where, spec.world_size, "world_size", minimum=1)
    layout = _layout_of(where, spec.layout)
    name = f"{family}/{layout.name(world_size)}"
    where = Where(path=where.path, line=where.line, scenario=name)
    unfit = None
    try:
        layout.validate(world_size=world_size, shape=shape)
    except LayoutError as exc:
        if not fit_or_skip:
            raise error(where, f"invalid layout: {exc}") from None
        try:
            layout.validate(world_size=world_size)
        except LayoutError as bad:
            raise error(where, f"invalid layout: {bad}") from None
        unfit = f"{family} does not admit this layout: {exc}"
    if "checks" not in spec.fields:
        raise error(where, "checks is missing (set it on the scenario or in defaults)")
    check_list = list(_checks_field(where, spec.fields["checks"], checks))
    if shape.is_moe:
        check_list += [c for c in moe_checks if c not in check_list]
    if not check_list:
        raise error(where, "checks is empty: a scenario must run at least one check")
    scenario_options = _options_field(where, spec.fields.get("options", {}))
    dense_only = [c for c in check_list if c in CHECKS and CHECKS[c].needs_moe and not shape.is_moe]
    if dense_only:
        why = f"check {dense_only[0]} runs on MoE routers; {family} is a dense model (no MoE layer)"
        if not fit_or_skip:
            raise error(where, why)
        unfit = unfit or why  # --model: reported skipped with the rule, as a layout the model does not admit
    for check in check_list:  # each check's own rule (moeverify.spec.checks: CheckSpec.scenario_rule)
        refusal = CHECKS[check].refusal(scenario_options, layout, world_size=world_size) if check in CHECKS else None
        if refusal:
            raise error(where, refusal)
    expect_fail = (
        ()
        if fit_or_skip
        else parse_expect_fail(where, spec.fields.get("expect_fail"), checks=check_list, options=scenario_options)
    )
    return Scenario(
        family=str(family),
        layout=layout,
        world_size=world_size,
        checks=tuple(check_list),
        seed=_int_field(where, spec.fields.get("seed", 0), "seed", minimum=0, maximum=MAX_SEED),
        gpu_only=_gpu_only_field(where, spec.fields.get("gpu_only")),
        options=scenario_options,
        unfit=unfit,
        expect_fail=expect_fail,
        source=f"{where.path}:{where.line}" if where.line else where.path,
        model=spec.family if isinstance(spec.family, ModelRef) else None,
    )


def _merge_fields(defaults: Mapping, entry: Mapping) -> dict:
    merged = {k: v for k, v in defaults.items() if k in _FIELD_KEYS}
    for key in _FIELD_KEYS:
        if key in entry:
            merged[key] = (
                {**merged.get("options", {}), **entry[key]}
                if key == "options" and isinstance(entry[key], Mapping)
                else entry[key]
            )
    return merged


def _validated_defaults(where: Where, raw: object, checks: Collection[str]) -> dict:
    if raw is None:
        return {}
    defaults = _check_keys(where.at(raw), raw, _DEFAULT_KEYS, "defaults")
    here = where.at(defaults)
    if "checks" in defaults:
        _checks_field(here, defaults["checks"], checks)
    if "moe_checks" in defaults:
        _checks_field(here, defaults["moe_checks"], checks, name="moe_checks")
    if "options" in defaults:
        _options_field(here, defaults["options"])
    return dict(defaults)


def _explicit_specs(where: Where, entries: object, defaults: Mapping) -> list[_Spec]:
    if not isinstance(entries, list):
        raise error(where, f"scenarios must be a list of mappings, got {type(entries).__name__}")
    specs = []
    for entry in entries:
        here = where.at(entry)
        entry = _check_keys(here, entry, _SCENARIO_KEYS, "scenario")
        family = entry.get("family")
        if "model" in entry:
            if family is not None:
                raise error(here, "give family or model, not both")
            family = _user_model(here, entry["model"], entry.get("model_set"))
        elif "model_set" in entry:
            raise error(here, "model_set needs model: PATH")
        specs.append(
            _Spec(
                where=here,
                family=family,
                world_size=entry.get("world_size", defaults.get("world_size")),
                layout=entry.get("layout"),
                fields=_merge_fields(defaults, entry),
            )
        )
    return specs


def _is_expert_layout(layout: Mapping) -> bool:
    return layout.get("ep", 1) != 1 or layout.get("etp") is not None


def _matrix_specs(
    where: Where,
    blocks: object,
    defaults: Mapping,
    families: Mapping[str, ModelShape],
    checks: Collection[str],
    model: ModelRef | None = None,
) -> list[tuple[_Spec, tuple]]:
    """Expand ``matrix`` blocks: families x layouts; dense families skip expert layouts.

    ``model`` (a user model) stands for every block's families and models.
    """
    if not isinstance(blocks, list):
        raise error(where, f"matrix must be a list of blocks, got {type(blocks).__name__}")
    out = []
    for block in blocks:
        here = where.at(block)
        block = _check_keys(here, block, _MATRIX_KEYS, "matrix block")
        fams, layouts = block.get("families", []), block.get("layouts")
        if not isinstance(fams, list) or not isinstance(block.get("models", []), list):
            raise error(here, "matrix block: families and models must be lists")
        fams = [model] if model else fams + [_user_model(here.at(m), m) for m in block.get("models", [])]
        if not fams:
            raise error(here, f"matrix block needs families (or models): a non-empty list, got {fams!r}")
        if not isinstance(layouts, list) or not layouts:
            raise error(here, f"matrix block needs layouts: a non-empty list, got {layouts!r}")
        moe_checks = _checks_field(
            here, block.get("moe_checks", defaults.get("moe_checks", [])), checks, name="moe_checks"
        )
        fields = _merge_fields(defaults, block)
        for raw in layouts:
            at = here.at(raw)
            raw = _check_keys(at, raw, _LAYOUT_KEYS | _MATRIX_LAYOUT_KEYS, "matrix layout")
            for family in fams:
                shape = _shape_of(family, families)
                layout = {k: v for k, v in raw.items() if k in _LAYOUT_KEYS}
                if layout.get("sp") == "moe":
                    layout["sp"] = shape is not None and shape.is_moe
                if shape is not None and not shape.is_moe and _is_expert_layout(layout):
                    continue
                spec_fields = {**fields, **({"gpu_only": raw["gpu_only"]} if "gpu_only" in raw else {})}
                world = raw.get("world_size", block.get("world_size", defaults.get("world_size")))
                out.append(
                    (_Spec(where=at, family=family, world_size=world, layout=layout, fields=spec_fields), moe_checks)
                )
    return out


def load_file(
    path: str,
    *,
    checks: Collection[str],
    families: Mapping[str, ModelShape] | None = None,
    max_world_size: int = CPU_MAX_WORLD_SIZE,
    model: ModelRef | str | None = None,
) -> list[Scenario]:
    """Load and validate one scenario file. Raises ``UsageError`` naming file:line, scenario and rule.

    ``model`` (a user model from ``--model``, or a family) replaces every scenario's family or
    model; layouts it does not admit come back ``unfit`` (reported as skipped) instead of refused.
    """
    families = _families() if families is None else families
    model = None if model is None else as_ref(model)
    where = Where(path=path)
    doc = read_yaml(path)
    if doc is None:
        raise error(where, "file is empty; expected a mapping with 'scenarios' and/or 'matrix'")
    doc = _check_keys(where, doc, _TOP_KEYS, "top-level")
    version = doc.get("version", FORMAT_VERSION)
    if type(version) is not int or version != FORMAT_VERSION:  # true and 1.0 equal 1 in Python; not a version
        raise error(
            where, f"version {doc['version']!r} is not supported; this moeverify reads version {FORMAT_VERSION}"
        )
    if "scenarios" not in doc and "matrix" not in doc:
        raise error(where, "no 'scenarios' or 'matrix' section: the file defines no scenario")
    defaults = _validated_defaults(where, doc.get("defaults"), checks)
    specs = [
        (s if model is None else dataclasses.replace(s, family=model), ())
        for s in _explicit_specs(where, doc.get("scenarios", []), defaults)
    ]
    specs += _matrix_specs(where, doc.get("matrix", []), defaults, families, checks, model=model)
    scenarios = []
    for spec, moe_checks in specs:
        scenario = _build(spec, families=families, checks=checks, moe_checks=moe_checks, fit_or_skip=bool(model))
        if scenario.world_size > max_world_size:
            raise error(
                spec.where.at(None, scenario=scenario.name),
                f"world_size {scenario.world_size} exceeds the {max_world_size} ranks this machine can run",
            )
        scenarios.append(scenario)
    if not scenarios:
        raise error(where, "the file defines no scenario")
    return scenarios


def load(
    paths: Iterable[str],
    *,
    checks: Collection[str] | None = None,
    families: Mapping[str, ModelShape] | None = None,
    max_world_size: int = CPU_MAX_WORLD_SIZE,
    model: ModelRef | str | None = None,
) -> list[Scenario]:
    """Load several scenario files, in order; scenario names must be unique across all of them.

    With ``model`` (see ``load_file``) the files' families collapse onto one model, so scenarios of one
    name merge instead: their checks are united, the first one's other fields kept.
    """
    if checks is None:
        checks = check_names()
    families = _families() if families is None else families
    model = None if model is None else as_ref(model)
    seen: dict[str, Scenario] = {}
    refs: dict[str, ModelRef] = {} if model is None else {model.key: model}
    out: list[Scenario] = []
    for path in paths:
        for scenario in load_file(path, checks=checks, families=families, max_world_size=max_world_size, model=model):
            _one_model_per_key(refs, scenario)
            first = seen.get(scenario.name)
            if first is not None and model is not None:
                merged = first.checks + tuple(c for c in scenario.checks if c not in first.checks)
                seen[scenario.name] = dataclasses.replace(first, checks=merged)
                out[out.index(first)] = seen[scenario.name]
                continue
            if first is not None:
                raise UsageError(
                    f"{scenario.source}: scenario {scenario.name}: duplicate name; first defined at {first.source}"
                )
            seen[scenario.name] = scenario
            out.append(scenario)
    return out


def _one_model_per_key(refs: dict[str, ModelRef], scenario: Scenario) -> None:
    """Two user models whose directories share a name would share a key (and their scenarios, a name)."""
    previous = refs.setdefault(scenario.family, scenario.ref)
    if previous != scenario.ref:
        raise UsageError(
            f"{scenario.source}: two user models share the key {scenario.family!r}: {previous.path} "
            f"and {scenario.ref.path}; rename one directory"
        )


def group_by_world_size(scenarios: Iterable[Scenario]) -> dict[int, list[Scenario]]:
    """Scenarios per world size, smallest world first, file order kept within a group."""
    groups: dict[int, list[Scenario]] = {}
    for scenario in scenarios:
        groups.setdefault(scenario.world_size, []).append(scenario)
    return dict(sorted(groups.items()))


def scenario_to_dict(scenario: Scenario) -> dict:
    """JSON form of a scenario (for the worker's plan file)."""
    return {
        "family": scenario.family,
        "layout": scenario.layout.as_dict(),
        "world_size": scenario.world_size,
        "checks": list(scenario.checks),
        "seed": scenario.seed,
        "gpu_only": scenario.gpu_only,
        "options": dict(scenario.options),
        "source": scenario.source,
        "model": scenario.ref.to_dict(),
        "unfit": scenario.unfit,
        "expect_fail": [e.as_dict() for e in scenario.expect_fail],
    }


def scenario_from_dict(data: Mapping) -> Scenario:
    """Inverse of ``scenario_to_dict``; a user model is read in this process again from its reference."""
    model = ModelRef.from_dict(data["family"], data.get("model"))
    if model.is_user:
        user.load(model)
    return Scenario(
        family=data["family"],
        layout=Layout(**data["layout"]),
        world_size=data["world_size"],
        checks=tuple(data["checks"]),
        seed=data["seed"],
        gpu_only=data["gpu_only"],
        options=dict(data["options"]),
        source=data["source"],
        model=model,
        unfit=data.get("unfit"),
        expect_fail=tuple(ExpectedFailure.from_dict(e) for e in data.get("expect_fail", ())),
    )
