"""Helpers shared by the zoo's training jobs (``interleaved_job.py``, ``tp_sp_accum_job.py``).

Only ``session_step`` touches ``moeverify.patches`` (it imports it when called): a job's plain mode, which uses
the other helpers only, is an unmodified Megatron job, which is what autopatch must handle.

- ``RouteLog``: forward hooks on every ``TopKRouter`` that observe what each router actually did, apart from
  the implementation under test: the expert ids of every forward call and of every call made while autograd
  runs a backward pass (full recompute), per global layer, in call order; and, for every forward call, the ids
  that native top-k routing picks with the router's *current* weights (Megatron's own
  ``topk_routing_with_score_function`` on the router's own gating), so a replay that follows a recording can be
  told apart from native routing.
- ``grad_digest``: per parameter, the sha256 of the gradient's raw bytes (bitwise comparison across processes).
- ``session_step``: one training step through the documented session API (``rr.ReplaySession``), with the
  native references computed in the same process on the same weights, Megatron unpatched (``rr.revert()``).
- ``perturb_routers`` / ``router_weights`` / ``restore_router_weights``: change the router weights (seeded) and
  put them back bit for bit.
"""

from __future__ import annotations

import hashlib
import json
import os

import torch


def routers_of(chunks) -> list:
    return [m for chunk in chunks for m in chunk.modules() if type(m).__name__ == "TopKRouter"]


def set_full_recompute(chunks, config=None) -> None:
    """Megatron's full, uniform recompute of every layer (the training forwards checkpoint each layer)."""
    configs = {
        id(c): c
        for chunk in chunks
        for m in chunk.modules()
        for c in [getattr(m, "config", None)]
        if c is not None and hasattr(c, "recompute_granularity")
    }
    if config is not None:
        configs[id(config)] = config
    for c in configs.values():
        c.recompute_granularity, c.recompute_method, c.recompute_num_layers = "full", "uniform", 1


def in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


class RouteLog:
    """What every router did while ``active``: ``forward`` / ``recompute`` / ``native`` ids per global layer."""

    def __init__(self, chunks):
        self.routers = routers_of(chunks)
        if not self.routers:
            raise RuntimeError("no TopKRouter in the model")
        self.active = False
        self.clear()
        for router in self.routers:
            router.register_forward_hook(self._hook)

    def clear(self) -> None:
        self.forward: dict[int, list] = {}
        self.recompute: dict[int, list] = {}
        self.native: dict[int, list] = {}

    @staticmethod
    def _ids(routing_map_TE: torch.Tensor) -> list:
        return routing_map_TE.nonzero()[:, 1].view(routing_map_TE.shape[0], -1).tolist()

    def _hook(self, router, args, output) -> None:
        if not self.active:
            return
        layer = router.layer_number - 1
        if in_backward():
            self.recompute.setdefault(layer, []).append(self._ids(output[1]))
            return
        self.forward.setdefault(layer, []).append(self._ids(output[1]))
        from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function

        config = router.config
        with torch.no_grad():
            logits_TE = router.gating(args[0]).reshape(-1, router.num_experts)
            _, native_TE = topk_routing_with_score_function(
                logits_TE,
                router.topk,
                use_pre_softmax=config.moe_router_pre_softmax,
                num_groups=config.moe_router_num_groups,
                group_topk=config.moe_router_group_topk,
                scaling_factor=config.moe_router_topk_scaling_factor,
                score_function=router.score_function,
                expert_bias=router.expert_bias,
                fused=False,
            )
        self.native.setdefault(layer, []).append(self._ids(native_TE))

    def snapshot(self) -> dict:
        key = lambda d: {str(k): v for k, v in sorted(d.items())}  # noqa: E731 (JSON keys are strings)
        return {"forward": key(self.forward), "recompute": key(self.recompute), "native": key(self.native)}


def grad_digest(chunks) -> dict:
    """``{"chunk.name": sha256 of the grad's raw bytes | None}`` over every parameter of every chunk."""
    out = {}
    for c, chunk in enumerate(chunks):
        for name, p in chunk.named_parameters():
            g = p.grad
            if g is None:
                out[f"{c}.{name}"] = None
                continue
            raw = g.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
            out[f"{c}.{name}"] = f"{g.dtype}:{tuple(g.shape)}:" + hashlib.sha256(raw.numpy().tobytes()).hexdigest()
    return out


def zero_grads(chunks) -> None:
    for chunk in chunks:
        for p in chunk.parameters():
            p.grad = None


def perturb_routers(routers) -> None:
    """What pipeline_job.py's PERTURB does: seeded noise on every router weight, big enough to change routes."""
    with torch.no_grad():
        for r in routers:
            r.weight.add_(torch.randn(r.weight.shape, generator=torch.Generator().manual_seed(3)) * 3)


def router_weights(routers) -> list[torch.Tensor]:
    return [r.weight.detach().clone() for r in routers]


def restore_router_weights(routers, saved) -> None:
    with torch.no_grad():
        for r, w in zip(routers, saved, strict=True):
            r.weight.copy_(w)


def perturb_step() -> int | None:
    """The step before whose log-prob pass a plain-mode job perturbs its routers: ``PERTURB_FROM=K`` (``PERTURB=1``
    is ``PERTURB_FROM=0``, as in pipeline_job.py); None: never. The weights stay perturbed from then on."""
    if os.environ.get("PERTURB_FROM"):
        return int(os.environ["PERTURB_FROM"])
    return 0 if os.environ.get("PERTURB") == "1" else None


def write_json(path: str, obj) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f)
    os.replace(tmp, path)


def sorted_ids(routes) -> dict:
    """A ``Routes`` as JSON: per layer and micro-batch the ids of each token sorted (as ``RouteLog`` writes them)."""
    return {
        str(layer): [routes.get(layer, mb).sort(dim=1).values.tolist() for mb in range(routes.microbatches)]
        for layer in routes.layers
    }


def session_step(session, routers, *, logprob, train, wrong: bool = False) -> dict:
    """One step through the session API; ``logprob()`` runs the log-prob pass, ``train()`` one training pass
    (forward + backward from zeroed grads) and returns ``{"routes": RouteLog.snapshot(), "grads": grad_digest}``.

    Passes, all on this step's weights and batches:
      ``native``: Megatron unpatched (``rr.revert()``), the reference;
      then ``session.record()`` around the log-prob pass -> ``recorded``;
      ``perturbed_native`` / ``perturbed_replay``: router weights perturbed (restored bit for bit after):
      Megatron unpatched, then ``session.replay(recorded)``;
      ``wrong_replay`` (``wrong=True``): replay of the recorded ids shifted by one expert, a negative control;
      ``replay``: ``session.replay(recorded)`` on the unperturbed weights, last: its grads are the step's.
    ``session.check_consumed()`` after every replay.
    """
    from moeverify.patches import router_replay as rr
    from moeverify.routing.routes import Routes

    def native():
        rr.revert()
        try:
            return train()
        finally:
            rr.apply()

    def replay(routes):
        with session.replay(routes):
            result = train()
        session.check_consumed()
        return result

    out = {"native": native()}
    with session.record():
        logprob()
    routes = session.routes()
    out["recorded"] = sorted_ids(routes)
    saved = router_weights(routers)
    perturb_routers(routers)
    try:
        out["perturbed_native"] = native()
        out["perturbed_replay"] = replay(routes)
    finally:
        restore_router_weights(routers, saved)
    if wrong:
        shifted = {
            layer: [(routes.get(layer, mb) + 1) % routes.num_experts for mb in range(routes.microbatches)]
            for layer in routes.layers
        }
        out["wrong_replay"] = replay(Routes(shifted, num_experts=routes.num_experts, topk=routes.topk))
    out["replay"] = replay(routes)
    return out
