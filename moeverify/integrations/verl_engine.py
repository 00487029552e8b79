"""verl's Megatron engine handing each batch's rollout routes to in-job R3 (``MOEVERIFY_ROUTER_REPLAY=r3``).

Legend: B = samples of a batch, N = their tokens (jagged, concatenated), R = response columns (right-padded),
W = layer columns of the engine's routes, K = top-k.

Where verl holds the batch. verl 0.9.1's actor (``engine_workers.ActorRolloutRefWorker.compute_log_prob`` and
``update_actor`` -> ``TrainingWorker.infer_batch`` / ``train_batch``) runs every forward of its Megatron model through
``MegatronEngine.forward_backward_batch(data, loss_function, forward_only)``, this DP rank's (mini-)batch in hand as
``verl.workers.utils.padding.left_right_2_no_padding`` made it: ``input_ids`` jagged (each sample's real tokens),
``routed_experts`` jagged and aligned with them (``[N, W, K]``: what the rollout engine routed, zeros where it routed
nothing), ``response_mask`` ``[B, R]`` (1 on tokens the policy generated, 0 on a tool's output), the padded batch's
``attention_mask`` and, from verl's agent loop, each sample's ``max_global_steps`` (the weights version of its last
generation, whose routes it carries). ``MegatronEngineWithLMHead.forward_step`` runs one micro-batch's forward.

The hooks act on the policy's engine (an LM head that trains; not the reference's ``forward_only`` engine, not the
critic's value head), whose model alone is bound when the integration started in-job replay (``autopatch.choose_model``
at its first batch; a reference or any other model in the process routes natively) unless
``MOEVERIFY_ROUTER_REPLAY_MODEL`` names one by build order:

- ``forward_backward_batch``: the batch's routes go to ``injob.add_routes`` before Megatron's schedule runs and are
  dropped after it (a rank holds one batch's routes at a time; the integration owns ``add_routes`` in a verl job):
  each sample under its version, the tokens after its last generation (a tool's output: ``agent_loop``'s zero rows)
  declared never routed by the engine (``native=``): they route natively and the agreement guard counts them apart;
- ``forward_step``: the micro-batch's forward names each sample's version (``injob.rollout_version``); on the BSHD
  path (``use_remove_padding=False``) it reads verl's attention mask as the padding (True = token:
  ``injob.padding_from_attention_mask``), on the THD path it names each packed sample's real length
  (``injob.packed_lengths``: verl's ``preprocess_thd_engine`` passes the TP/CP-aligned slots as ``cu_seqlens_q``).

Refused, naming the way out: another verl version (``SUPPORTED``; the hooked methods' signatures are checked too),
in-job replay installed in another mode, verl's own router replay on, dynamic context parallel, a batch without
``routed_experts`` or not laid out as verl 0.9.1 lays it out, a route row after a sample's last generation (routes not
aligned with the tokens), versions that are not integers >= 0, more versions in one batch than in-job R3 keeps.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import numbers
import os
from collections.abc import Iterator
from pathlib import Path

import torch

from moeverify.errors import UsageError
from moeverify.patches import autopatch, injob, rollout_source

SUPPORTED = ("0.9.1",)  # verl versions whose engine code the hooks were written against (and tested on)
VERSION_KEY = "max_global_steps"  # per sample: the weights version of its last generation (verl's llm_server.py)
WHO = "moeverify.integrations.verl"
# The hooked methods as verl 0.9.1 declares them: (class name, method, parameters).
HOOKS = (
    ("MegatronEngine", "forward_backward_batch", ("self", "data", "loss_function", "forward_only")),
    (
        "MegatronEngineWithLMHead",
        "forward_step",
        ("self", "batch_iter", "model", "logits_processor_func", "postprocess_micro_batch_func"),
    ),
)

_HOOKED: list[tuple[type, str, object]] = []  # (class, method, original), restored by uninstall()
_STARTED: list[bool] = []  # install() started in-job replay itself (uninstall() stops it)
_CHOOSING: list = []  # [the policy engine whose model is bound, or None]: the integration chooses the bound model


def install() -> None:
    """Hook verl's Megatron engine (module docstring); starts in-job R3 with the batch unless it runs. Idempotent."""
    if _HOOKED:
        return
    import verl  # lazy: verl

    check_version(_version_of(verl))
    from verl.workers.engine.megatron import transformer_impl  # lazy: verl

    classes: dict[str, type] = {}
    for name, method, params in HOOKS:
        classes[name] = check_signature(getattr(transformer_impl, name, None), name, method, params)
    _start_r3()
    for name, method, _ in HOOKS:
        cls = classes[name]
        original = cls.__dict__[method]
        wrapped = _hand_over_batch(original) if method == "forward_backward_batch" else _name_micro_batch(original)
        setattr(cls, method, wrapped)
        _HOOKED.append((cls, method, original))
    _VALUE_HEAD[:] = [getattr(transformer_impl, "MegatronEngineWithValueHead", None)]


def uninstall() -> None:
    """Restore verl's methods; stop in-job replay if ``install()`` started it."""
    while _HOOKED:
        cls, method, original = _HOOKED.pop()
        setattr(cls, method, original)
    _CHOOSING.clear()
    if _STARTED:
        _STARTED.clear()
        autopatch.uninstall()


def check_version(version: str) -> None:
    """``UsageError`` unless ``version`` is one the hooks were written against."""
    if version not in SUPPORTED:
        raise UsageError(
            f"{WHO}: verl {version} is installed; the integration reads verl {', '.join(SUPPORTED)}'s Megatron "
            "engine (MegatronEngine.forward_backward_batch, MegatronEngineWithLMHead.forward_step and the batch "
            f"fields they hold) and hooks no other version: install verl {SUPPORTED[-1]}, or hand the batch's routes "
            "over yourself with injob.add_routes (docs/use-rl-job.md)"
        )


def check_signature(cls, name: str, method: str, params: tuple[str, ...]) -> type:
    """``cls``; ``UsageError`` unless ``cls.method`` takes ``params``: the code the hooks were written for."""
    function = getattr(cls, "__dict__", {}).get(method)
    got = tuple(inspect.signature(function).parameters) if callable(function) else None
    if got != params:
        raise UsageError(
            f"{WHO}: verl's {name}.{method} takes {got}, not {params} as in verl {', '.join(SUPPORTED)}: this verl "
            "is not the one the integration hooks; install a supported verl"
        )
    return cls


def _version_of(verl) -> str:
    """verl's version as verl reads it (``verl/version/version``), else ``verl.__version__``."""
    for root in getattr(verl, "__path__", []):
        path = Path(root, "version", "version")
        if path.is_file():
            return path.read_text().strip()
    version = getattr(verl, "__version__", None)
    if not isinstance(version, str):
        raise UsageError(f"{WHO}: cannot tell the installed verl's version (no verl/version/version, no __version__)")
    return version


def _start_r3() -> None:
    """In-job R3 with the routes handed over with the batch, installed now unless it runs."""
    value = os.environ.get(autopatch.ENV) or None
    session = autopatch.session()
    if session is None and value in (None, autopatch.ROLLOUT):
        model = os.environ.get(autopatch.MODEL_ENV) or None
        autopatch.install(autopatch.parse(autopatch.ROLLOUT, model))
        _STARTED.append(True)
        if model is None:  # the policy engine's model is bound when its first batch comes; the others route natively
            autopatch.choose_model(None)
            _CHOOSING[:] = [None]
    elif session is None or getattr(session, "batch", None) is None:
        raise UsageError(
            f"{WHO} hands verl's routed_experts to in-job R3 with the batch ({autopatch.ENV}={autopatch.ROLLOUT}), "
            f"but {autopatch.ENV}={value} asks for another replay; unset it (the integration starts r3) or set "
            f"{autopatch.ENV}={autopatch.ROLLOUT}"
        )


_VALUE_HEAD: list = []  # verl's MegatronEngineWithValueHead (the critic), set by install()


def is_policy(engine) -> bool:
    """The engine of the model that trains on the rollout's routes: not the reference's (``forward_only``), not the
    critic's value head."""
    value_head = _VALUE_HEAD[0] if _VALUE_HEAD else None
    if value_head is not None and isinstance(engine, value_head):
        return False
    return not getattr(engine.engine_config, "forward_only", False)


def _refuse_config(engine) -> None:
    if getattr(engine, "enable_routing_replay", False):
        raise UsageError(
            f"{WHO}: verl's own router replay is on (actor.megatron.router_replay.mode="
            f"{engine.engine_config.router_replay.mode!r}); it patches Megatron's router too: set "
            "router_replay.mode=disabled (moeverify replays the routes)"
        )
    if getattr(engine.engine_config, "dynamic_context_parallel", False):
        raise UsageError(
            f"{WHO}: verl's dynamic context parallel changes the CP group a micro-batch at a time; in-job replay keys "
            "tokens over Megatron's CP group: turn dynamic_context_parallel off"
        )


def _hand_over_batch(original):
    @functools.wraps(original)
    def forward_backward_batch(self, data, loss_function, forward_only=False):
        if not is_policy(self):
            return original(self, data, loss_function, forward_only)
        _refuse_config(self)
        _choose(self)
        hand_over(data)
        try:
            return original(self, data, loss_function, forward_only)
        finally:
            injob.drop_routes()

    return forward_backward_batch


def _choose(engine) -> None:
    """Bind the policy engine's model (when the integration chooses it): once, before its first forward."""
    if not _CHOOSING or _CHOOSING[0] is engine:
        return
    if _CHOOSING[0] is not None:
        raise UsageError(
            f"{WHO}: a second policy engine (an LM head that trains) in this process; in-job replay binds one model: "
            f"set {autopatch.MODEL_ENV}=N to name it by build order"
        )
    autopatch.choose_model(engine.module)
    _CHOOSING[0] = engine


def hand_over(data) -> int:
    """Hand a verl engine batch's routes to in-job R3, replacing those held (module docstring); returns the tokens
    held."""
    from verl.utils import tensordict_utils as tu  # lazy: verl

    ids, routed = data.get("input_ids", None), data.get("routed_experts", None)
    if routed is None:
        raise UsageError(
            f"{WHO}: verl's batch carries no routed_experts: the rollout must return the routes it took "
            "(actor_rollout_ref.rollout.enable_rollout_routing_replay=True)"
        )
    if not (getattr(ids, "is_nested", False) and getattr(routed, "is_nested", False)):
        raise UsageError(
            f"{WHO}: expected jagged input_ids and routed_experts (verl 0.9.1's left_right_2_no_padding), got "
            f"{type(ids).__name__} and {type(routed).__name__}"
        )
    offsets = ids.offsets()
    if not torch.equal(routed.offsets().to(offsets.device), offsets):
        raise UsageError(f"{WHO}: routed_experts are not aligned with input_ids (other lengths per sample)")
    masks = {key: data.get(key, None) for key in ("response_mask", "attention_mask")}
    if any(not isinstance(m, torch.Tensor) or m.is_nested or m.dim() != 2 for m in masks.values()):
        raise UsageError(
            f"{WHO}: expected the padded response_mask [B, R] and attention_mask [B, S] verl 0.9.1's "
            f"left_right_2_no_padding keeps, got { ({k: type(m).__name__ for k, m in masks.items()}) }"
        )
    sequences, routes, native = requests_of(
        tokens_N=ids.values().cpu(),
        offsets=offsets.cpu(),
        routes_NWK=routed.values().cpu(),
        response_mask_BR=masks["response_mask"].cpu(),
        attention_mask_BS=masks["attention_mask"].cpu(),
    )
    versions = versions_of(tu.get(data, VERSION_KEY), len(sequences))
    injob.drop_routes()
    return injob.add_routes(version=versions, sequences=sequences, routes=routes, native=native)


def requests_of(
    *,
    tokens_N: torch.Tensor,
    offsets: torch.Tensor,
    routes_NWK: torch.Tensor,
    response_mask_BR: torch.Tensor,
    attention_mask_BS: torch.Tensor,
) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    """Per sample ``(tokens [S], routes [S, W, K], native [S])``: ``native`` marks the tokens after the sample's last
    generated token, and that token when its row is unfilled (the engine never fed it back): verl's zero rows of a
    trajectory that ends in a tool's output. A filled row among them is refused (routes not aligned with tokens)."""
    lengths = offsets.diff().tolist()
    r = response_mask_BR.shape[1]
    response_len_B = attention_mask_BS[:, -r:].sum(dim=1).tolist()
    if attention_mask_BS.sum(dim=1).tolist() != lengths:
        raise UsageError(
            f"{WHO}: the batch's attention_mask counts {attention_mask_BS.sum(dim=1).tolist()} tokens per sample, "
            f"input_ids hold {lengths}: not the layout of verl 0.9.1's left_right_2_no_padding"
        )
    sequences, routes, native = [], [], []
    starts = offsets.tolist()
    for i, (length, response_len) in enumerate(zip(lengths, response_len_B, strict=True)):
        tokens_S, routes_SWK = tokens_N[starts[i] : starts[i + 1]], routes_NWK[starts[i] : starts[i + 1]]
        native_S = torch.zeros(length, dtype=torch.bool)
        generated = response_mask_BR[i, :response_len].nonzero().flatten()
        if generated.numel():
            last = length - response_len + int(generated[-1])
            unfilled_S = ((routes_SWK == 0) | (routes_SWK == -1)).flatten(1).all(dim=1).cpu()
            filled = (~unfilled_S[last + 1 :]).nonzero().flatten()
            if filled.numel():
                raise UsageError(
                    f"{WHO}: sample {i}: position {last + 1 + int(filled[0])} holds a route, after the sample's last "
                    f"generated token (position {last}): the engine routes no token past its last generation; "
                    "routed_experts not aligned with input_ids?"
                )
            native_S[last + 1 :] = True
            native_S[last] = bool(_gap(routes_SWK[last]))
        sequences.append(tokens_S)
        routes.append(routes_SWK)
        native.append(native_S)
    return sequences, routes, native


def _gap(routes_WK: torch.Tensor) -> bool:
    """A row the engine left unfilled in every layer column: all -1, or all zeros with K > 1."""
    unfilled = (routes_WK == -1).all() or (routes_WK.shape[-1] > 1 and (routes_WK == 0).all())
    return bool(unfilled)


def versions_of(values, samples: int) -> list[int]:
    """Each sample's rollout version from verl's per-sample ``max_global_steps`` (None or absent: one version, 0,
    for the batch). ``UsageError`` on other values, or more versions than in-job R3 keeps."""
    if hasattr(values, "tolist"):  # a tensor or an array
        values = values.tolist()
    if not isinstance(values, (list, tuple)):  # one value for the batch (NonTensorData), or none
        values = [values] * samples
    if len(values) != samples:
        raise UsageError(f"{WHO}: {len(values)} {VERSION_KEY} values for {samples} samples")
    if all(v is None for v in values):
        return [0] * samples
    versions = []
    for v in values:
        if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 0:
            raise UsageError(
                f"{WHO}: {VERSION_KEY}={v!r}: each sample's version must be an integer >= 0 (the rollout server's "
                "global_steps, on every sample or on none)"
            )
        versions.append(int(v))
    kept = rollout_source.keep()
    if len(set(versions)) > kept:
        raise UsageError(
            f"{WHO}: one batch holds samples of {len(set(versions))} versions {sorted(set(versions))}, in-job R3 "
            f"keeps {kept}: raise {rollout_source.KEEP_ENV}"
        )
    return versions


def _name_micro_batch(original):
    @functools.wraps(original)
    def forward_step(self, batch_iter, *args, **kwargs):
        if not is_policy(self):
            return original(self, batch_iter, *args, **kwargs)
        thd = bool(self.engine_config.use_remove_padding)
        with contextlib.ExitStack() as stack:
            if not thd:  # verl's BSHD branch: attention_mask True = token
                stack.enter_context(injob.padding_from_attention_mask(marks="tokens"))
            return original(self, _Versioned(batch_iter, stack, thd=thd), *args, **kwargs)

    return forward_step


class _Versioned:
    """``batch_iter`` whose next micro-batch names its samples' versions for the forward that follows (until the
    ``forward_step`` that took it returns) and, packed (THD), their real lengths: verl's ``preprocess_thd_engine``
    gives ``GPTModel`` the slots (padded to TP x CP alignment) as ``cu_seqlens_q``."""

    def __init__(self, inner, stack: contextlib.ExitStack, *, thd: bool):
        self._inner, self._stack, self._thd = inner, stack, thd

    def __iter__(self) -> Iterator:
        return self

    def __next__(self):
        from verl.utils import tensordict_utils as tu  # lazy: verl

        batch = next(self._inner)
        versions = versions_of(tu.get(batch, VERSION_KEY), len(batch))
        self._stack.enter_context(injob.rollout_version(versions[0] if len(set(versions)) == 1 else versions))
        if self._thd:
            self._stack.enter_context(injob.packed_lengths(batch["input_ids"].offsets().diff()))
        return batch
