"""Write the corpus of payloads a real engine returned, for the decoder tests of `make test` (no engine there).

Usage: MOEVERIFY_VLLM_PYTHON=$(bash tools/engine_venv.sh) .venv/bin/python tools/engine_corpus.py [DIR]
(default tests/data/engine_payloads/vllm-<version>). vLLM runs its own process on the tiny checkpoints moeverify
writes (fp32, head_dim 32); every routed-experts array is kept exactly as vLLM returned it (``np.save`` in the
engine's process), with ``cases.json``: per case the model (family, config changes, seed), the token ids, the start
offset, the engine's configuration, and what decoding must do ("routes": equal the trainer's native routing of the
tokens; "refused": the message decoding must raise). The tests rebuild the trainer from the same checkpoint and
compare (tests/unit/test_engine_corpus.py).
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import numpy as np

from moeverify.engines import vllm_process
from moeverify.files import atomic_write_json
from moeverify.models import families

ROOT = Path(__file__).resolve().parents[1]
EAGER = {"dtype": "float32", "max_model_len": 160, "enforce_eager": True, "block_size": 32}
MODELS = {"qwen3_moe": {"head_dim": 32, "dtype": "float32"}, "glm4_moe": {"head_dim": 32, "dtype": "float32"}}


def _requests(seed: int, lengths: list[int]) -> list[dict]:
    g = np.random.default_rng(seed)
    return [{"id": f"r{i}", "prompt": g.integers(3, 256, n).tolist(), "max_tokens": 12} for i, n in enumerate(lengths)]


def _job(family: str, llm: dict, requests: list[dict]) -> dict:
    ckpt = families.written_checkpoint(family, 0, **MODELS[family])
    return {"model": str(ckpt), "llm": llm, "steps": [{"op": "generate", "requests": requests}]}


def main(out: Path) -> None:
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    plain = _requests(21, [19, 33])
    plain.append(dict(plain[1], id="r1-from-7", prompt_start=7))
    runs = {
        "qwen3_moe-eager": ("qwen3_moe", EAGER, plain, "routes"),
        "glm4_moe-eager": ("glm4_moe", EAGER, _requests(22, [25]), "routes"),
        # finding V1: vLLM's default (torch.compile) on CPU returns the untouched capture buffer
        "qwen3_moe-compiled": (
            "qwen3_moe",
            {k: v for k, v in EAGER.items() if k != "enforce_eager"},
            _requests(23, [17]),
            "refused",
        ),
    }
    cases, version = [], None
    for label, (family, llm, requests, expect) in runs.items():
        run = vllm_process.run(_job(family, llm, requests), workdir=tmp / f".run-{label}")
        version = run.engine["version"]
        starts = {r["id"]: r.get("prompt_start", 0) for r in requests}
        for s in run.samples(0):
            name = f"{label}-{s.request}.npy"
            shutil.copy(run.out_dir / s.file, tmp / name)  # the bytes vLLM's process wrote
            cases.append(
                {
                    "file": name,
                    "family": family,
                    "changes": MODELS[family],
                    "seed": 0,
                    "llm": llm,
                    "request": s.request,
                    "tokens": s.tokens,
                    "start": starts[s.request],
                    "expect": expect,
                }
            )
        shutil.rmtree(tmp / f".run-{label}")
    atomic_write_json(tmp / "cases.json", {"engine": "vllm", "version": version, "cases": cases})
    final = out if out.name.endswith(str(version)) else out.with_name(f"vllm-{version}")
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    print(f"{len(cases)} payloads of vLLM {version} in {final}")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "tests" / "data" / "engine_payloads" / "vllm")
