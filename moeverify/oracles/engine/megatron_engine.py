"""Megatron-Core's own inference engine (the engine of Megatron-LM's RL loop) as its own process, recording routes.

``python -m moeverify.oracles.engine.megatron_engine JOB.json OUT_DIR`` (moeverify's own venv: the engine is the
megatron-core moeverify runs on). The job names a checkpoint (built through Megatron-Bridge with
``moe_enable_routing_replay=True``) and ``generate`` steps of token-id requests; ``DynamicInferenceEngine.generate``
runs them greedily, and each finished request's ``routing_indices`` (megatron-core 0.19.2:
``inference/inference_request.py``, built per KV block by ``contexts/kv_block_allocator.py``
``store_routing_per_block``) is saved as the engine returned it (``np.save``, no pickle). The result has the schema
of ``moeverify.engines.job`` (read with ``job.EngineRun``), plus ``engine.moe_layers``: the decoder layer of each
column (the ``RouterReplay`` instances' ``layer_number - 1``, in build order).

What megatron-core 0.19.2 returns: ``[prompt + generated - 1, MoE layers, topk]`` int16 (int32 past 32767 experts),
row i = position i (the last generated token is never fed), one column per MoE layer, logical ids, in top-k's
unsorted order (``moe_utils.py``: ``sorted=torch.is_grad_enabled()``). Not recorded: a fused router
(``moe_router_fusion``), async scheduling (refused), evicted requests (no routes), MTP models (the MTP router's
``RouterReplay`` holds nothing in an inference forward and ``get_routing_indices`` raises).

On CPU ranks the engine's paged attention, flash-attn's CUDA kernels (``transformer/attention.py``:
``flash_attn_varlen_func`` with a block table for prefill, ``flash_attn_with_kvcache`` for decode, both behind an
``is_fa_min_version("2.7.3")`` check), is replaced by the paged attention below (the same math on the engine's own
block tables and caches, in torch), and the Triton KV-append kernel is switched off for megatron-core's own torch
fallback (``dynamic_context.triton_append_key_value_cache``). Where flash-attn imports, nothing is replaced. The
result says which ran (``engine.attention``).
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import tempfile
import time
import traceback

import numpy as np
import torch

from moeverify import models, runtime
from moeverify.spec.layout import Layout
from moeverify.spec.models.ref import ModelRef


def _gather(cache: torch.Tensor, blocks: torch.Tensor, n: int) -> torch.Tensor:
    """The first ``n`` cached positions of one request: ``cache`` ``[blocks, block_size, heads, dim]``."""
    size = cache.shape[1]
    count = (n + size - 1) // size
    return cache[blocks[:count].long()].reshape(count * size, *cache.shape[2:])[:n]


def _causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, first: int) -> torch.Tensor:
    """``q`` ``[sq, heads, d]`` at positions ``first ..``, ``k``/``v`` ``[sk, kv_heads, d]`` from position 0."""
    if k.shape[1] != q.shape[1]:
        k, v = (x.repeat_interleave(q.shape[1] // x.shape[1], dim=1) for x in (k, v))
    scores = torch.einsum("qhd,khd->hqk", q.float(), k.float()) * scale
    ks, qs = torch.arange(k.shape[0], device=q.device), torch.arange(q.shape[0], device=q.device)
    later = ks[None, None, :] > (qs + first)[None, :, None]
    return torch.einsum("hqk,khd->qhd", scores.masked_fill(later, float("-inf")).softmax(-1), v.float()).to(q.dtype)


def _prefill(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale=None, causal=True,
             window_size=(-1, -1), block_table=None, return_attn_probs=False, **_):  # fmt: skip
    if not causal or tuple(window_size) != (-1, -1) or block_table is None or return_attn_probs:
        raise NotImplementedError("the CPU paged attention covers causal, full-window, paged prefill only")
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    out = torch.zeros_like(q)
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for r in range(min(block_table.shape[0], len(cq) - 1)):
        q0, q1, n = cq[r], cq[r + 1], ck[r + 1] - ck[r]
        if q1 > q0 and n > 0:
            out[q0:q1] = _causal(
                q[q0:q1], _gather(k, block_table[r], n), _gather(v, block_table[r], n), scale, n - (q1 - q0)
            )
    return out


def _decode(q, k_cache, v_cache, cache_seqlens, softmax_scale=None, causal=True, window_size=(-1, -1),
            block_table=None, **_):  # fmt: skip
    if block_table is None or tuple(window_size) != (-1, -1):
        raise NotImplementedError("the CPU paged attention covers full-window paged decode only")
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    out = torch.zeros_like(q)  # [B, S, heads, d]
    for r, n in enumerate(cache_seqlens.tolist()):
        if n > 0:
            k, v = _gather(k_cache, block_table[r], n), _gather(v_cache, block_table[r], n)
            out[r] = _causal(q[r], k, v, scale, n - q.shape[1])
    return out


def _attention(backend: str) -> str:
    if importlib.util.find_spec("flash_attn") is not None:
        return "flash-attn"
    import megatron.core.inference.contexts.dynamic_context as dc  # lazy: megatron
    import megatron.core.transformer.attention as attention  # lazy: megatron

    attention.flash_attn_varlen_func = _prefill
    attention.flash_attn_with_kvcache = _decode
    attention.is_fa_min_version = lambda *a, **k: True
    if backend == "cpu":  # Triton's KV append kernel needs CUDA tensors; megatron-core's torch fallback then runs
        dc.triton_append_key_value_cache = None
    return "torch paged attention (flash-attn absent)"


class _Ids:
    """Prompts are token ids; the engine detokenizes finished requests, so it is handed this."""

    eod = -1

    def detokenize(self, ids, skip_special_tokens=False):
        return " ".join(str(int(i)) for i in ids)


def _write(path: str, obj) -> None:
    fd, tmp = tempfile.mkstemp(prefix=".result.", suffix=".tmp", dir=os.path.dirname(path))
    with os.fdopen(fd, "w") as f:
        json.dump(obj, f, indent=1, sort_keys=True)
    os.replace(tmp, path)


def main(job_path: str, out_dir: str) -> int:
    from megatron.core.inference.config import InferenceConfig  # lazy: megatron
    from megatron.core.inference.contexts.dynamic_context import DynamicInferenceContext  # lazy: megatron
    from megatron.core.inference.engines.dynamic_engine import DynamicInferenceEngine  # lazy: megatron
    from megatron.core.inference.model_inference_wrappers.gpt.gpt_inference_wrapper import (  # lazy: megatron
        GPTInferenceWrapper,
    )
    from megatron.core.inference.sampling_params import SamplingParams  # lazy: megatron
    from megatron.core.inference.text_generation_controllers.text_generation_controller import (  # lazy: megatron
        TextGenerationController,
    )
    from megatron.core.transformer.moe.router_replay import RouterReplay  # lazy: megatron

    with open(job_path) as f:
        job = json.load(f)
    result: dict = {"engine": None, "steps": [], "error": None}
    path = os.path.join(out_dir, "result.json")
    try:
        import megatron.core  # lazy: megatron

        for name in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
            os.environ.pop(name, None)  # one rank of its own, not a member of the caller's group
        runtime.init(job.get("backend", "cpu"))
        attention = _attention(job.get("backend", "cpu"))
        with runtime.parallel(Layout(), seed=0):
            t0 = time.perf_counter()
            built = models.build(ModelRef.user(job["model"]), Layout(), overrides={"moe_enable_routing_replay": True})
            model = built.model_chunks[0]
            model.eval()
            replays = RouterReplay.global_router_replay_instances
            result["engine"] = {
                "name": "megatron-core",
                "version": megatron.core.__version__,
                "attention": attention,
                "moe_layers": [r.layer_number - 1 for r in replays],
            }
            inference = InferenceConfig(**{"block_size_tokens": 16, "buffer_size_gb": 0.05, "max_requests": 16,
                                           "max_tokens": 512, "max_sequence_length": 256, "num_cuda_graphs": None,
                                           **job.get("inference", {})})  # fmt: skip
            context = DynamicInferenceContext(model.config, inference)
            controller = TextGenerationController(
                inference_wrapped_model=GPTInferenceWrapper(model, context), tokenizer=_Ids()
            )
            engine = DynamicInferenceEngine(controller=controller, context=context)
            result["engine"]["start_seconds"] = time.perf_counter() - t0
            for i, step in enumerate(job["steps"]):
                if step["op"] != "generate":
                    raise ValueError(f"step {i}: unknown op {step['op']!r} (generate)")
                result["steps"].append(_generate(engine, SamplingParams, step, i, out_dir))
    except Exception as exc:
        result["error"] = {
            "step": len(result["steps"]) if result["engine"] else None,
            "type": type(exc).__name__,
            "message": str(exc),
            "traceback": traceback.format_exc()[-6000:],
        }
        _write(path, result)
        return 1
    _write(path, result)
    return 0


def _generate(engine, SamplingParams, step: dict, index: int, out_dir: str) -> dict:
    lengths = {r["max_tokens"] for r in step["requests"]}
    if len(lengths) != 1:
        raise ValueError(f"step {index}: one max_tokens for all requests of a step, got {sorted(lengths)}")
    t0 = time.perf_counter()
    params = SamplingParams(num_tokens_to_generate=lengths.pop(), top_k=1, termination_id=-1)
    records = engine.generate([[int(t) for t in r["prompt"]] for r in step["requests"]], params)
    seconds = time.perf_counter() - t0
    requests = []
    for r, record in zip(step["requests"], records, strict=True):
        req = record.merge()
        routes = req.routing_indices
        sample = {
            "index": 0,
            "token_ids": [int(t) for t in req.generated_tokens],
            "finish_reason": None,
            "routes": None,
        }
        if routes is not None:
            name = f"{index}-{r['id']}-0.npy"
            np.save(os.path.join(out_dir, name), np.asarray(routes), allow_pickle=False)
            sample.update(routes=name, routes_dtype=str(routes.dtype), routes_shape=list(routes.shape))
        prompt = [int(t) for t in req.prompt_tokens]
        if prompt != [int(t) for t in r["prompt"]]:
            raise ValueError(f"step {index} request {r['id']}: the engine's record holds another prompt")
        requests.append({"id": r["id"], "prompt_token_ids": prompt, "num_cached_tokens": None, "samples": [sample]})
    return {"op": "generate", "requests": requests, "seconds": seconds}


if __name__ == "__main__":
    if len(sys.argv) != 3:
        print("usage: python -m moeverify.oracles.engine.megatron_engine JOB.json OUT_DIR", file=sys.stderr)
        sys.exit(2)
    sys.exit(main(sys.argv[1], sys.argv[2]))
