"""verl 0.9.1's Megatron delta export as an export subject (the peer for ``docs/export.md``).

verl's ``verl.workers.engine.megatron.delta_export`` builds, per conversion task, a communication-free
*probe* of the bridge's ``megatron_to_hf`` (NaN sentinels in a local-shard buffer) and ships the
surviving HF positions and values of each rank's shard. This adapter feeds every rank's full local
parameter through that probe (a "delta" of every element) and yields the result as ``ShardRow``
records, so the oracle checks what verl would send.

Loading (docs/export.md, "Subjects"): ``verl/__init__.py`` imports ray and tensordict, and
``verl/workers/engine/__init__.py`` the FSDP engine; neither is needed. The two module files are
loaded directly, with their parent packages registered as empty namespace modules, so no package
``__init__`` ever runs. Where verl is absent the factory raises ``SubjectError`` saying so.

Which copies contribute mirrors verl's own routing: under PP all ranks merge over WORLD with verl's
``ShardSpec.contributes``; otherwise a sharded parameter contributes from the ranks of global rank 0's
gather group and a replicated one from rank 0 only (the others are replicas, checked as such).
"""

from __future__ import annotations

import importlib.util
import sys
import types
from pathlib import Path

import torch
import torch.distributed as dist

from moeverify.errors import SubjectError
from moeverify.subjects.slots import ShardRow, Slot

_MODULES = ("verl.workers.engine.spec", "verl.workers.engine.megatron.delta_export")


def load_delta_export():
    """verl's ``delta_export`` module, loaded without running any verl package ``__init__``."""
    if _MODULES[1] in sys.modules:
        return sys.modules[_MODULES[1]]
    spec = importlib.util.find_spec("verl")
    if spec is None or not spec.submodule_search_locations:
        raise SubjectError("subject 'verl': verl is not installed (pip install --no-deps verl==0.9.1)")
    root = Path(list(spec.submodule_search_locations)[0])
    for pkg in ("verl", "verl.workers", "verl.workers.engine", "verl.workers.engine.megatron"):
        if pkg not in sys.modules:
            module = types.ModuleType(pkg)
            module.__path__ = [str(root.joinpath(*pkg.split(".")[1:]))]  # namespace: no __init__ runs
            sys.modules[pkg] = module
    for name in _MODULES:
        path = root.joinpath(*name.split(".")[1:]).with_suffix(".py")
        mod_spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(mod_spec)
        sys.modules[name] = module
        mod_spec.loader.exec_module(module)
    return sys.modules[_MODULES[1]]


def verl(ctx):
    """The ``verl`` subject factory."""
    delta = load_delta_export()
    from megatron.core import parallel_state as ps  # lazy: megatron

    pp = ps.get_pipeline_model_parallel_world_size()
    index = delta.build_export_index(ctx.bridge, ctx.model_chunks, slot_cache={})
    rows = []
    for rec in index:
        contributes = _contributes(rec, pp=pp, rank=ctx.rank, dist=dist)
        rows.append((rec, contributes))
    return _rows(delta, rows)


def _contributes(rec, *, pp: int, rank: int, dist) -> bool:
    if rec.param is None:
        return True  # a stage that owns nothing yields zero counts
    if pp > 1:
        return bool(rec.spec.contributes)
    group = rec.spec.gather_group
    if group is None:
        return rank == 0
    return 0 in dist.get_process_group_ranks(group)


def _rows(delta, rows):
    # verl aligns rows by position (expert rows carry each EP rank's own global expert ids), so the
    # row is named by its position and the first name of its global slot table, identical on all ranks
    for k, (rec, contributes) in enumerate(rows):
        table = list(rec.slots)
        if rec.param is None:
            lidx = torch.empty(0, dtype=torch.int64)
            lval = torch.empty(0, dtype=torch.float32)
            slots, _, counts, hf_idx, hf_val = delta.mcore_hf_delta_entry(rec, 0, lidx, lval, {})
        else:
            param = rec.param.detach()
            lidx = torch.arange(param.numel(), dtype=torch.int64, device=param.device)
            slots, _, counts, hf_idx, hf_val = delta.mcore_hf_delta_entry(rec, 0, lidx, param.reshape(-1), {})
        out, start = [], 0
        for (name, shape), n in zip(slots, counts.tolist(), strict=True):
            out.append(
                Slot(
                    name, tuple(shape), hf_idx[start : start + n].to(torch.int64).cpu(), hf_val[start : start + n].cpu()
                )
            )
            start += n
        if [(s.hf_name, s.hf_shape) for s in out] != [(n, tuple(s)) for n, s in table]:
            raise SubjectError(f"verl row {rec.megatron_name!r}: probe slots differ from its global table")
        yield ShardRow(f"verl row {k}: {table[0][0] if table else '-'}", out, contributes)
