"""Token identity of a whole-job recording (``MOEVERIFY_ROUTER_REPLAY=record:DIR`` / ``replay:DIR``).

Legend of shape suffixes: B = input sequences of one model-chunk forward.

Every forward of the bound model's first chunk on a rank (a forward pre-hook on Megatron's ``GPTModel``)
fingerprints its input sequences when it is given ``input_ids`` (``token_keys.row_fingerprints``: content and
length per row; packed THD with ``packed_seq_params``: per sequence, content, length and slot). Recording writes
them beside the routes of that forward's micro-batch (``step{S}/mb{M}/fingerprints`` in the dump format);
replay compares each forward's fingerprints with the recorded ones before the forward runs and raises
``RouteError`` at the first forward whose tokens differ: routes chosen for other tokens are never replayed.
A forward without ``input_ids`` (a pipeline stage that is not given them), or a recording without
fingerprints (older dumps), leaves token identity unknown: nothing is compared there.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch

from moeverify.errors import RouteError
from moeverify.patches import token_keys as tk
from moeverify.patches.model_hooks import ModelInitHooks


def fingerprints_of(args: tuple, kwargs: dict) -> torch.Tensor | None:
    """``[B]`` int64 fingerprints of a ``GPTModel.forward(input_ids, position_ids, attention_mask, ...)`` call's
    input sequences, or None when it has no integer ``input_ids``."""
    ids = args[0] if args else kwargs.get("input_ids")
    if not isinstance(ids, torch.Tensor) or ids.is_floating_point() or ids.dim() != 2:
        return None
    packed = args[6] if len(args) > 6 else kwargs.get("packed_seq_params")
    if packed is not None and getattr(packed, "qkv_format", "thd") == "thd":
        return tk.packed_fingerprints(
            ids, cu_seqlens=packed.cu_seqlens_q, cu_seqlens_padded=getattr(packed, "cu_seqlens_q_padded", None)
        )
    return tk.row_fingerprints(ids, padding_mask_BS=kwargs.get("padding_mask"))


def routers_of(chunk) -> list:
    """The ``TopKRouter`` s inside a model chunk (looked up once per chunk)."""
    held = chunk.__dict__.get("_moeverify_routers")
    if held is None:
        held = [weakref.ref(m) for m in chunk.modules() if type(m).__name__ == "TopKRouter"]
        chunk.__dict__["_moeverify_routers"] = held
    return [r for r in (ref() for ref in held) if r is not None]


class ChunkTokens:
    """Patches ``GPTModel.__init__`` so that every model built afterwards hands each forward's fingerprints to
    ``on_forward(chunk, fingerprints_B or None)`` (not inside a backward pass: recomputes are not forwards)."""

    def __init__(self, on_forward: Callable):
        self._on_forward = on_forward
        self._hooks = ModelInitHooks(self._pre_hook)

    def install(self) -> None:
        self._hooks.install()

    def uninstall(self) -> None:
        self._hooks.uninstall()
        self._on_forward = lambda chunk, fingerprints: None  # models built meanwhile keep their hook

    def _pre_hook(self, chunk, args, kwargs):
        if torch._C._current_graph_task_id() != -1:
            return
        self._on_forward(chunk, fingerprints_of(args, kwargs))


class JobTokens:
    """One rank's fingerprints of the bound model's forwards: taken per step (record) or checked (replay)."""

    def __init__(self, *, rank: Callable[[], int]):
        self._rank = rank
        self._taken: list[torch.Tensor | None] = []  # record: this step's forwards
        self._expected: list[tuple[int, int, torch.Tensor | None]] | None = None  # replay: (step, mb, fps)
        self._forward = 0  # replay: forwards checked so far
        self.directory = None

    def load(self, dump, directory) -> None:
        """Replay: the recorded fingerprints of this rank, forward by forward across steps."""
        rank = self._rank()
        self.directory = directory
        self._expected = [
            (step, mb, dump.fingerprints(step=step, rank=rank, mb=mb))
            for step in sorted(dump.steps)
            for mb in range(dump.steps[step].microbatches)
        ]

    @property
    def loaded(self) -> bool:
        return self._expected is not None

    def record(self, fingerprints_B: torch.Tensor | None) -> None:
        self._taken.append(fingerprints_B)

    def take_step(self, microbatches: int) -> list[torch.Tensor] | None:
        """The step's fingerprints, one per micro-batch; None when any forward's identity is unknown (no
        ``input_ids``) or the forwards do not match the micro-batches one to one."""
        taken, self._taken = self._taken, []
        known = [t for t in taken if t is not None]
        if len(taken) != microbatches or len(known) != len(taken):
            return None
        return known

    def check(self, got_B: torch.Tensor | None) -> None:
        """Replay: ``RouteError`` if this forward's input sequences are not the recorded forward's."""
        index = self._forward
        self._forward += 1
        expected = self._expected
        assert expected is not None  # loaded before the first check (``loaded``)
        if got_B is None or index >= len(expected):
            return  # identity unknown here, or a forward past the recording (the step check refuses that)
        step, mb, want_B = expected[index]
        if want_B is None:
            return
        where = f"rank {self._rank()} forward {index} (recorded step {step}, micro-batch {mb})"
        if got_B.shape != want_B.shape:
            raise RouteError(
                f"{where}: the input holds {got_B.numel()} sequence(s), the recording "
                f"{self.directory} holds {want_B.numel()} for this micro-batch: replay would train on "
                f"routes chosen for other tokens (the job's data or batching differ from the recorded "
                f"run's)"
            )
        differ = (got_B != want_B).nonzero().flatten().tolist()
        if differ:
            first = differ[0]
            moved = [
                (s, m)
                for s, m, other_B in expected
                if other_B is not None and other_B.shape == got_B.shape and bool((other_B == got_B).all())
            ]
            if moved:  # the sequences of another recorded forward: the same data, fed or batched otherwise
                raise RouteError(
                    f"{where}: this forward's sequences are those of recorded step {moved[0][0]}, micro-batch "
                    f"{moved[0][1]} (recording {self.directory}): the job feeds its micro-batches in another "
                    f"order or number per step than the recorded run; replay needs the recorded batching"
                )
            raise RouteError(
                f"{where}: tokens differ in {len(differ)} of {want_B.numel()} sequence(s); first: "
                f"sequence {first} has fingerprint {tk.fingerprint_hex(int(got_B[first]))}, the "
                f"recording {self.directory} holds {tk.fingerprint_hex(int(want_B[first]))} (content "
                f"or length differ; the recording keeps fingerprints, not tokens, so the position is "
                f"not known): replay would train on routes chosen for other tokens (the job's data, "
                f"seed or sampler differ from the recorded run's)"
            )
