"""The vLLM engine as its own process: run in vLLM's own venv, never imported by moeverify.

``python vllm_child.py JOB.json OUT_DIR`` (the engine venv's python; tools/engine_venv.sh builds it). It imports
vLLM, numpy, safetensors and the standard library only, so it runs against a user's own vLLM as well. It loads the
model named by the job, runs the job's steps in order and writes ``OUT_DIR/result.json`` (atomically) with one entry
per step; each request's routed experts go to ``OUT_DIR/<step>-<request>-<sample>.npy`` (``np.save`` with
``allow_pickle=False``, read back by moeverify with its own pickle-free reader). On an error the result names the
step that raised and the process exits 1.

Steps (``"op"``): ``generate`` (requests of token ids, or ``"continue"``: an earlier sample's sequence and more
tokens, the next turn; greedy by default, several samples, a start offset for the routes), ``reload_weights`` (a
safetensors file of HF-named tensors pushed through the engine's own weight loader, as RL frameworks sync;
``repack``: the workaround of finding V2), ``read_weights`` (the parameters the engine holds, written to a
safetensors file; CPU builds pack linear layers into oneDNN handles whose weight reads as an empty tensor: listed as
``packed``), ``probe_linears`` (those packed layers, and each MoE layer's expert kernel with seeded experts and
weights, applied to seeded inputs: their outputs stand in for their weights), ``reset_prefix_cache``.

Route capture on CPU (vLLM 0.32): ``enable_return_routed_experts`` needs Model Runner V2 and prefix caching
(``vllm/config/vllm.py``, ``_verify_aux_output_compatibility``); V2 needs Triton (``vllm/config/vllm.py``, "Model
Runner V2 requires Triton"), and Triton's wheels have no CPU backend. ``vllm/triton_utils/importing.py`` accepts
Triton on a CPU build when ``"cpu" in triton.backends.backends`` (only its presence is read there); the kernels
Model Runner V2 launches then run in Triton's interpreter (``TRITON_INTERPRET=1``) on CPU tensors. That is all of
``_cpu_triton`` below, the one place this workaround is written. Not a supported vLLM path: a vLLM whose check
differs fails at start-up with its own "requires Triton" error, not silently.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
import traceback

ENGINE_ENV = {
    "VLLM_USE_V2_MODEL_RUNNER": "1",  # route capture (AuxOutput) needs Model Runner V2
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # the engine core in this process: collective_rpc takes our functions
    "TRITON_INTERPRET": "1",  # V2's Triton kernels interpreted on CPU tensors
    "HF_HUB_OFFLINE": "1",
    "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB
    "TOKENIZERS_PARALLELISM": "false",
}


def _cpu_triton() -> None:
    """Let vLLM 0.32's CPU build accept the stock Triton (see the module docstring); before vLLM is imported."""
    for key, value in ENGINE_ENV.items():
        os.environ.setdefault(key, value)
    from triton.backends import backends

    if "cpu" not in backends:
        backends["cpu"] = backends["nvidia"]  # a stand-in entry: vllm.triton_utils reads only that "cpu" is there


def _log(msg: str) -> None:
    print(f"vllm_child: {msg}", file=sys.stderr, flush=True)


def _write_json(path: str, obj) -> None:
    fd, tmp = tempfile.mkstemp(prefix=".result.", suffix=".tmp", dir=os.path.dirname(path))
    with os.fdopen(fd, "w") as f:
        json.dump(obj, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _metrics(llm) -> dict:
    out = {}
    try:
        for m in llm.get_metrics():
            if m.name in ("vllm:num_preemptions", "vllm:prefix_cache_hits", "vllm:prefix_cache_queries"):
                out[m.name] = getattr(m, "value", None)
    except Exception as exc:  # metrics are a report, never a result: say why they are missing
        out["error"] = f"{type(exc).__name__}: {exc}"
    return out


def _prompt(r: dict, done: list) -> list[int]:
    """A request's prompt: its token ids, or (``"continue"``) an earlier sample's prompt + completion + ``then``,
    the next turn of a conversation."""
    if "continue" not in r:
        return [int(t) for t in r["prompt"]]
    c = r["continue"]
    req = next(q for q in done[c["step"]]["requests"] if q["id"] == c["request"])
    sample = req["samples"][c.get("sample", 0)]
    return req["prompt_token_ids"] + sample["token_ids"] + [int(t) for t in c.get("then", [])]


def _generate(llm, step: dict, index: int, out_dir: str, done: list) -> dict:
    import numpy as np
    from vllm import SamplingParams

    prompts, params = [], []
    for r in step["requests"]:
        prompts.append({"prompt_token_ids": _prompt(r, done)})
        params.append(
            SamplingParams(
                n=int(r.get("n", 1)),
                max_tokens=int(r["max_tokens"]),
                min_tokens=int(r.get("min_tokens", 0)),
                temperature=float(r.get("temperature", 0.0)),
                seed=r.get("seed"),
                ignore_eos=bool(r.get("ignore_eos", True)),
                routed_experts_prompt_start=int(r.get("prompt_start", 0)),
            )
        )
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - t0
    requests = []
    for r, out in zip(step["requests"], outs, strict=True):
        samples = []
        for s in out.outputs:
            routes = s.routed_experts
            entry = {"index": s.index, "token_ids": [int(t) for t in s.token_ids], "finish_reason": s.finish_reason}
            if routes is None:
                entry["routes"] = None
            else:
                name = f"{index}-{r['id']}-{s.index}.npy"
                np.save(os.path.join(out_dir, name), np.asarray(routes), allow_pickle=False)
                entry.update(routes=name, routes_dtype=str(routes.dtype), routes_shape=list(routes.shape))
            samples.append(entry)
        requests.append(
            {
                "id": r["id"],
                "prompt_token_ids": [int(t) for t in out.prompt_token_ids],
                "num_cached_tokens": out.num_cached_tokens,
                "samples": samples,
            }
        )
    return {"requests": requests, "seconds": seconds}


def _reload(self, path: str, repack: bool) -> int:
    """Run in the worker: push a safetensors file of HF-named tensors through the model runner's own loader.

    ``repack``: first forget each unquantized MoE layer's kernel, so the reload takes the first load's path and
    the CPU experts backend lays the new weights out again. vLLM 0.32.0's ``UnquantizedFusedMoEMethod._setup_kernel``
    (``unquantized_fused_moe_method.py``) skips ``fused_experts.process_weights_after_loading`` when
    ``self.moe_kernel is not None`` (a weight update): on CPU that is ``cpu_prepack_moe_weight``, so a plain reload
    leaves the experts in the checkpoint's layout where ``cpu_fused_moe`` reads the packed one (docs/engines.md,
    finding V2)."""
    from safetensors.torch import load_file

    tensors = load_file(path)
    if repack:
        from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod

        for module in self.model_runner.get_model().modules():
            if isinstance(getattr(module, "quant_method", None), UnquantizedFusedMoEMethod):
                module.quant_method.moe_kernel = None
    self.model_runner.reload_weights(weights_iterator=iter(tensors.items()))
    return len(tensors)


def _read(self, path: str) -> dict:
    """Run in the worker: the parameters and buffers the engine holds, written to ``path``; packed ones listed."""
    from safetensors.torch import save_file

    model = self.model_runner.get_model()
    held, packed = {}, []
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if t.numel() == 0:
            packed.append(name)
        else:
            held[name] = t.detach().to("cpu").contiguous().clone()
    save_file(held, path)
    return {"held": sorted(held), "packed": sorted(packed)}


def _probe(self, path: str, seed: int, rows: int) -> dict:
    """Run in the worker: every linear layer whose weight the engine packed (read as an empty tensor) applied to
    a seeded input; inputs and outputs written to ``path`` as ``<module>.x`` and ``<module>.y``."""
    import torch
    from safetensors.torch import save_file

    model = self.model_runner.get_model()
    g = torch.Generator().manual_seed(seed)
    out, dtype = {}, next(p.dtype for p in model.parameters() if p.is_floating_point())
    with torch.no_grad():
        for name, module in model.named_modules():
            weight = getattr(module, "weight", None)
            if not (isinstance(weight, torch.Tensor) and weight.numel() == 0 and hasattr(module, "input_size")):
                continue
            x = torch.randn(int(rows), module.input_size, generator=g).to(dtype)
            y = module(x)
            out[f"{name}.x"] = x
            out[f"{name}.y"] = (y[0] if isinstance(y, tuple) else y).detach().contiguous().clone()
        experts = []
        for name, module in model.named_modules():
            kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
            if kernel is None or not hasattr(module, "w13_weight"):
                continue
            # the layer's own expert kernel on seeded tokens, experts and weights (the call its forward makes)
            num_experts, hidden = module.w13_weight.shape[0], module.w2_weight.shape[1]
            x = torch.randn(int(rows), hidden, generator=g).to(dtype)
            ids = torch.stack([torch.randperm(num_experts, generator=g)[:2] for _ in range(int(rows))]).to(torch.int32)
            w = torch.softmax(torch.randn(int(rows), 2, generator=g), -1).to(dtype)
            y = kernel.apply(
                hidden_states=x.clone(),
                w1=module.w13_weight,
                w2=module.w2_weight,
                topk_weights=w.clone(),
                topk_ids=ids.clone(),
                activation=module.activation,
                apply_router_weight_on_input=False,
                global_num_experts=num_experts,
                expert_map=None,
                shared_experts=None,
                shared_experts_input=None,
            )
            for key, value in (("x", x), ("ids", ids), ("w", w), ("y", y)):
                out[f"{name}.experts.{key}"] = value.detach().contiguous().clone()
            experts.append(name)
    save_file(out, path)
    return {"probed": sorted(k[:-2] for k in out if k.endswith(".x") and ".experts." not in k), "experts": experts}


def _held(self, path: str) -> dict:
    """Run in the worker: every weight as the engine's kernels read it, in the checkpoint's layout, to ``path``.

    - a tensor kept as it is (norms, embeddings, head): as held;
    - a linear layer packed into a oneDNN handle (its weight an empty tensor): applied to the identity, ``W =
      layer(I).T``, exact in fp32 (each output element is one weight times 1 plus zeros); a packed layer with a bias
      is not read (listed);
    - experts of vLLM 0.32's CPU backend (``CPUUnquantizedExperts``): ``cpu_fused_moe`` reads the layout
      ``cpu_prepack_moe_weight(plain, isa)`` makes, a permutation of each expert's elements; it is undone with the
      permutation the same op gives an index tensor, so experts held in any other layout read back scrambled.
    """
    import torch
    from safetensors.torch import save_file

    model = self.model_runner.get_model()
    out, unread, unpacked = {}, [], []
    packed_experts = {}
    for name, module in model.named_modules():
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if experts is not None and type(experts).__name__.startswith("CPU") and hasattr(experts, "isa"):
            packed_experts[name] = experts.isa
    with torch.no_grad():
        for name, t in list(model.named_parameters()) + list(model.named_buffers()):
            module_name, _, leaf = name.rpartition(".")
            if t.numel() == 0:
                module = model.get_submodule(module_name)
                if getattr(module, "bias", None) is not None or not hasattr(module, "input_size"):
                    unread.append(name)
                    continue
                eye = torch.eye(module.input_size, dtype=t.dtype)
                y = module(eye)
                out[name] = (y[0] if isinstance(y, tuple) else y).t().contiguous().clone()
            elif module_name in packed_experts and leaf in ("w13_weight", "w2_weight"):
                import vllm._custom_ops as ops

                rows, cols = t.shape[1], t.shape[2]
                if rows * cols > 2**24:  # the index tensor is float32: exact up to 2**24
                    unread.append(name)
                    continue
                index = torch.arange(rows * cols, dtype=torch.float32).reshape(1, rows, cols)
                source = ops.cpu_prepack_moe_weight(index, packed_experts[module_name]).reshape(-1).long()
                plain = torch.empty_like(t).reshape(t.shape[0], -1)
                plain[:, source] = t.reshape(t.shape[0], -1)
                out[name] = plain.reshape(t.shape).contiguous()
                unpacked.append(name)
            else:
                out[name] = t.detach().contiguous().clone()
    save_file(out, path)
    return {"held": sorted(out), "unread": sorted(unread), "unpacked": sorted(unpacked)}


def _step(llm, step: dict, index: int, out_dir: str, done: list) -> dict:
    op = step["op"]
    if op == "generate":
        return _generate(llm, step, index, out_dir, done)
    if op == "reload_weights":
        t0 = time.perf_counter()
        counts = llm.collective_rpc(_reload, args=(step["file"], bool(step.get("repack", False))))
        return {"tensors": counts[0], "seconds": time.perf_counter() - t0}
    if op == "read_weights":
        return llm.collective_rpc(_read, args=(step["file"],))[0]
    if op == "read_held":
        return llm.collective_rpc(_held, args=(step["file"],))[0]
    if op == "probe_linears":
        return llm.collective_rpc(_probe, args=(step["file"], int(step.get("seed", 0)), int(step.get("rows", 5))))[0]
    if op == "reset_prefix_cache":
        return {"reset": bool(llm.reset_prefix_cache())}
    raise ValueError(f"step {index}: unknown op {op!r} (generate, reload_weights, read_weights, reset_prefix_cache)")


def _llm(LLM, job: dict):
    return LLM(
        model=job["model"],
        skip_tokenizer_init=True,
        enable_return_routed_experts=True,
        enable_prefix_caching=True,
        seed=0,
        disable_log_stats=False,  # the preemption and prefix-cache counters are read after each step
        **job.get("llm", {}),
    )


def serve(job_path: str, out_dir: str) -> int:
    """A long-lived engine: one JSON step a line on stdin, one JSON result a line on the descriptor
    ``$MOEVERIFY_ENGINE_REPLY_FD`` (``{"error": ...}`` on a failing step, and the engine goes on); the engine's own
    log stays on stdout and stderr. Ends at the end of its input."""
    with open(job_path) as f:
        job = json.load(f)
    reply = os.fdopen(int(os.environ["MOEVERIFY_ENGINE_REPLY_FD"]), "w", buffering=1)
    try:
        _cpu_triton()
        import vllm
        from vllm import LLM

        t0 = time.perf_counter()
        llm = _llm(LLM, job)
        reply.write(
            json.dumps(
                {"engine": {"name": "vllm", "version": vllm.__version__, "start_seconds": time.perf_counter() - t0}}
            )
            + "\n"
        )
    except Exception as exc:
        reply.write(
            json.dumps(
                {
                    "error": {
                        "step": None,
                        "type": type(exc).__name__,
                        "message": str(exc),
                        "traceback": traceback.format_exc()[-6000:],
                    }
                }
            )
            + "\n"
        )
        return 1
    done: list = []
    for i, line in enumerate(sys.stdin):
        step = json.loads(line)
        try:
            out = _step(llm, step, i, out_dir, done)
            out.update(op=step["op"])
        except Exception as exc:
            out = {
                "op": step.get("op"),
                "error": {
                    "step": i,
                    "type": type(exc).__name__,
                    "message": str(exc),
                    "traceback": traceback.format_exc()[-6000:],
                },
            }
        done.append(out)
        reply.write(json.dumps(out) + "\n")
    return 0


def main(job_path: str, out_dir: str) -> int:
    with open(job_path) as f:
        job = json.load(f)
    result: dict = {"steps": [], "engine": None, "error": None}
    result_path = os.path.join(out_dir, "result.json")
    try:
        _cpu_triton()
        import vllm
        from vllm import LLM

        result["engine"] = {"name": "vllm", "version": vllm.__version__}
        t0 = time.perf_counter()
        llm = _llm(LLM, job)
        result["engine"]["start_seconds"] = time.perf_counter() - t0
        _log(f"vLLM {vllm.__version__} loaded {job['model']} in {result['engine']['start_seconds']:.1f} s")
        for i, step in enumerate(job["steps"]):
            out = _step(llm, step, i, out_dir, result["steps"])
            out.update(op=step["op"], metrics=_metrics(llm))
            result["steps"].append(out)
            _log(f"step {i} {step['op']} done")
    except Exception as exc:
        result["error"] = {
            "step": len(result["steps"]) if result["engine"] and "start_seconds" in result["engine"] else None,
            "type": type(exc).__name__,
            "message": str(exc),
            "traceback": traceback.format_exc()[-6000:],
        }
        _write_json(result_path, result)
        _log(f"failed: {type(exc).__name__}: {exc}")
        return 1
    _write_json(result_path, result)
    return 0


if __name__ == "__main__":
    # run as a script, this file's directory is first on sys.path: nothing of moeverify may shadow vLLM there
    if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
        sys.path.pop(0)
    if len(sys.argv) == 4 and sys.argv[1] == "--serve":
        sys.exit(serve(sys.argv[2], sys.argv[3]))
    if len(sys.argv) != 3:
        print("usage: python vllm_child.py JOB.json OUT_DIR | --serve JOB.json OUT_DIR", file=sys.stderr)
        sys.exit(2)
    sys.exit(main(sys.argv[1], sys.argv[2]))
