"""Run verl's own Megatron engine (the actor's compute_log_prob and update_actor paths of verl 0.9.1:
``MegatronEngineWithLMHead.infer_batch`` / ``train_batch``) unmodified on a CPU rank, on the tiny Qwen3-MoE under
in-job R3 with the routes handed over with the batch. Run as a script by ``test_verl_actor_r3.py`` (its own process:
verl's imports patch megatron and set a process-wide platform); prints one JSON line.

verl is loaded from ``MOEVERIFY_VERL_SITE`` (the wheel unpacked or ``pip install --no-deps --target``) with its pure
dependencies from ``MOEVERIFY_VERL_DEPS`` (tensordict, ray, ...). Shims, none of them in verl's code:
- ``verl``, ``verl.workers``, ``verl.workers.engine``, ``verl.utils.dataset`` registered as empty packages (their
  ``__init__`` would import the FSDP engine, peft, datasets, ...); ``BaseEngine``/``EngineRegistry`` set on the
  engine package, as its ``__init__`` does;
- a CPU platform registered through verl's plugin registry (``verl.plugin.platform``: ``PlatformRegistry.register``,
  ``set_platform``), so ``get_device_id()`` is ``"cpu"``;
- the engine object made without ``initialize()`` (which builds its model from an HF checkout through the bridge
  with DDP and Megatron's distributed optimizer): our model chunk as ``module``, a plain SGD behind the
  ``zero_grad``/``step() -> (ok, grad_norm, zeros)`` interface, ``zero_grad_buffer`` a no-op on the chunk (no DDP).
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


def make_engine(cls, chunk, *, micro_batch_size):
    from verl.workers.config import McoreEngineConfig

    engine = cls.__new__(cls)
    engine.engine_config = McoreEngineConfig(
        use_remove_padding=False, pad_bshd_to_minibatch_max=False, micro_batch_size_per_gpu=micro_batch_size
    )
    engine.module = [chunk]
    engine.tf_config = chunk.config
    engine.enable_routing_replay = False  # verl's own replay off: moeverify's in-job R3 replays
    engine._is_offload_param = engine._is_offload_optimizer = False
    engine.mode = None
    engine.model_config = types.SimpleNamespace(
        hf_config=types.SimpleNamespace(architectures=["Qwen3MoeForCausalLM"]),
        mtp=types.SimpleNamespace(enable=False),
        tokenizer=types.SimpleNamespace(pad_token_id=0),
        get=lambda key, default=None: default,
    )
    engine.optimizer = SGDBehindMegatronOptimizer(chunk.parameters())
    chunk.zero_grad_buffer = lambda: None  # no DDP grad buffer on this chunk
    return engine


def verl_batch(prompts, answers, routes, *, prompt_width, response_width):
    """verl's DataProto layout: prompts left-padded, responses right-padded, ``routed_experts`` aligned with
    ``input_ids`` (the last real token's row never filled), ``response_mask`` over the response columns."""
    import torch

    b, width = len(prompts), prompt_width + response_width
    ids = torch.zeros(b, width, dtype=torch.long)
    mask = torch.zeros(b, width, dtype=torch.long)
    routed = torch.zeros(b, width, LAYERS, routes[0].shape[-1], dtype=torch.int64)
    response_mask = torch.zeros(b, response_width, dtype=torch.long)
    for i, (p, a, r) in enumerate(zip(prompts, answers, routes, strict=True)):
        first = prompt_width - len(p)
        ids[i, first:prompt_width], ids[i, prompt_width : prompt_width + len(a)] = p, a
        mask[i, first : prompt_width + len(a)] = 1
        response_mask[i, : len(a)] = 1
        routed[i, first : first + len(p) + len(a) - 1] = r[:-1]
    return ids, mask, routed, response_mask


def engine_batch(ids, mask, routed, response_mask, *, prompt_width, micro_batch_size):
    """The engine's input, made by verl's own ``left_right_2_no_padding`` as its trainer does."""
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
            "prompts": ids[:, :prompt_width].clone(),
            "responses": ids[:, prompt_width:].clone(),
            "temperature": torch.ones(b),
        },
        batch_size=[b],
    )
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


def main() -> dict:
    micro_batch_size = int(os.environ.get("MOEVERIFY_VERL_MBS", "1"))
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    engine_cls = load_verl()
    import torch
    from test_injob_r3 import engine_routes
    from test_injob_replay import Spy, installed_world, random_sequences

    from moeverify.errors import RouteError
    from moeverify.patches import agreement, injob

    os.environ[agreement.FLOOR_ENV] = agreement.OFF  # the engine model has other weights: no better than chance
    world = installed_world("r3")
    actor, rollout_model, vocab = next(world)
    result: dict = {"micro_batch_size": micro_batch_size}
    try:
        prompt_width, response_width = 5, 6
        prompts = random_sequences(vocab, [3, 2, 4, 3], 71)
        answers = random_sequences(vocab, [4, 2, 5, 3], 72)
        sequences = [torch.cat([p, a]) for p, a in zip(prompts, answers, strict=True)]
        routes = engine_routes(rollout_model, sequences)  # [S, L, K] per request, as the engine routed
        ids, mask, routed, response_mask = verl_batch(
            prompts, answers, routes, prompt_width=prompt_width, response_width=response_width
        )
        result["held"] = injob.add_routes(version=3, input_ids=ids, attention_mask=mask, routes=routed)
        engine = make_engine(engine_cls, actor, micro_batch_size=micro_batch_size)
        spy = Spy(actor)

        def checked(calls) -> int:
            # micro-batches in batch order; under micro-batch size 1 each is one sequence with no padding
            per = [calls[j : j + LAYERS] for j in range(0, len(calls), LAYERS)]
            assert len(per) == len(sequences) // micro_batch_size, [c[0] for c in calls]
            n = 0
            for i, mb in enumerate(per):
                assert sorted(c[0] for c in mb) == list(range(LAYERS))
                for layer, ids_TK in mb:
                    seq = sequences[i]
                    assert ids_TK.shape[0] == len(seq), (ids_TK.shape, len(seq))
                    for s in range(len(seq) - 1):  # the last token has no engine row: routed natively
                        assert torch.equal(ids_TK[s], routes[i][s, layer]), (i, layer, s)
                        n += 1
            return n

        try:
            with engine.eval_mode():  # ActorRolloutRefWorker.compute_log_prob -> TrainingWorker.infer_batch
                out = engine.infer_batch(
                    engine_batch(
                        ids, mask, routed, response_mask, prompt_width=prompt_width, micro_batch_size=micro_batch_size
                    )
                )
            log_probs = out["model_output"]["log_probs"]
            result["log_probs_tokens"] = int(log_probs.values().numel())
            result["log_prob_checked"] = checked(spy.take())
            before = [p.detach().clone() for p in actor.parameters()]
            with engine.train_mode():  # update_actor -> TrainingWorker.train_batch -> engine.train_batch
                out = engine.train_batch(
                    engine_batch(
                        ids, mask, routed, response_mask, prompt_width=prompt_width, micro_batch_size=micro_batch_size
                    ),
                    loss_function=policy_loss,
                )
            result["grad_norm"] = float(out["metrics"]["grad_norm"])
            result["train_checked"] = checked(spy.take())
            result["params_moved"] = any(not torch.equal(a, p) for a, p in zip(before, actor.parameters(), strict=True))
            result["want"] = LAYERS * sum(len(s) - 1 for s in sequences)
        except RouteError as e:
            result["route_error"] = str(e)
        finally:
            spy.close()
            injob.drop_routes()
    finally:
        world.close()
    return result


if __name__ == "__main__":
    print("VERL_ACTOR_RESULT " + json.dumps(main()), flush=True)
