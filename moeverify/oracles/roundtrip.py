"""The ``roundtrip`` check: HF -> Megatron -> HF through the bridge, bitwise equal to the source checkpoint.

Subchecks: ``bitwise`` (every exported tensor equals the source tensor of the same name on raw bits, in
the source's dtype and shape) and ``key_set`` (exported names == checkpoint names; missing and extra
listed). ``export_hf_weights`` runs collectives inside, so every rank iterates it; rank 0 compares,
one tensor at a time, reading the source lazily.
"""

from __future__ import annotations

from moeverify.errors import few
from moeverify.models.checkpoint import open_tensors
from moeverify.oracles.bits import compare_bits
from moeverify.oracles.results import Tally
from moeverify.spec.checks import CHECKS

SUBCHECKS = CHECKS["roundtrip"].subchecks  # bitwise, key_set (moeverify.spec.checks)


def run(ctx) -> dict[str, Tally]:
    built = ctx.model()
    tallies = {name: Tally() for name in SUBCHECKS}
    source = open_tensors(built.hf_path) if ctx.rank == 0 else None
    names = set(source.names()) if source is not None else set()
    exported: list[str] = []
    try:
        for name, tensor in built.bridge.export_hf_weights(built.model_chunks, cpu=True, show_progress=False):
            exported.append(name)
            if source is None or name not in names:
                continue  # other ranks; a name not in the checkpoint is reported by key_set
            message = compare_bits(name, source.get_tensor(name), tensor)
            tallies["bitwise"].check(message is None, message or "")
    finally:
        if source is not None:
            source.close()
    if ctx.rank == 0:
        _key_set(tallies["key_set"], exported=exported, source=sorted(names))
    return tallies


def _key_set(t: Tally, *, exported: list[str], source: list[str]) -> None:
    dupes = sorted({n for n in exported if exported.count(n) > 1})
    t.check(not dupes, f"exported more than once: {few(dupes)}")
    missing, extra = sorted(set(source) - set(exported)), sorted(set(exported) - set(source))
    t.check(not missing, f"{len(missing)} checkpoint name(s) never exported: {few(missing)}")
    t.check(not extra, f"{len(extra)} exported name(s) not in the checkpoint: {few(extra)}")
    t.ok(len(set(source) & set(exported)))
