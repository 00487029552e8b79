"""Drive a Megatron model the way RL trainers do: Megatron's own pipeline schedule, several micro-batches.

One *pass* is one call of ``get_forward_backward_func()`` over ``M`` micro-batches (PP and
interleaved VPP included): the log-prob pass is forward only under ``torch.no_grad()``, the training
pass forward + backward. A ``RouterProbe`` (forward hooks on every ``TopKRouter``) observes what each
router actually did, independently of the implementation under test: the routing map and probs
of every (layer, micro-batch) in the forward, and each call made during backward recompute; asked to, the router's
logits of every forward too (its gating of the input it was handed, run again: the probs' reference).

Data: token ids are drawn from a generator seeded by (seed, micro-batch), one *global* micro-batch
of ``dp * B`` sequences of length ``S``; DP rank ``d`` takes sequences ``[d * B, (d + 1) * B)``
(moeverify.routing.views conventions), CP ranks take their zigzag positions. Labels are the next token
(the last position wraps to the first). Loss = mean token cross-entropy over the DP rank's
``B * S`` tokens of the micro-batch (vocab-parallel CE, fp32), which the schedule divides by ``M``.

Legend of shape suffixes: B = sequences, S = positions, T = tokens (router order), E = experts,
V = vocabulary (this TP rank's shard).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools

import torch

from moeverify.errors import MoEVerifyError
from moeverify.oracles.replay import grad_print
from moeverify.oracles.replay.compare import topk_ids_from_map
from moeverify.oracles.replay.impls import PassGeometry, ReplayImpl
from moeverify.patches.routers import find_routers
from moeverify.routing import views
from moeverify.routing.routes import Routes
from moeverify.spec.layout import Layout


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Batches:
    """Deterministic micro-batches for one scenario."""

    seq_len: int
    batch: int  # sequences per micro-batch on one DP rank
    microbatches: int
    dp: int
    vocab_size: int
    seed: int = 0
    padding: bool = False  # mark the last quarter of every second sequence as padding

    def global_tokens(self, mb: int) -> torch.Tensor:
        """``[dp * B, S]`` token ids of global micro-batch ``mb``."""
        gen = torch.Generator().manual_seed(1_000_003 * (self.seed + 1) + mb)
        return torch.randint(0, self.vocab_size, (self.dp * self.batch, self.seq_len), generator=gen)

    def global_padding(self) -> torch.Tensor | None:
        """``[dp * B, S]`` bool, True where a token is padding (Megatron's router convention)."""
        if not self.padding:
            return None
        pad_BS = torch.zeros(self.dp * self.batch, self.seq_len, dtype=torch.bool)
        pad_BS[1::2, self.seq_len - self.seq_len // 4 :] = True
        return pad_BS


@dataclasses.dataclass(kw_only=True, slots=True)
class MicroBatch:
    mb: int
    tokens_BS: torch.Tensor
    labels_BS: torch.Tensor
    position_ids_BS: torch.Tensor
    padding_BS: torch.Tensor | None


def local_microbatches(batches: Batches, layout: Layout, *, dp_rank: int, cp_rank: int) -> list[MicroBatch]:
    """This rank's micro-batches: its DP slice of sequences and its CP positions (zigzag)."""
    cp_only = Layout(cp=layout.cp)
    pos_S = views.sequence_positions(cp_only, tp_rank=0, cp_rank=cp_rank, seq_len=batches.seq_len)
    rows = slice(dp_rank * batches.batch, (dp_rank + 1) * batches.batch)
    pad = batches.global_padding()
    out = []
    for mb in range(batches.microbatches):
        tokens = batches.global_tokens(mb)[rows]
        labels = torch.roll(tokens, shifts=-1, dims=1)
        positions = torch.arange(batches.seq_len).expand_as(tokens)
        out.append(
            MicroBatch(
                mb=mb,
                tokens_BS=tokens[:, pos_S].contiguous(),
                labels_BS=labels[:, pos_S].contiguous(),
                position_ids_BS=positions[:, pos_S].contiguous(),
                padding_BS=None if pad is None else pad[rows][:, pos_S].contiguous(),
            )
        )
    return out


@dataclasses.dataclass(kw_only=True)
class PassResult:
    """What one pass produced on this rank."""

    routing: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]]  # (layer, mb) -> (map_TE, probs_TE)
    recompute: dict[int, list[tuple[torch.Tensor, torch.Tensor]]]  # layer -> calls during backward, in order
    logits: dict[int, torch.Tensor]  # mb -> [B, S_local, V] (last stage only)
    seq_loss: dict[int, torch.Tensor]  # mb -> [B] token-CE sums per sequence over this rank's positions
    grads: dict[str, torch.Tensor | grad_print.GradPrint]  # "chunk.param" -> gradient or, when large, its print
    router_logits: dict[tuple[int, int], torch.Tensor] = dataclasses.field(default_factory=dict)  # -> logits_TE

    def topk_ids(self, layer: int, mb: int) -> torch.Tensor:
        return topk_ids_from_map(self.routing[(layer, mb)][0])


@dataclasses.dataclass(kw_only=True)
class RecordedPass(PassResult):
    """A log-prob pass (``record_pass``): what it produced, and the routes the implementation recorded."""

    routes: Routes  # on the host


class RouterProbe:
    """Forward hooks on every router: what each (layer, micro-batch) routed, forward and recompute.

    ``logits``: also keep each forward's router logits ``[T, E]`` (``router.gating`` of the input the router was
    handed, run again without grad: the same op on the same input, so the same bits), the reference the routing
    weights are judged by."""

    def __init__(self, model_chunks: list, *, logits: bool = False):
        self.routers = find_routers(model_chunks)
        self.current_mb: int | None = None
        self.forward: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self.recompute: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {layer: [] for layer in self.routers}
        self.logits: dict[tuple[int, int], torch.Tensor] | None = {} if logits else None
        self._handles: list[torch.utils.hooks.RemovableHandle] = []

    def __enter__(self) -> RouterProbe:
        for layer, (_, router) in self.routers.items():
            self._handles.append(router.register_forward_hook(functools.partial(self._hook, layer)))
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _hook(self, layer: int, module, args, output) -> None:
        probs_TE, map_TE = output
        seen = (map_TE.detach().to("cpu", copy=True), probs_TE.detach().to("cpu", copy=True))
        if self.current_mb is None:
            self.recompute[layer].append(seen)
        else:
            self.forward[(layer, self.current_mb)] = seen
            if self.logits is not None:
                with torch.no_grad():
                    logits = module.gating(args[0].detach())
                self.logits[(layer, self.current_mb)] = logits.reshape(-1, logits.shape[-1]).to("cpu", copy=True)


def _new_step(model_chunks: list) -> None:
    """Each pass starts as a training step does: grads zeroed, and routers' ``global_aux_loss`` trackers reset
    (megatron-core 0.19.2 accumulates tokens per expert over a step's forwards and resets them in
    ``finalize_model_grads``; Qwen3-Next's bridge sets ``global_aux_loss``). Without the reset a second pass over
    the same tokens has another aux loss, and router grads differ from the first pass's."""
    for chunk in model_chunks:
        for module in chunk.modules():
            reset = getattr(module, "reset_global_aux_loss_tracker", None)
            if callable(reset):
                reset()
    for chunk in model_chunks:
        if hasattr(chunk, "zero_grad_buffer"):
            chunk.zero_grad_buffer()
        for p in chunk.parameters():
            p.grad = None
            if getattr(p, "main_grad", None) is not None:
                p.main_grad.zero_()


def _grads(model_chunks: list) -> dict[str, torch.Tensor | grad_print.GradPrint]:
    out: dict[str, torch.Tensor] = {}
    for c, chunk in enumerate(model_chunks):
        for name, p in chunk.named_parameters():
            g = getattr(p, "main_grad", None)
            if g is None:
                g = p.grad
            if g is not None:
                out[f"{c}.{name}"] = g
    return grad_print.keep_all(out)


def _loss(item: MicroBatch, total_tokens: int, result: PassResult, output_BSV: torch.Tensor):
    from megatron.core import tensor_parallel  # lazy: megatron

    ce_BS = tensor_parallel.vocab_parallel_cross_entropy(output_BSV.float(), item.labels_BS.to(output_BSV.device))
    result.logits[item.mb] = output_BSV.detach().to("cpu", copy=True)
    result.seq_loss[item.mb] = ce_BS.detach().sum(dim=1)
    loss = ce_BS.sum() / total_tokens
    return loss, {"loss": loss.detach()}


def run_pass(
    model_chunks: list,
    items: list[MicroBatch],
    *,
    seq_len: int,
    forward_only: bool,
    impl: ReplayImpl | None = None,
    router_logits: bool = False,
) -> PassResult:
    """One pass of Megatron's pipeline schedule over ``items``; ``impl`` gets its per-step hooks (``begin_pass``
    with the pass's geometry first, held to every router call's token count after the pass); ``router_logits``: keep
    every forward's router logits (``PassResult.router_logits``)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func  # lazy: megatron

    result = PassResult(routing={}, recompute={}, logits={}, seq_loss={}, grads={})
    index = {id(chunk): c for c, chunk in enumerate(model_chunks)}
    batch = items[0].tokens_BS.shape[0]
    total_tokens = batch * seq_len  # the DP rank's tokens of one micro-batch, over all CP ranks

    def forward_step(data_iterator, model):
        item = next(data_iterator)
        output = forward_one(model, index[id(model)], item, impl=impl, probe=probe)
        return output, functools.partial(_loss, item, total_tokens, result)

    for chunk in model_chunks:
        chunk.train()
    _new_step(model_chunks)
    iterators = [iter(list(items)) for _ in model_chunks]
    grad_mode = torch.no_grad() if forward_only else contextlib.nullcontext()
    shape = geometry(model_chunks, items, seq_len=seq_len, forward_only=forward_only)
    if impl is not None:
        impl.begin_pass(shape)
    with RouterProbe(model_chunks, logits=router_logits) as probe, grad_mode:
        get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=iterators if len(model_chunks) > 1 else iterators[0],
            model=model_chunks if len(model_chunks) > 1 else model_chunks[0],
            num_microbatches=len(items),
            seq_length=seq_len,
            micro_batch_size=batch,
            forward_only=forward_only,
        )
    return _finish(result, probe, model_chunks, grads=not forward_only, shape=shape)


def forward_one(model, chunk: int, item: MicroBatch, *, impl: ReplayImpl | None, probe: RouterProbe):
    """One model chunk's forward of one micro-batch, with the implementation's hooks around it."""
    if impl is not None:
        impl.before_forward(chunk, item.mb)
    probe.current_mb = item.mb
    try:
        dev = next(model.parameters()).device  # data is made on CPU; CUDA ranks get it on their device
        kwargs = {} if item.padding_BS is None else {"padding_mask": item.padding_BS.to(dev)}
        output = model(item.tokens_BS.to(dev), item.position_ids_BS.to(dev), None, **kwargs)
    finally:
        probe.current_mb = None
    if impl is not None:
        impl.after_forward(chunk, item.mb)
    return output


def geometry(model_chunks: list, items: list[MicroBatch], *, seq_len: int, forward_only: bool) -> PassGeometry:
    """What a pass over ``items`` hands this rank's routers: the micro-batches' CP positions (their position ids),
    under sequence parallelism the TP slice of them (Megatron scatters the sequence dimension before the layers)."""
    from megatron.core import parallel_state  # lazy: megatron

    positions_S = items[0].position_ids_BS[0]
    if getattr(model_chunks[0].config, "sequence_parallel", False):
        tp, tp_rank = (
            parallel_state.get_tensor_model_parallel_world_size(),
            parallel_state.get_tensor_model_parallel_rank(),
        )
        size = positions_S.numel() // tp
        positions_S = positions_S[tp_rank * size : (tp_rank + 1) * size]
    return PassGeometry(
        seq_len=seq_len,
        batch=items[0].tokens_BS.shape[0],
        microbatches=len(items),
        positions=tuple(int(p) for p in positions_S),
        forward_only=forward_only,
    )


def _finish(
    result: PassResult, probe: RouterProbe, model_chunks: list, *, grads: bool, shape: PassGeometry
) -> PassResult:
    from megatron.core import parallel_state  # lazy: megatron

    for (layer, mb), (map_TE, _) in sorted(probe.forward.items()):  # what begin_pass told the implementation
        if map_TE.shape[0] != shape.tokens:
            raise MoEVerifyError(
                f"layer {layer} mb {mb}: the router routed {map_TE.shape[0]} tokens, the pass geometry says "
                f"{shape.tokens} ({len(shape.positions)} position(s) x batch {shape.batch}): the geometry handed to "
                "the implementation does not describe this layout"
            )
    result.routing = probe.forward
    result.recompute = probe.recompute
    result.router_logits = probe.logits or {}
    if grads:
        result.grads = _grads(model_chunks)
    cp_group = parallel_state.get_context_parallel_group()
    if torch.distributed.get_world_size(cp_group) > 1 and result.seq_loss:
        for sums_B in result.seq_loss.values():
            torch.distributed.all_reduce(sums_B, group=cp_group)
    result.seq_loss = {mb: sums_B.cpu() for mb, sums_B in result.seq_loss.items()}
    return result


BACKWARD_ORDERS = ("reverse", "summed")


def loop_pass(
    model_chunks: list, items: list[MicroBatch], *, seq_len: int, impl: ReplayImpl, routes, order: str
) -> PassResult:
    """A hand-written training loop (no pipeline): every forward first, then backward in ``order``.

    ``"reverse"``: ``for loss in reversed(losses): loss.backward()``; ``"summed"``: one backward of
    ``sum(losses)`` (plain gradient accumulation). Needs one model chunk and no pipeline parallelism.
    """
    if order not in BACKWARD_ORDERS:
        raise ValueError(f"unknown backward order {order!r}; expected one of {BACKWARD_ORDERS}")
    (chunk,) = model_chunks
    result = PassResult(routing={}, recompute={}, logits={}, seq_loss={}, grads={})
    total_tokens = items[0].tokens_BS.shape[0] * seq_len
    chunk.train()
    _new_step(model_chunks)
    shape = geometry(model_chunks, items, seq_len=seq_len, forward_only=False)
    with impl.replay(routes), RouterProbe(model_chunks) as probe:
        impl.begin_pass(shape)
        losses = [
            _loss(item, total_tokens, result, forward_one(chunk, 0, item, impl=impl, probe=probe))[0] / len(items)
            for item in items
        ]
        if order == "reverse":
            for loss in reversed(losses):
                loss.backward()
        else:
            torch.stack(losses).sum().backward()
    return _finish(result, probe, model_chunks, grads=True, shape=shape)


def record_pass(model_chunks: list, items: list[MicroBatch], *, seq_len: int, impl: ReplayImpl) -> RecordedPass:
    """The log-prob pass: forward only, no grad, routes recorded by ``impl``."""
    with impl.record():
        result = run_pass(model_chunks, items, seq_len=seq_len, forward_only=True, impl=impl)
    routes = impl.routes()
    return RecordedPass(
        **{f.name: getattr(result, f.name) for f in dataclasses.fields(result)},
        routes=Routes(
            {layer: [routes.get(layer, mb).cpu() for mb in range(routes.microbatches)] for layer in routes.layers},
            num_experts=routes.num_experts,
            topk=routes.topk,
        ),
    )


def replay_pass(
    model_chunks: list, items: list[MicroBatch], *, seq_len: int, impl: ReplayImpl, routes, router_logits: bool = False
) -> PassResult:
    """The training pass: forward + backward with ``routes`` replayed by ``impl``."""
    with impl.replay(routes):
        return run_pass(
            model_chunks, items, seq_len=seq_len, forward_only=False, impl=impl, router_logits=router_logits
        )
