"""Parallel layouts: the one place where layout rules live.

A ``Layout`` names every Megatron dimension (tp, pp, vpp, ep, etp, cp, sp). Data parallel and
expert-data parallel are derived from the world size. ``validate`` rejects every invalid
combination with the rule that broke, before any process group exists.
"""

from __future__ import annotations

import dataclasses
import hashlib
import re

from moeverify.errors import LayoutError

_DIM_ORDER = ("tp", "pp", "vpp", "ep", "etp", "cp")


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class ModelShape:
    """What layout rules need to know about a model."""

    num_layers: int
    num_heads: int
    num_query_groups: int
    num_experts: int = 0  # 0 for a dense model
    moe_layers: tuple[int, ...] = ()  # 0-based global layer numbers of MoE layers
    linear_heads: (
        tuple[int, int] | tuple[()]
    ) = ()  # (key heads, value heads) of linear-attention layers; () without them

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Layout:
    """A Megatron parallel layout. ``etp=None`` means expert TP equals ``tp``."""

    tp: int = 1
    pp: int = 1
    vpp: int | None = None
    ep: int = 1
    etp: int | None = None
    cp: int = 1
    sp: bool = False
    # Uneven pipeline: layers of the first / last stage (Megatron's num_layers_in_first/last_pipeline_stage);
    # the other stages share the rest evenly. None: an even split.
    pp_first: int | None = None
    pp_last: int | None = None
    # Megatron's pipeline_model_parallel_layout string ("Et|tt|tt|tL": per virtual stage, E embedding,
    # t a decoder layer, L loss, stages of every pipeline rank for chunk 0, then chunk 1, ...). None: the
    # split above. Parsed by Megatron-Core's own PipelineParallelLayerLayout.
    pp_layout: str | None = None

    def __post_init__(self) -> None:
        self._validate()

    def _validate(self) -> None:
        for name in ("tp", "pp", "ep", "cp"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise LayoutError(f"{name} must be a positive integer, got {value!r}")
        for name in ("vpp", "etp", "pp_first", "pp_last"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise LayoutError(f"{name} must be a positive integer or None, got {value!r}")
        if not isinstance(self.sp, bool):
            raise LayoutError(f"sp must be true or false, got {self.sp!r}")
        if self.vpp is not None and self.vpp > 1 and self.pp < 2:
            raise LayoutError(f"vpp {self.vpp} needs pp > 1 (got pp {self.pp}): interleaving needs a pipeline")
        if self.sp and self.tp < 2:
            raise LayoutError("sp (sequence parallel) needs tp > 1; drop sp or raise tp")
        uneven = [name for name in ("pp_first", "pp_last") if getattr(self, name) is not None]
        if uneven and self.pp < 2:
            raise LayoutError(f"{' and '.join(uneven)} need pp > 1 (got pp {self.pp}): they size pipeline stages")
        if self.pp_layout is not None:
            self._validate_pp_layout(uneven)

    def _validate_pp_layout(self, uneven: list[str]) -> None:
        if not isinstance(self.pp_layout, str) or not self.pp_layout.strip():
            raise LayoutError(
                f"pp_layout must be a non-empty string (Megatron's pipeline_model_parallel_layout), "
                f"got {self.pp_layout!r}"
            )
        if self.pp < 2:
            raise LayoutError(f"pp_layout needs pp > 1 (got pp {self.pp}): it places layers on pipeline stages")
        if uneven:
            raise LayoutError(f"pp_layout places every layer itself; drop {' and '.join(uneven)}")
        chunks = len(_pp_layout_counts(self.pp_layout, self.pp))
        if chunks != self.vpp_chunks:
            raise LayoutError(
                f"pp_layout {self.pp_layout!r} holds {chunks} model chunk(s) per pipeline stage "
                f"({chunks * self.pp} stages for pp {self.pp}), vpp says {self.vpp_chunks}; "
                f"set vpp: {chunks if chunks > 1 else 'null'}"
            )

    @property
    def expert_tp(self) -> int:
        return self.tp if self.etp is None else self.etp

    @property
    def vpp_chunks(self) -> int:
        return self.vpp or 1

    def model_parallel_size(self) -> int:
        return self.tp * self.pp * self.cp

    def dp(self, world_size: int) -> int:
        return world_size // self.model_parallel_size()

    def expert_dp(self, world_size: int) -> int:
        return world_size // (self.expert_tp * self.ep * self.pp)

    def validate(self, *, world_size: int, shape: ModelShape | None = None) -> None:
        """Raise ``LayoutError`` naming the broken rule if this layout cannot run."""
        if world_size < 1:
            raise LayoutError(f"world_size must be >= 1, got {world_size}")
        mp = self.model_parallel_size()
        if world_size % mp:
            raise LayoutError(
                f"world_size {world_size} is not divisible by tp*pp*cp = {self.tp}*{self.pp}*{self.cp} = {mp}"
            )
        emp = self.expert_tp * self.ep * self.pp
        if world_size % emp:
            raise LayoutError(
                f"world_size {world_size} is not divisible by etp*ep*pp = {self.expert_tp}*{self.ep}*{self.pp} = {emp}"
            )
        if self.ep * self.expert_tp > world_size // self.pp:
            raise LayoutError(
                f"ep*etp = {self.ep * self.expert_tp} exceeds ranks per pipeline stage {world_size // self.pp}"
            )
        if shape is None:
            return
        self._validate_against(shape)

    def _validate_against(self, shape: ModelShape) -> None:
        if shape.num_heads % self.tp:
            raise LayoutError(f"num_attention_heads {shape.num_heads} is not divisible by tp {self.tp}")
        if shape.num_query_groups % self.tp:
            raise LayoutError(f"num_query_groups {shape.num_query_groups} is not divisible by tp {self.tp}")
        for kind, heads in zip(("key", "value"), shape.linear_heads, strict=False):  # () without linear attention
            if heads % (self.tp * self.cp):
                raise LayoutError(
                    f"linear attention's {heads} {kind} heads are not divisible by tp*cp = "
                    f"{self.tp}*{self.cp} (megatron-core's gated delta net splits them over both)"
                )
        self.stage_layers(shape.num_layers)
        if shape.is_moe:
            if shape.num_experts % self.ep:
                raise LayoutError(f"num_experts {shape.num_experts} is not divisible by ep {self.ep}")
            if self.tp > 1 and not self.sp:
                raise LayoutError(f"MoE with tp {self.tp} > 1 needs sp (sequence parallel); add sp: true")
        else:
            if self.ep > 1:
                raise LayoutError(f"ep {self.ep} > 1 needs an MoE model; this model is dense")
            if self.etp is not None and self.etp != self.tp:
                raise LayoutError(f"etp {self.etp} set on a dense model; expert tensor parallel needs experts")

    def chunk_counts(self, num_layers: int) -> tuple[tuple[int, ...], ...]:
        """Decoder layers of each model chunk, ``[vp_stage][pp_rank]``; Megatron places them in that order
        (chunk 0 of every stage, then chunk 1, ...). ``LayoutError`` where ``num_layers`` does not split so."""
        if self.pp_layout is not None:
            counts = _pp_layout_counts(self.pp_layout, self.pp, num_layers=num_layers)
            return tuple(tuple(row) for row in counts)
        v = self.vpp_chunks
        return tuple(tuple(n // v for n in self.stage_layers(num_layers)) for _ in range(v))

    def stage_layers(self, num_layers: int) -> tuple[int, ...]:
        """Decoder layers of each pipeline stage, by Megatron-Core 0.19's rules (``TransformerConfig``'s uneven
        pipeline checks); ``LayoutError`` naming the rule where ``num_layers`` does not split so."""
        v = self.vpp_chunks
        if self.pp_layout is not None:
            counts = self.chunk_counts(num_layers)
            return tuple(sum(row[p] for row in counts) for p in range(self.pp))
        if self.pp_first is None and self.pp_last is None:
            stages = self.pp * v
            if num_layers % stages:
                raise LayoutError(
                    f"num_layers {num_layers} is not divisible by pp*vpp = {self.pp}*{v} = {stages}; "
                    "pp_first/pp_last set an uneven split"
                )
            return (num_layers // self.pp,) * self.pp
        ends = {name: getattr(self, name) for name in ("pp_first", "pp_last") if getattr(self, name) is not None}
        for name, layers in ends.items():
            if layers % v:
                raise LayoutError(
                    f"{name} {layers} is not divisible by vpp {v}: each model chunk of a stage holds "
                    "an equal share of its layers"
                )
        middle_layers, middle_stages = num_layers - sum(ends.values()), self.pp - len(ends)
        if middle_layers < 0 or bool(middle_layers) != bool(middle_stages):
            raise LayoutError(
                f"num_layers {num_layers} minus {' + '.join(f'{k} {n}' for k, n in ends.items())} "
                f"leaves {middle_layers} layer(s) for {middle_stages} middle stage(s) of pp {self.pp}"
            )
        if middle_stages and middle_layers % (middle_stages * v):
            raise LayoutError(
                f"the {middle_layers} layer(s) between {' and '.join(ends)} are not divisible by the "
                f"{middle_stages} middle stage(s) x vpp {v}"
            )
        middle = middle_layers // middle_stages if middle_stages else 0
        return tuple(
            self.pp_first
            if p == 0 and self.pp_first is not None
            else self.pp_last
            if p == self.pp - 1 and self.pp_last is not None
            else middle
            for p in range(self.pp)
        )

    def name(self, world_size: int) -> str:
        """Scenario layout name: non-default dims in the order tp, pp, vpp, ep, etp, cp, sp, then dpN."""
        parts = []
        for dim in _DIM_ORDER:
            value = getattr(self, dim)
            # etp 1 under tp > 1 is not the default (expert TP = tp): named, or two layouts would share a name
            if value is None or (value == 1 and not (dim == "etp" and self.tp > 1)):
                continue
            parts.append(f"{dim}{value}")
            if dim == "pp":
                parts += [
                    f"{n.replace('_', '')}{getattr(self, n)}"
                    for n in ("pp_first", "pp_last")
                    if getattr(self, n) is not None
                ]
                if self.pp_layout is not None:  # the string holds | ( ) *: named by a digest of it
                    parts.append(f"pplayout{_digest(self.pp_layout)}")
        if self.sp:
            parts.append("sp")
        dp = self.dp(world_size)
        if dp > 1:
            parts.append(f"dp{dp}")
        return "-".join(parts) or "tp1"

    @classmethod
    def from_mapping(cls, mapping: dict, *, where: str = "layout") -> Layout:
        """Build from a scenario file's mapping, rejecting unknown keys."""
        allowed = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(mapping) - allowed)
        if unknown:
            raise LayoutError(f"{where}: unknown layout key(s) {unknown}; allowed: {sorted(allowed)}")
        return cls(**mapping)

    def as_dict(self) -> dict:
        """The fields, without ``pp_first``/``pp_last``/``pp_layout`` when unset: a dump or result file of an even
        layout keeps the key set it had before uneven pipelines existed (and compares equal with one written then)."""
        out = dataclasses.asdict(self)
        for name in ("pp_first", "pp_last", "pp_layout"):
            if out[name] is None:
                del out[name]
        return out


def _digest(text: str) -> str:
    return hashlib.sha1(text.encode()).hexdigest()[:8]


def _pp_layout_counts(text: str, pp: int, *, num_layers: int | None = None) -> list[list[int]]:
    """Decoder layers per model chunk ``[vp_stage][pp_rank]`` of a pipeline_model_parallel_layout string, parsed
    by Megatron-Core's own ``PipelineParallelLayerLayout`` (0.19: ``transformer/pipeline_parallel_layer_layout``);
    with ``num_layers``, also its rules (one embedding first, one loss last, that many decoder layers)."""
    try:
        from megatron.core.transformer.pipeline_parallel_layer_layout import (
            PipelineParallelLayerLayout,  # lazy: megatron
        )
    except ImportError as exc:  # pragma: no cover (megatron-core 0.19 has it)
        raise LayoutError(f"pp_layout needs megatron-core's PipelineParallelLayerLayout: {exc}") from None
    try:
        parsed = PipelineParallelLayerLayout(text, pp)
        from megatron.core.transformer.enums import LayerType  # lazy: megatron

        if num_layers is not None:
            if LayerType.mtp in parsed.flatten_layout:
                raise LayoutError(
                    f"pp_layout {text!r}: MTP layers ('m') are not modelled by moeverify's layer "
                    f"placement; lay out the decoder layers only"
                )
            parsed.validate_layer_layout(num_layers, None)
    except LayoutError:
        raise
    # Megatron's parser asserts its rules, and raises NotImplementedError for encoder layers ('e'): all refusals.
    except (AssertionError, KeyError, ValueError, TypeError, NotImplementedError) as exc:
        raise LayoutError(
            f"pp_layout {text!r} for pp {pp}"
            f"{'' if num_layers is None else f' and {num_layers} decoder layers'}: "
            f"{str(exc).strip() or type(exc).__name__} (Megatron-Core's PipelineParallelLayerLayout)"
        ) from None
    v = parsed.virtual_pipeline_model_parallel_size
    return [[parsed.layout[p][c].count(LayerType.decoder) for p in range(pp)] for c in range(v)]


_NAME_PART = re.compile(r"^(tp|pp|vpp|ep|etp|cp|dp|ppfirst|pplast)(\d+)$|^sp$")
_NAME_FIELDS = {"ppfirst": "pp_first", "pplast": "pp_last"}


def parse_layout_name(name: str) -> tuple[Layout, int]:
    """Inverse of ``Layout.name``: return ``(layout, dp)`` from e.g. ``"tp2-pp2-sp-dp2"``."""
    values: dict = {}
    dp = 1
    for part in name.split("-"):
        if part.startswith("pplayout"):
            raise LayoutError(
                f"layout name {name!r}: a pp_layout cannot be read back from its name (a digest of "
                f"the string); give the layout itself (pp_layout in a scenario file)"
            )
        m = _NAME_PART.match(part)
        if not m:
            raise LayoutError(f"layout name {name!r}: cannot parse part {part!r}")
        if part == "sp":
            values["sp"] = True
        elif m.group(1) == "dp":
            dp = int(m.group(2))
        else:
            values[_NAME_FIELDS.get(m.group(1), m.group(1))] = int(m.group(2))
    return Layout(**values), dp
