"""Megatron-LM's RL loop (``train_rl.py``) under moeverify's drop-in, with a tiny MoE and a tiny agent.

Usage (tools/megatron_lm_rl.sh sets the paths)::

    MOEVERIFY_ROUTER_REPLAY=r2 python megatron_lm_rl_job.py WORKDIR [--backend cpu|cuda] [--iters N]
        [--graphs-off-in-rollouts] [-- TRAIN_RL_ARGS]

What it does, in one process (rank) or under torchrun:
- puts Megatron-LM's ``train_rl.py`` and ``megatron/rl``, ``megatron/inference`` (``MOEVERIFY_MEGATRON_LM``: a
  snapshot outside the repo) and the RL loop's own packages (``MOEVERIFY_MEGATRON_LM_DEPS``, appended to the path so
  the stack's packages win) where Python finds them; ``megatron.core`` and ``megatron.training`` stay the stack's;
- writes a byte-level tokenizer with a chat template (the rollouts go through Megatron-Core's chat-completions
  server) and an environment config naming ``TinyAgent`` (``megatron_lm_rl_agent.py``), added to Megatron-LM's
  agent allowlist;
- on CPU ranks: moeverify's CPU runtime (gloo world, CUDA touch points redirected); where flash-attn is absent, the
  engine's torch paged attention (``moeverify.oracles.engine.megatron_engine``); ``megatron_lm_rl_shims`` for what
  Megatron-LM's training loop needs on top;
- runs ``python -m moeverify.patches.autopatch train_rl.py ARGS`` in-process (the drop-in reads
  ``MOEVERIFY_ROUTER_REPLAY`` from the environment).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent

# A tiny Qwen3-MoE-like GPT (2 layers, 4 experts, top-2, hidden 64), GRPO with 2 prompts x 2 samples a step.
MODEL_ARGS = (
    "--num-layers 2 --hidden-size 64 --ffn-hidden-size 128 --num-attention-heads 4 --group-query-attention "
    "--num-query-groups 2 --kv-channels 16 --num-experts 4 --moe-router-topk 2 --moe-ffn-hidden-size 32 "
    "--moe-token-dispatcher-type alltoall --moe-router-load-balancing-type none --moe-aux-loss-coeff 0 "
    "--normalization RMSNorm --qk-layernorm --swiglu --disable-bias-linear --position-embedding-type rope "
    "--untie-embeddings-and-output-weights --attention-dropout 0 --hidden-dropout 0 "
    "--seq-length 64 --max-position-embeddings 64 --make-vocab-size-divisible-by 128"
).split()
RL_ARGS = (
    "--perform-rl-step --grpo-group-size 2 --grpo-prompts-per-step 2 --grpo-iterations 1 --global-batch-size 4 "
    "--micro-batch-size 1 --grpo-kl-beta 0.0 --grpo-entropy-term-weight 0.0 --inference-max-seq-length 64 "
    "--inference-max-requests 8 --inference-dynamic-batching-buffer-size-gb 0.05 --rl-default-temperature 1.0 "
    "--lr 1e-4 --lr-warmup-samples 0 --clip-grad 1.0 --seed 1234 --log-interval 1 --eval-interval 1000000 "
    "--eval-iters 0 --save-interval 1000000 --cuda-graph-impl none "
    "--no-gradient-accumulation-fusion --no-masked-softmax-fusion --no-bias-swiglu-fusion --no-bias-dropout-fusion "
    "--no-rope-fusion --no-persist-layer-norm"
).split()

CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


def write_tokenizer(directory: Path) -> Path:
    """A byte-level BPE with no merges (256 byte tokens) plus ``<eos>`` and ``<pad>``, with a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers  # lazy: the job's process only
    from transformers import PreTrainedTokenizerFast  # lazy: the job's process only

    vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<pad>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(directory)
    return directory


def write_env_config(path: Path) -> Path:
    path.write_text(json.dumps([{"agent_type": "MoEVerifyTinyAgent", "agent_args": {}, "weight": 1.0}]))
    return path  # YAML is a superset of JSON


def _wandb_placeholder(directory: Path) -> None:
    """megatron/rl/rl_utils.py imports wandb at top level for one type annotation (``wandb_run.Run``); without
    ``--wandb-project`` nothing of wandb runs. Where wandb is not installed, a placeholder package stands in, as
    files on the path, so that the processes the inference coordinator spawns (which import train_rl.py again)
    find it too."""
    if importlib.util.find_spec("wandb") is not None:
        return
    (directory / "wandb").mkdir(parents=True, exist_ok=True)
    (directory / "wandb" / "__init__.py").write_text('"""Placeholder: wandb is not installed."""\n')
    (directory / "wandb" / "wandb_run.py").write_text("class Run:\n    pass\n")
    sys.path.append(str(directory))


def _paths() -> Path:
    source = os.environ.get("MOEVERIFY_MEGATRON_LM")
    if not source or not (Path(source) / "train_rl.py").is_file():
        raise SystemExit(f"MOEVERIFY_MEGATRON_LM={source!r}: expected a folder holding Megatron-LM's train_rl.py "
                         "(tools/megatron_lm_rl.sh prepares one)")  # fmt: skip
    sys.path.insert(0, source)
    deps = os.environ.get("MOEVERIFY_MEGATRON_LM_DEPS")
    if deps:
        sys.path.append(deps)  # after the stack: its own torch, pydantic, httpx win
    sys.path.insert(0, str(HERE))  # megatron_lm_rl_agent, megatron_lm_rl_shims
    return Path(source)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("workdir", type=Path)
    parser.add_argument("--backend", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--iters", type=int, default=2)
    parser.add_argument(
        "--graphs-off-in-rollouts", action="store_true",
        help="keep config.cuda_graph_impl 'none' in rollouts where nothing captures (megatron_lm_rl_shims)",
    )  # fmt: skip
    argv = sys.argv[1:]
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []  # train_rl.py's own arguments, passed on
    opts = parser.parse_args(argv[: len(argv) - len(extra) - (1 if "--" in argv else 0)])
    source = _paths()
    opts.workdir.mkdir(parents=True, exist_ok=True)
    _wandb_placeholder(opts.workdir / "placeholders")
    tokenizer = write_tokenizer(opts.workdir / "tokenizer")
    env_config = write_env_config(opts.workdir / "env_config.yaml")

    from moeverify import runtime

    runtime.init(opts.backend)  # the world megatron's initialize then finds (gloo on CPU ranks)
    from moeverify.oracles.engine import megatron_engine

    attention = megatron_engine._attention(opts.backend)
    print(f"megatron_lm_rl_job: backend {opts.backend}, engine attention: {attention}", file=sys.stderr)
    import megatron_lm_rl_shims

    for line in megatron_lm_rl_shims.install(opts.backend, graphs_off_in_rollouts=opts.graphs_off_in_rollouts):
        print(f"megatron_lm_rl_job: shim {line}", file=sys.stderr)

    from megatron.rl.agent import registry

    from moeverify.runtime.bridge_import import real_te_available

    # Without Transformer Engine, the local spec with a core attention that takes THD (megatron_lm_rl_spec).
    impl = ["--transformer-impl", "transformer_engine"] if real_te_available() else [
        "--transformer-impl", "local", "--spec", "megatron_lm_rl_spec", "layer_spec"]  # fmt: skip

    registry.AGENT_REGISTRY["MoEVerifyTinyAgent"] = "megatron_lm_rl_agent:TinyAgent"
    argv = [
        str(source / "train_rl.py"), *MODEL_ARGS, *RL_ARGS,
        "--train-iters", str(opts.iters), "--langrl-env-config", str(env_config),
        "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(tokenizer),
        "--distributed-backend", "gloo" if opts.backend == "cpu" else "nccl", *impl,
        # clip_grads.py:174 asserts every grad is a torch.cuda.FloatTensor: no clipping on CPU ranks
        *(["--clip-grad", "0"] if opts.backend == "cpu" else []), *extra,
    ]  # fmt: skip
    from moeverify.patches import autopatch

    return autopatch.main(argv)


def _end_children() -> None:
    """Megatron-LM's rollouts start an inference coordinator and chat-server processes (non-daemonic) that it stops
    only on a clean exit; after an exception the job would wait on them forever. End them, one by one."""
    import multiprocessing

    for child in multiprocessing.active_children():
        child.terminate()
        child.join(timeout=10)


if __name__ == "__main__":
    try:
        status = main()
    except SystemExit as exc:
        status = exc.code
    except BaseException:
        traceback.print_exc()
        status = 1
    finally:
        _end_children()
    sys.exit(status)
