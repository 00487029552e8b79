"""The built-in checks, declared once: name, entry point, subchecks, typed options, scenario rule.

A ``CheckSpec`` is everything moeverify knows about a check before running it. Each check's options are one
frozen, keyword-only dataclass (``ExportOptions``, ``ReplayOptions``) whose fields carry their typed default,
their scenario-file key, help, validation and command-line flag (``option``). The rest is derived from these
declarations: the flat option table, the scenario ``options:`` validation and the ``moeverify run`` flags
(``moeverify.spec.options``), a check's ``scenario_rule`` applied when a scenario file is loaded (``scenario.py``),
the check names that ``--check``, ``--list`` and scenario files accept, the subchecks a result record and
``expect_fail`` may name (``expectations.py``), and the docs' option table. A check's own code reads its options
through its dataclass (``ReplayOptions.from_options(ctx.options)``), never by key with a default of its own.

Pure Python (no torch): the entry point is a ``"module:function"`` string, imported only when the check runs
(``resolve``), so bad names and options are refused in a fraction of a second, before torchrun starts.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable, Mapping
from typing import Any, Self

from moeverify.errors import UsageError
from moeverify.spec import plugins
from moeverify.spec import router_variants as rv
from moeverify.spec.layout import Layout

# Built-in names the options accept; plugins (``module:factory``, ``file.py:factory``) are the way out.
REPLAY_SUBCHECKS = (
    "equivalence",
    "drift",
    "recompute",
    "cross_layout",
    "native_parity",
    "backward_order",
    "validation",
    "token_counts",
    "weights",
)
# Replay subchecks that build the whole model on one rank (on every rank of the scenario), whatever the layout: a
# model that needs its layout to fit leaves them out (``replay_subchecks: in_layout``).
REPLAY_WHOLE_MODEL = {
    "cross_layout": "its reference is the model on one rank (the rollout engine's view), on the global batch",
    "validation": "bad routes are handed to a 1-rank build (a refusal on one stage would leave the others waiting)",
    "token_counts": "the counts are compared on a 1-rank build",
    "backward_order": "under pipeline parallelism its hand-written loops run on a 1-rank build",
}
REPLAY_IN_LAYOUT = tuple(s for s in REPLAY_SUBCHECKS if s not in REPLAY_WHOLE_MODEL)
# the replay recompute subcheck's modes: the TransformerConfig settings each one builds with
RECOMPUTE_MODES: dict[str, dict[str, object]] = {
    "full": dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
    "moe": dict(recompute_granularity="selective", recompute_modules=["moe"]),
}
SUBJECTS = {
    "bridge": "moeverify.subjects:bridge",
    "sharded": "moeverify.subjects:sharded",
    "gather": "moeverify.subjects:gather",
    "verl": "moeverify.subjects.verl:verl",
}
REPLAY_IMPLS = {
    "moeverify": "moeverify.oracles.replay.impls:MoeverifyReplay",
    "native": "moeverify.oracles.replay.impls:NativeReplay",
    "verl": "moeverify.oracles.replay.impls:VerlReplay",
}
RECEIVERS = {
    "fused": "moeverify.oracles.export.receiver:fused",
    "transformers": "moeverify.oracles.export.receiver_transformers:transformers_receiver",
    "vllm": "moeverify.oracles.export.receiver_vllm:vllm",  # a real vLLM in its own process (docs/engines.md)
    "vllm_repack": "moeverify.oracles.export.receiver_vllm:vllm_repack",
}


# ------------------------------------------------------------------------------------ validators
# Each takes a raw value (YAML or a command-line string) and returns the normalised value, or raises ValueError
# with the reason; ``validate_option`` adds where and which option.
def _names(allowed: tuple[str, ...], what: str) -> Callable[[object], tuple[str, ...]]:
    def check(value: object) -> tuple[str, ...]:
        items = value.split(",") if isinstance(value, str) else value
        if not isinstance(items, list | tuple) or not items:
            raise ValueError(f"expected a non-empty list of {what} (or one comma-separated string), got {value!r}")
        names = tuple(str(i).strip() for i in items if isinstance(i, str))
        if len(names) != len(items) or not all(names):
            raise ValueError(f"expected {what} as strings, got {value!r}")
        unknown = [n for n in names if n not in allowed]
        if unknown:
            raise ValueError(f"unknown {what} {unknown}; known: {', '.join(allowed)}")
        return names

    return check


def _replay_subchecks(value: object) -> tuple[str, ...]:
    """A list of replay subchecks, or ``"in_layout"``: those that build only this rank's shard
    (``REPLAY_IN_LAYOUT``)."""
    if value == "in_layout":
        return REPLAY_IN_LAYOUT
    try:
        return _names(REPLAY_SUBCHECKS, "replay subchecks")(value)
    except ValueError as exc:
        raise ValueError(f"{exc}; or 'in_layout' for {', '.join(REPLAY_IN_LAYOUT)}") from None


def _plugin(builtins: Mapping[str, str], what: str) -> Callable[[object], str]:
    def check(value: object) -> str:
        if not isinstance(value, str) or not value:
            raise ValueError(f"expected a non-empty string, got {value!r}")
        if value in builtins:
            return value
        plugins.parse(value, what=what, builtins=tuple(builtins))  # grammar only; loaded before launch
        return value

    return check


def _positive_int(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"expected a whole number >= 1, got {value!r}")
    return value


def _at_most(limit: int, what: str) -> Callable[[object], int]:
    """A whole number >= 1 and <= ``limit`` (a size past it would exhaust a rank's memory before anything ran)."""

    def check(value: object) -> int:
        value = _positive_int(value)
        if value > limit:
            raise ValueError(f"expected at most {limit} {what}, got {value}")
        return value

    return check


def _one_of(allowed: tuple[str, ...]) -> Callable[[object], str]:
    def check(value: object) -> str:
        if value not in allowed:
            raise ValueError(f"expected one of {', '.join(allowed)}, got {value!r}")
        return str(value)

    return check


def _positive_seconds(value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < float("inf"):
        raise ValueError(f"expected a finite number of seconds > 0, got {value!r}")
    return float(value)


def _bool(value: object) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"expected true or false, got {value!r}")
    return value


AUTO = "auto"


def _bool_or_auto(value: object) -> bool | str:
    """true, false, or ``"auto"`` (the option's default rule decides: ``ExportOptions.decisions``)."""
    if value != AUTO and not isinstance(value, bool):
        raise ValueError(f"expected true, false or {AUTO}, got {value!r}")
    return value


def _auto_as_none(value: bool | str) -> bool | None:
    return None if value == AUTO else bool(value)


def _router_variants(value: object) -> object:
    try:
        rv.select(value)
    except UsageError as exc:
        raise ValueError(str(exc)) from None
    return value  # kept as written ("full", a name, a list): the plan carries it to the ranks as JSON


def _path(value: object) -> str:
    if not isinstance(value, str) or not value:
        raise ValueError(f"expected a file path, got {value!r}")
    return value


# ------------------------------------------------------------------------------------ options
@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class OptionMeta:
    """What a check-options field declares beside its type and default (``option``)."""

    key: str  # the key in a scenario's ``options:`` and in ``ctx.options``
    help: str
    validate: Callable[[object], object]  # raw -> normalised value (JSON-able), or ValueError with the reason
    convert: Callable[[Any], Any] | None = None  # normalised value -> the field's value, where they differ
    flag: str | None = None  # the ``moeverify run`` flag, where there is one
    switch: bool = False  # a true/false option: ``flag`` takes no value, ``--no-NAME`` sets it false
    metavar: str = "VALUE"
    default_text: str | None = None  # the default in words, where the field's default does not say it
    plugin: str | None = None  # what a plugin given here is called in messages ("subject", ...)
    builtins: Mapping[str, str] | None = None  # a plugin option's built-in names -> "module:attr"


def option(default: Any, *, key: str, help: str, validate: Callable[[object], object], **meta: Any) -> Any:
    """A check-options dataclass field: its typed ``default`` and its ``OptionMeta`` (``key``, ``help``, ...)."""
    return dataclasses.field(
        default=default, metadata={"option": OptionMeta(key=key, help=help, validate=validate, **meta)}
    )


def plugin_option(
    default: str | None, *, key: str, what: str, builtins: Mapping[str, str], help: str, **meta: Any
) -> Any:
    """An option naming a plugin: a built-in name, ``package.module:factory`` or ``path/file.py:factory``."""
    return option(
        default,
        key=key,
        validate=_plugin(builtins, what),
        plugin=what,
        builtins=builtins,
        help=f"{help}: {', '.join(builtins)}, package.module:factory or path/file.py:factory",
        **meta,
    )


def validate_option(where: object, meta: OptionMeta, value: object) -> object:
    """``meta.validate(value)``, or ``UsageError`` naming ``where``, the option and the reason."""
    try:
        return meta.validate(value)
    except ValueError as exc:
        raise UsageError(f"{where}: option {meta.key}: {exc}") from None


@dataclasses.dataclass(frozen=True, kw_only=True)
class CheckOptions:
    """Base of a check's options: fields declared with ``option``; ``from_options`` reads a check's own keys."""

    @classmethod
    def declared(cls) -> tuple[tuple[dataclasses.Field, OptionMeta], ...]:
        """Each option field with its ``OptionMeta``, in declaration order."""
        return tuple((f, f.metadata["option"]) for f in dataclasses.fields(cls))

    @classmethod
    def from_options(cls, options: Mapping[str, object], *, where: object = None) -> Self:
        """The typed options from an options mapping (a scenario's merged with the run's). Keys of other checks
        are ignored, a key set to None counts as unset (its default applies), every value is validated again."""
        where = where or cls.__name__
        values = {}
        for field, meta in cls.declared():
            raw = options.get(meta.key)
            if raw is None:
                continue
            value = validate_option(where, meta, raw)
            values[field.name] = meta.convert(value) if meta.convert else value
        return cls(**values)

    def decisions(self) -> dict[str, dict]:
        """Options whose value a rule decided (a default that depends on other options): ``{key: {"on": bool,
        "why": str}}``; the result record carries it (``CheckRecord.decisions``). None by default."""
        return {}

    @classmethod
    def default_text(cls, field: dataclasses.Field, meta: OptionMeta) -> str:
        """The field's default as the help and the docs show it."""
        if meta.default_text is not None:
            return meta.default_text
        default = field.default
        if default is None:
            return "none"
        if isinstance(default, bool):
            return str(default).lower()
        if isinstance(default, tuple):
            return f"all: {', '.join(map(str, default))}"
        return str(default)


@dataclasses.dataclass(frozen=True, kw_only=True)
class NoOptions(CheckOptions):
    """The options of a check that reads none."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class ExportOptions(CheckOptions):
    """The ``export`` check's options (docs/export.md)."""

    subject: str = plugin_option(
        "sharded",
        key="subject",
        what="subject",
        builtins=SUBJECTS,
        flag="--subject",
        metavar="S",
        help="export subject",
    )
    lockstep_timeout: float | None = option(
        None,
        key="lockstep_timeout",
        validate=_positive_seconds,
        default_text="the export's collective timeout: --timeout under moeverify run",
        help="seconds a rank waits for the others at each exported row",
    )
    refresh: bool | None = option(
        None,
        key="refresh",
        validate=_bool_or_auto,
        convert=_auto_as_none,
        flag="--refresh",
        switch=True,
        default_text="auto: on for a user's subject or with a receiver, off for the built-in subjects alone",
        help="export again after an optimizer-like update of every weight (subchecks refresh and refresh_delta, and "
        "receiver_reload and receiver_wake with a receiver): true, false or auto",
    )
    receiver: str | None = plugin_option(
        None,
        key="receiver",
        what="receiver",
        builtins=RECEIVERS,
        flag="--receiver",
        metavar="R",
        help="load the export into a receiver on every rank and compare what it holds (subchecks receiver, "
        "receiver_repeat, receiver_copies, receiver_ranks, and receiver_reload and receiver_wake with refresh)",
    )

    @property
    def refresh_on(self) -> bool:
        """Whether the check exports twice: ``refresh`` where set, else on for a user's subject (any that is not
        a built-in) or with any receiver, off for a built-in subject alone (``refresh_why`` says which)."""
        return self._refresh()[0]

    @property
    def refresh_why(self) -> str:
        return self._refresh()[1]

    def _refresh(self) -> tuple[bool, str]:
        if self.refresh is True:
            return True, "asked (--refresh or refresh: true)"
        if self.refresh is False:
            return False, "turned off (--no-refresh or refresh: false)"
        off = "; --no-refresh or refresh: false turns it off"
        if self.subject not in SUBJECTS:
            return True, f"default for a user's subject ({self.subject}){off}"
        if self.receiver is not None:
            return True, f"default with a receiver ({self.receiver}){off}"
        return False, (
            f"default for the built-in subject {self.subject} without a receiver; --refresh or "
            "refresh: true turns it on"
        )

    def decisions(self) -> dict[str, dict]:
        on, why = self._refresh()
        return {"refresh": {"on": on, "why": why}}


@dataclasses.dataclass(frozen=True, kw_only=True)
class ReplayOptions(CheckOptions):
    """The ``replay`` check's options (docs/replay_matrix.md)."""

    impl: str = plugin_option(
        "moeverify",
        key="replay_impl",
        what="replay implementation",
        builtins=REPLAY_IMPLS,
        flag="--replay-impl",
        metavar="IMPL",
        help="replay implementation under test",
    )
    variants: tuple[rv.RouterVariant, ...] = option(
        rv.select(None),
        key="router_variants",
        validate=_router_variants,
        convert=rv.select,
        default_text=", ".join(rv.DEFAULT_VARIANTS),
        help="router configurations to replay: a name, a list of names, or 'full'",
    )
    subchecks: tuple[str, ...] = option(
        REPLAY_SUBCHECKS,
        key="replay_subchecks",
        validate=_replay_subchecks,
        help="replay subchecks to run: a list, or 'in_layout' (those that build only "
        "each rank's shard: " + ", ".join(REPLAY_IN_LAYOUT) + ")",
    )
    recompute: tuple[str, ...] = option(
        tuple(RECOMPUTE_MODES),
        key="replay_recompute",
        validate=_names(tuple(RECOMPUTE_MODES), "recompute modes"),
        help="recompute modes the recompute subcheck drives",
    )
    dtype: str = option(
        "fp32",
        key="replay_dtype",
        validate=_one_of(("fp32", "bf16")),
        help="the dtype the check builds the model in: fp32, or bf16 (half the memory, for a model "
        "that needs it; every comparison stays bitwise, cross_layout's loss tolerance is fp32's)",
    )
    experts: str = option(
        "auto",
        key="replay_experts",
        validate=_one_of(("auto", "grouped")),
        help="how the check builds routed experts: auto (as every check builds them), or grouped "
        "(Megatron-Core's TEGroupedMLP wherever the bridge maps grouped experts, as a GPU job with "
        "Transformer Engine builds them: one grouped GEMM each way on an H100/H200 in bf16, "
        "where SequentialMLP runs an MLP per expert; for deep models on one GPU)",
    )
    seq_len: int = option(
        16, key="replay_seq_len", validate=_at_most(131_072, "tokens (128k)"), help="tokens per sequence"
    )
    batch: int = option(2, key="replay_batch", validate=_at_most(4096, "sequences"), help="sequences per micro-batch")
    microbatches: int | None = option(
        None,
        key="replay_microbatches",
        validate=_positive_int,
        default_text="3, or 2 x pp under interleaving",
        help="micro-batches per step",
    )
    notes_path: str | None = option(
        None,
        key="replay_notes_path",
        validate=_path,
        help="rank 0 writes per-variant notes (drift agreement, findings, builds loaded and copied, "
        "seconds per step) to this JSON file",
    )

    def num_microbatches(self, layout: Layout) -> int:
        """``microbatches``, else 3, or 2 * pp under interleaving (the schedule needs M % pp == 0)."""
        if self.microbatches:
            return int(self.microbatches)
        return 2 * layout.pp if layout.vpp_chunks > 1 else 3


def _replay_rule(opts: ReplayOptions, layout: Layout, world_size: int) -> str | None:
    if opts.seq_len % (2 * layout.cp):
        return (
            f"the replay check's sequence of {opts.seq_len} tokens is not divisible by 2 * cp = {2 * layout.cp} "
            "(context parallelism splits each sequence in 2 * cp chunks); set options: {replay_seq_len: N} with "
            "N a multiple of it"
        )
    return None


def _hf_parity_rule(opts: NoOptions, layout: Layout, world_size: int) -> str | None:
    if world_size != 1 or layout != Layout():
        where = f"world_size {world_size}" + ("" if layout == Layout() else f", layout {layout.name(world_size)}")
        return (
            f"hf_parity runs on one rank with the default layout (transformers' model is the reference), not at "
            f"{where}: put hf_parity in a world_size 1 scenario without a layout"
        )
    return None


# ------------------------------------------------------------------------------------ checks
@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class CheckSpec:
    """One check. ``entry`` (``"module:function"``) is called as ``run(ctx: CheckContext) -> dict[str, Tally]``
    on every rank of the group; the tallies of rank 0 become the scenario's record, so a check gathers what it
    needs to rank 0 itself. ``scenario_rule(options, layout, world_size)`` returns why a scenario cannot run the
    check (the file is refused with that reason), or None."""

    name: str
    entry: str
    subchecks: tuple[str, ...] = ()  # the tallies it always reports (expect_fail may name them); none: undeclared
    options: type[CheckOptions] = NoOptions
    scenario_rule: Callable[[Any, Layout, int], str | None] | None = None
    subchecks_field: str | None = None  # the options field that narrows which subchecks run (replay: subchecks)
    optional_subchecks: tuple[str, ...] = ()  # reported only when an option turns them on (export: refresh, ...)
    needs_moe: bool = False  # runs on MoE routers: a dense model is refused when the file is loaded

    @property
    def declared_subchecks(self) -> tuple[str, ...]:
        """Every subcheck name the check can report."""
        return self.subchecks + self.optional_subchecks

    def load(self) -> Callable:
        """The check function (imports its module: its heavy imports are paid only by scenarios that run it)."""
        module, _, attr = self.entry.partition(":")
        return getattr(importlib.import_module(module), attr)

    def selected_subchecks(self, options: Mapping[str, object]) -> tuple[tuple[str, ...], str | None]:
        """The declared subchecks a scenario with these (validated) ``options`` runs, in declared order, and the
        option key that narrowed them (None when all run)."""
        field = self.subchecks_field
        declared = {f.name: m for f, m in self.options.declared()}
        key = declared[field].key if field else None
        if field is None or key is None or options.get(key) is None:
            return self.declared_subchecks, None
        chosen = getattr(self.options.from_options(options), field)
        return tuple(s for s in self.subchecks if s in chosen), key

    def refusal(self, options: Mapping[str, object], layout: Layout, *, world_size: int) -> str | None:
        """Why a scenario with these (validated) ``options``, ``layout`` and ``world_size`` cannot run this check,
        or None."""
        if self.scenario_rule is None:
            return None
        return self.scenario_rule(self.options.from_options(options), layout, world_size)


CHECKS: dict[str, CheckSpec] = {
    c.name: c
    for c in (
        # HF -> Megatron -> HF through the bridge, bitwise equal to the source checkpoint
        CheckSpec(name="roundtrip", entry="moeverify.oracles.roundtrip:run", subchecks=("bitwise", "key_set")),
        # a subject's per-tensor export vs Megatron-Bridge's, bit for bit (docs/export.md)
        CheckSpec(
            name="export",
            entry="moeverify.oracles.export:run",
            options=ExportOptions,
            subchecks=(
                "lockstep",
                "slot_tables",
                "coverage",
                "conflicts",
                "replicas",
                "shape_dtype",
                "bitwise",
                "key_set",
                "reference_keys",
                "model_intact",
            ),
            optional_subchecks=(
                "refresh",
                "receiver",
                "receiver_reload",
                "refresh_delta",
                "receiver_ranks",
                "receiver_repeat",
                "receiver_wake",
                "receiver_copies",
            ),
        ),
        # routes recorded in one pass replayed in the next, bit for bit, per router variant (docs/replay_matrix.md)
        CheckSpec(
            name="replay",
            entry="moeverify.oracles.replay.oracle:run",
            options=ReplayOptions,
            subchecks=REPLAY_SUBCHECKS,
            subchecks_field="subchecks",
            scenario_rule=_replay_rule,
            needs_moe=True,
        ),
        # Megatron's forward vs transformers' on the same weights, layer by layer and the logits
        CheckSpec(
            name="hf_parity",
            entry="moeverify.oracles.hf_parity:run",
            subchecks=("layers", "logits"),
            scenario_rule=_hf_parity_rule,
        ),
    )
}


def check_names() -> tuple[str, ...]:
    return tuple(CHECKS)


def resolve(name: str) -> Callable:
    """The check function for ``name``; ``UsageError`` naming the known checks otherwise."""
    if name not in CHECKS:
        raise UsageError(f"unknown check {name!r}; known checks: {', '.join(CHECKS)}")
    return CHECKS[name].load()
