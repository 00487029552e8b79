"""Run verl's own Megatron engine (the actor's compute_log_prob and update_actor paths of verl 0.9.1:
``MegatronEngineWithLMHead.infer_batch`` / ``train_batch``) unmodified on a CPU rank, on the tiny Qwen3-MoE under
in-job R3, turned on as a verl user turns it on: verl's own ``HFModelConfig(external_lib=
"moeverify.integrations.verl")`` imports the integration before the model is built, and the routes reach in-job R3
from verl's batch through the integration's hooks alone (nothing here calls ``injob``). Run as a script by
``test_verl_actor_r3.py`` (its own process: verl's imports patch megatron and set a process-wide platform); prints one
JSON line.

verl is loaded from ``MOEVERIFY_VERL_SITE`` (the wheel unpacked or ``pip install --no-deps --target``) with its pure
dependencies from ``MOEVERIFY_VERL_DEPS`` (tensordict, ray, ...). Shims, none of them in verl's code:
- ``verl``, ``verl.workers``, ``verl.workers.engine``, ``verl.utils.dataset`` registered as empty packages (their
  ``__init__`` would import the FSDP engine, peft, datasets, ...); ``BaseEngine``/``EngineRegistry`` set on the
  engine package, as its ``__init__`` does;
- a CPU platform registered through verl's plugin registry (``verl.plugin.platform``: ``PlatformRegistry.register``,
  ``set_platform``), so ``get_device_id()`` is ``"cpu"``;
- the engine object made without ``initialize()`` (which builds its model from an HF checkout through the bridge
  with DDP and Megatron's distributed optimizer): our model chunk as ``module``, a plain SGD behind the
  ``zero_grad``/``step() -> (ok, grad_norm, zeros)`` interface, ``zero_grad_buffer`` a no-op on the chunk (no DDP);
  the process group and Megatron's parallel state made by ``moeverify.runtime`` (verl's worker makes them);
- the real ``HFModelConfig`` of the tiny checkpoint, loaded without a tokenizer (the checkpoint has none): its
  ``tokenizer`` a stand-in holding ``pad_token_id``.

The batch: single-turn samples and multi-turn ones (a tool's output between generations, one trajectory ending in a
tool's output), laid out as verl's agent loop lays them out (``routed_experts`` aligned with ``input_ids``, zeros past
the last generation's routed rows; ``response_mask`` 0 on tool tokens; ``max_global_steps`` per sample), made into the
engine's input by verl's own ``left_right_2_no_padding``.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import types

SITE = os.environ.get("MOEVERIFY_VERL_SITE", "")
DEPS = os.environ.get("MOEVERIFY_VERL_DEPS", "")
EMPTY = ("verl", "verl.workers", "verl.workers.engine", "verl.utils.dataset")
LAYERS = 4


def load_verl():
    for path in (DEPS, SITE):
        if path and path not in sys.path:
            sys.path.insert(0, path)
    for name in EMPTY:
        if name not in sys.modules:
            module = types.ModuleType(name)
            module.__path__ = [os.path.join(SITE, *name.split("."))]
            sys.modules[name] = module
    import verl.workers.engine as engine_pkg
    import verl.workers.engine.base as base

    engine_pkg.BaseEngine, engine_pkg.EngineRegistry = base.BaseEngine, base.EngineRegistry
    _cpu_platform()
    from verl.workers.engine.megatron.transformer_impl import MegatronEngineWithLMHead

    return MegatronEngineWithLMHead


def _cpu_platform():
    import torch
    from verl.plugin.platform import platform_manager as pm
    from verl.plugin.platform.platform_base import PlatformBase

    zero = lambda *a, **k: 0  # noqa: E731
    device = types.SimpleNamespace(
        max_memory_allocated=zero,
        max_memory_reserved=zero,
        memory_allocated=zero,
        memory_reserved=zero,
        empty_cache=lambda: None,
        synchronize=lambda *a: None,
        current_device=lambda: "cpu",
        is_available=lambda: True,
        device_count=lambda: 1,
        manual_seed=torch.manual_seed,
        manual_seed_all=torch.manual_seed,
    )

    class PlatformCPU(PlatformBase):
        device_name = property(lambda self: "cpu")
        vendor_name = property(lambda self: "cpu")
        device_module = property(lambda self: device)

        def is_available(self):
            return True

        def current_device(self):
            return "cpu"

        def device_count(self):
            return 1

        def set_device(self, index):
            pass

        def synchronize(self, index=None):
            pass

        def manual_seed(self, seed):
            torch.manual_seed(seed)

        def manual_seed_all(self, seed):
            torch.manual_seed(seed)

        def set_allocator_settings(self, settings):
            pass

        def empty_cache(self):
            pass

        def get_device_capability(self, index=0):
            return None, None

        def communication_backend_name(self):
            return "gloo"

        def visible_devices_envvar(self):
            return "CUDA_VISIBLE_DEVICES"

        def nvtx_range(self, msg):
            return contextlib.nullcontext()

        def profiler_start(self):
            pass

        def profiler_stop(self):
            pass

        def ray_resource_name(self):
            return "CPU"

        def ray_noset_envvars(self):
            return []

        def is_ipc_supported(self):
            return False

        def cudart(self):
            return None

    pm.PlatformRegistry.register(platform="cpu")(PlatformCPU)
    pm.set_platform(PlatformCPU())


class SGDBehindMegatronOptimizer:
    """What verl's engine calls on Megatron's optimizer: ``zero_grad()`` and ``step() -> (ok, grad_norm, zeros)``."""

    def __init__(self, params, lr=1e-2):
        import torch

        self.params = list(params)
        self.inner = torch.optim.SGD(self.params, lr=lr)

    def zero_grad(self):
        self.inner.zero_grad(set_to_none=True)

    def step(self):
        import torch

        norm = torch.nn.utils.clip_grad_norm_([p for p in self.params if p.grad is not None], float("inf"))
        self.inner.step()
        return True, float(norm), None


def make_engine(cls, chunk, model_config, *, micro_batch_size):
    from verl.workers.config import McoreEngineConfig

    engine = cls.__new__(cls)
    engine.engine_config = McoreEngineConfig(
        use_remove_padding=False, pad_bshd_to_minibatch_max=False, micro_batch_size_per_gpu=micro_batch_size
    )
    engine.module = [chunk]
    engine.tf_config = chunk.config
    engine.enable_routing_replay = False  # verl's own replay off (router_replay.mode=disabled): moeverify replays
    engine._is_offload_param = engine._is_offload_optimizer = False
    engine.mode = None
    engine.model_config = model_config
    engine.optimizer = SGDBehindMegatronOptimizer(chunk.parameters())
    chunk.zero_grad_buffer = lambda: None  # no DDP grad buffer on this chunk
    return engine


def user_model_config():
    """The user's one step: verl's own model config naming the integration (``actor_rollout_ref.model.external_lib``);
    its ``__post_init__`` imports it, as in every verl worker before the model is built."""
    from verl.workers.config import HFModelConfig

    from moeverify.models import families

    config = HFModelConfig(
        path=str(families.hf_checkpoint("qwen3_moe")),
        external_lib="moeverify.integrations.verl",
        load_tokenizer=False,
        override_config={"attn_implementation": "eager"},
    )
    object.__setattr__(config, "tokenizer", types.SimpleNamespace(pad_token_id=0))  # no tokenizer files
    return config


# Samples: (prompt length, response turns as (length, generated by the policy)). Trajectories 4 and 5 are multi-turn;
# 4 ends in a tool's output (verl leaves its rows zero: the engine never routed them).
SAMPLES = (
    (3, ((4, True),)),
    (2, ((2, True),)),
    (4, ((5, True),)),
    (3, ((3, True),)),
    (3, ((2, True), (2, False), (2, True), (3, False))),
    (2, ((2, True), (2, False), (3, True))),
)
VERSIONS = (3, 4, 3, 4, 3, 4)  # max_global_steps: two policy versions, mixed in every micro-batch of two
PROMPT_WIDTH, RESPONSE_WIDTH = 5, 9


def make_samples(vocab):
    """Per sample: tokens, the response mask, and where the engine's routed rows end (the last generated token)."""
    import torch
    from test_injob_replay import random_sequences

    out = []
    for i, (prompt, turns) in enumerate(SAMPLES):
        lengths = [prompt] + [n for n, _ in turns]
        parts = random_sequences(vocab, lengths, 71 + i)
        mask = torch.cat([torch.full((n,), int(gen)) for n, gen in turns])
        last = prompt + int(mask.nonzero().max())
        out.append((torch.cat(parts), mask, last))
    return out


def verl_batch(samples, routes):
    """verl's agent-loop layout: prompts left-padded, responses right-padded, ``routed_experts`` aligned with
    ``input_ids`` (the engine's rows of the last generation's request, zeros from the last generated token on),
    ``response_mask`` over the response columns (0 on a tool's output)."""
    import torch

    b, width = len(samples), PROMPT_WIDTH + RESPONSE_WIDTH
    ids = torch.zeros(b, width, dtype=torch.long)
    mask = torch.zeros(b, width, dtype=torch.long)
    routed = torch.zeros(b, width, LAYERS, routes[0].shape[-1], dtype=torch.int64)
    response_mask = torch.zeros(b, RESPONSE_WIDTH, dtype=torch.long)
    for i, ((tokens, gen_mask, last), r) in enumerate(zip(samples, routes, strict=True)):
        prompt = len(tokens) - len(gen_mask)
        first = PROMPT_WIDTH - prompt
        ids[i, first : first + len(tokens)] = tokens
        mask[i, first : first + len(tokens)] = 1
        response_mask[i, : len(gen_mask)] = gen_mask
        routed[i, first : first + last] = r[:last]
    return ids, mask, routed, response_mask


def engine_batch(ids, mask, routed, response_mask, *, micro_batch_size):
    """The engine's input, made by verl's own ``left_right_2_no_padding`` as its trainer does, the per-sample
    ``max_global_steps`` carried as ``DataProto.to_tensordict`` carries the agent loop's non-tensor fields."""
    import torch
    from tensordict import TensorDict
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import left_right_2_no_padding

    b = ids.shape[0]
    td = TensorDict(
        {
            "input_ids": ids.clone(),
            "attention_mask": mask.clone(),
            "response_mask": response_mask.clone(),
            "position_ids": (torch.cumsum(mask, 1) - 1).clamp(min=0),
            "routed_experts": routed.clone(),
            "prompts": ids[:, :PROMPT_WIDTH].clone(),
            "responses": ids[:, PROMPT_WIDTH:].clone(),
            "temperature": torch.ones(b),
        },
        batch_size=[b],
    )
    tu.assign_non_tensor_stack(td, "max_global_steps", list(VERSIONS))
    td = left_right_2_no_padding(td)
    tu.assign_non_tensor(
        td,
        use_remove_padding=False,
        use_dynamic_bsz=False,
        micro_batch_size_per_gpu=micro_batch_size,
        max_token_len_per_gpu=4096,
        use_fused_kernels=False,
        calculate_entropy=False,
        global_batch_size=b,
    )
    return td


def policy_loss(model_output, data, dp_group=None):
    """A policy-gradient loss over response tokens in verl's loss-function interface."""
    from verl.workers.utils.padding import no_padding_2_padding

    log_probs = no_padding_2_padding(model_output["log_probs"], data)
    loss = -(log_probs * data["response_mask"].to(log_probs.dtype)).sum() / data["batch_num_tokens"]
    return loss, {"pg_loss": loss.detach().item()}


class Routed:
    """Per forward routing call of the bound model (recomputes apart): ``(layer, ids used [T, K], the top-k of the
    router's own logits [T, K])``, rows sorted, in router order."""

    def __init__(self, chunk):
        self.calls: list = []
        self.handles = [
            m.register_forward_hook(self._hook) for m in chunk.modules() if type(m).__name__ == "TopKRouter"
        ]

    def _hook(self, router, inputs, outputs):
        import torch

        if torch._C._current_graph_task_id() == -1:
            with torch.no_grad():
                logits_TE = router.gating(inputs[0].reshape(-1, inputs[0].shape[-1]))
            native_TK = torch.topk(logits_TE.float(), router.topk).indices.sort().values
            used_TK = torch.topk(outputs[1].int(), router.topk).indices.sort().values
            self.calls.append((router.layer_number - 1, used_TK, native_TK))

    def take(self) -> list:
        calls, self.calls = self.calls, []
        return calls

    def close(self):
        for h in self.handles:
            h.remove()


def checked(calls, samples, routes, *, micro_batch_size) -> tuple[int, int]:
    """``(routed, native)``: tokens on the engine's route (before each sample's last generated token), tokens on the
    actor's own top-k (from it on: the engine's missing row, a tool's output). Micro-batches in batch order, each a
    BSHD ``[b, s]`` right-padded by verl's ``preprocess_bshd_engine``: token ``s`` of row ``b`` is ``s * rows + b``."""
    import torch

    per = [calls[j : j + LAYERS] for j in range(0, len(calls), LAYERS)]
    assert len(per) == len(samples) // micro_batch_size, [c[0] for c in calls]
    routed = native = 0
    for m, mb in enumerate(per):
        assert sorted(c[0] for c in mb) == list(range(LAYERS))
        rows = list(range(m * micro_batch_size, (m + 1) * micro_batch_size))
        for layer, used_TK, native_TK in mb:
            assert used_TK.shape[0] % len(rows) == 0
            for b, i in enumerate(rows):
                tokens, _, last = samples[i]
                for s in range(len(tokens)):
                    t = s * len(rows) + b
                    if s < last:
                        assert torch.equal(used_TK[t], routes[i][s, layer]), ("engine", i, layer, s)
                        routed += 1
                    else:
                        assert torch.equal(used_TK[t], native_TK[t]), ("native", i, layer, s)
                        native += 1
    return routed, native


def refusals(engine, batch, *, micro_batch_size) -> list[str]:
    """What the integration refuses on verl's engine: a batch without ``routed_experts`` (the rollout did not return
    them), verl's own router replay on beside it."""
    from moeverify.errors import UsageError

    out = []
    bare = engine_batch(*batch, micro_batch_size=micro_batch_size)
    del bare["routed_experts"]
    own = engine_batch(*batch, micro_batch_size=micro_batch_size)
    for data, setting in ((bare, False), (own, True)):
        engine.enable_routing_replay = setting
        try:
            with engine.eval_mode():
                engine.infer_batch(data)
        except UsageError as e:
            out.append(str(e))
    engine.enable_routing_replay = False
    return out


def main() -> dict:
    micro_batch_size = int(os.environ.get("MOEVERIFY_VERL_MBS", "1"))
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    engine_cls = load_verl()
    import torch
    from test_injob_r3 import engine_routes
    from test_injob_replay import backend_of_tests

    from moeverify import models, runtime
    from moeverify.errors import RouteError
    from moeverify.patches import agreement, autopatch
    from moeverify.spec.layout import Layout

    # the engine model has other weights: its ids are no better than chance, its experts are other experts
    os.environ[agreement.FLOOR_ENV] = os.environ[agreement.NUMBERING_ENV] = agreement.OFF
    # no MOEVERIFY_ROUTER_REPLAY_MODEL: the integration binds the policy engine's model (the actor), and the rollout
    # engine's stand-in, a second MoE model in this process as verl's reference model would be, routes natively
    os.environ.pop(autopatch.MODEL_ENV, None)
    runtime.init(backend_of_tests())
    result: dict = {"micro_batch_size": micro_batch_size}
    with runtime.parallel(Layout(), seed=0):
        model_config = user_model_config()
        result["installed"] = autopatch.session() is not None and autopatch.session().batch is not None
        actor = models.build("qwen3_moe", Layout(), seed=0).model_chunks[0]
        rollout_model = models.build("qwen3_moe", Layout(), seed=1).model_chunks[0]
        for chunk in (actor, rollout_model):
            chunk.train()
        samples = make_samples(actor.config.vocab_size)
        routes = engine_routes(rollout_model, [tokens for tokens, _, _ in samples])  # [S, L, K], as the engine routed
        engine = make_engine(engine_cls, actor, model_config, micro_batch_size=micro_batch_size)
        spy = Routed(actor)
        try:
            batch = verl_batch(samples, routes)
            with engine.eval_mode():  # ActorRolloutRefWorker.compute_log_prob -> TrainingWorker.infer_batch
                out = engine.infer_batch(engine_batch(*batch, micro_batch_size=micro_batch_size))
            result["log_probs_tokens"] = int(out["model_output"]["log_probs"].values().numel())
            result["log_prob"] = checked(spy.take(), samples, routes, micro_batch_size=micro_batch_size)
            before = [p.detach().clone() for p in actor.parameters()]
            with engine.train_mode():  # update_actor -> TrainingWorker.train_batch -> engine.train_batch
                out = engine.train_batch(
                    engine_batch(*batch, micro_batch_size=micro_batch_size), loss_function=policy_loss
                )
            result["grad_norm"] = float(out["metrics"]["grad_norm"])
            result["train"] = checked(spy.take(), samples, routes, micro_batch_size=micro_batch_size)
            result["params_moved"] = any(not torch.equal(a, p) for a, p in zip(before, actor.parameters(), strict=True))
            result["want"] = [
                LAYERS * sum(last for _, _, last in samples),
                LAYERS * sum(len(tokens) - last for tokens, _, last in samples),
            ]
            result["guard"] = sorted(
                {(r["pass"], r["routed_natively"], r["tokens"], r["padding"]) for r in agreement.ACTIVE.history}
            )
            result["held_after"] = autopatch.session().batch.tokens  # the integration drops a batch's routes
            result["refusals"] = refusals(engine, batch, micro_batch_size=micro_batch_size)
        except RouteError as e:
            result["route_error"] = str(e)
        finally:
            spy.close()
    return result


if __name__ == "__main__":
    print("VERL_ACTOR_RESULT " + json.dumps(main()), flush=True)
