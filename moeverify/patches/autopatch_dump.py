"""Where the autopatch's recording goes: ONE routing dump for the whole job, every rank in it.

Each rank writes its own routes with its real place in the layout (read from Megatron's parallel state and
checked against the layout's rank order), each micro-batch's geometry (the router input's ``[s, b]``), and
rank 0 commits the step to the manifest after every rank closed it: once per ``optimizer.step()``, so a crash
loses at most the step in flight and ``moeverify dump inspect/diff DIR`` read the merged global view.

Collectives (the first step's model shape, a barrier around each commit) run on a gloo group of their own
with its own timeout, so they work beside NCCL and never wait forever.
Assumptions, read against megatron-core 0.19.2: ``parallel_state`` getters for every size and rank; the
router's input is ``[s_local, b, h]`` (``[t, h]`` for packed sequences: no geometry, then the merged view
refuses the dump instead of guessing).
"""

from __future__ import annotations

import datetime
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from moeverify.routing.views import job_layout
from moeverify.spec import timeouts

if TYPE_CHECKING:  # annotations only
    from moeverify.record.format import ModelInfo
    from moeverify.routing.views import RankCoords
    from moeverify.spec.layout import Layout


class JobDump:
    """One rank's side of the job's dump at ``directory``."""

    def __init__(self, directory: Path):
        self.directory = directory
        self.layout: Layout | None = None
        self.coords: RankCoords | None = None
        self.world = 1
        self.model: ModelInfo | None = None  # agreed by every rank at the first step that routed (``_start``)
        self._group = None

    def _collective_group(self):
        dist = torch.distributed if torch.distributed.is_available() and torch.distributed.is_initialized() else None
        if dist is None or dist.get_world_size() == 1:
            return None
        if self._group is None:
            self._group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeouts.DUMP_COLLECTIVE_S))
        return self._group

    def _all_max(self, values: list[int]) -> list[int]:
        group = self._collective_group()
        if group is None:
            return values
        t = torch.tensor(values, dtype=torch.int64)
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX, group=group)
        return t.tolist()

    def _barrier(self) -> None:
        group = self._collective_group()
        if group is not None:
            torch.distributed.barrier(group=group)

    def _start(self, *, config, layers: list[int], num_experts: int, topk: int) -> None:
        """Agree with every rank on the model shape (the union of the ranks' MoE layers) and the layout
        (collective). A rank without a router (a dense pipeline stage) takes part with zeros."""
        from moeverify.record.format import ModelInfo  # lazy: safetensors

        decoder = int(getattr(config, "num_layers", 0) or 0) + int(getattr(config, "mtp_num_layers", 0) or 0)
        sp = int(bool(getattr(config, "sequence_parallel", False)))
        num_layers, experts, k, sp = self._all_max(
            [max([decoder, *(x + 1 for x in layers)], default=0), num_experts, topk, sp]
        )
        self.layout, self.coords, self.world = job_layout(sp=bool(sp))
        present = [0] * num_layers
        for layer in layers:
            present[layer] = 1
        present = self._all_max(present) if num_layers else present
        self.model = ModelInfo(
            num_layers=num_layers, moe_layers=tuple(i for i, p in enumerate(present) if p), num_experts=experts, topk=k
        )

    def write_step(
        self,
        *,
        step: int,
        routes,
        config,
        shapes: dict[int, list],
        shape: tuple[int, int] | None,
        fingerprints: list | None = None,
    ) -> None:
        """Write this rank's ``routes`` (None: nothing recorded here) as ``step`` and commit it (collective);
        ``fingerprints``: the ``[B]`` token fingerprints of each micro-batch's input sequences, or None (unknown)."""
        from moeverify.record import RankWriter, finalize  # lazy: safetensors

        rows = (
            sum(routes.get(layer, mb).shape[0] for layer in routes.layers for mb in range(routes.microbatches))
            if routes
            else 0
        )
        if self._all_max([rows])[0] == 0:
            return  # an optimizer step with no MoE forward anywhere (a critic's, say): nothing to commit
        if self.model is None:
            self._start(
                config=config,
                layers=list(routes.layers) if routes else [],
                num_experts=shape[0] if shape else 0,
                topk=shape[1] if shape else 0,
            )
        assert self.model is not None and self.coords is not None and self.layout is not None  # set by _start
        with RankWriter(
            self.directory,
            model=self.model,
            coords=self.coords,
            layout=self.layout,
            world_size=self.world,
            background=False,
            append=True,
        ) as writer:
            if routes:
                seq_len, batch = self._geometry(shapes, routes)
                writer.add_routes(routes, step=step, seq_len=seq_len, batch=batch)
                for mb, fingerprints_B in enumerate(fingerprints or []):
                    writer.add_tokens(step=step, mb=mb, fingerprints_B=fingerprints_B)
        self._barrier()
        if self.coords.rank == 0:
            finalize(self.directory, world_size=self.world)
        self._barrier()

    def _geometry(self, shapes: dict[int, list], routes) -> tuple[list[int] | None, int | None]:
        """Global ``seq_len`` per micro-batch and per-rank ``batch`` from the router inputs' ``[s_local, b]``."""
        first = shapes.get(routes.layers[0], [])
        if len(first) != routes.microbatches or any(s is None for s in first):
            return None, None
        batches = {b for _, b in first}
        if len(batches) != 1:
            return None, None
        assert self.layout is not None  # set by _start
        scale = (self.layout.tp if self.layout.sp else 1) * self.layout.cp
        return [s * scale for s, _ in first], batches.pop()
