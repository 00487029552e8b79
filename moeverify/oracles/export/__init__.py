"""The export differential oracle (docs/export.md): a subject's per-tensor export vs Megatron-Bridge.

The public names subjects and users import are re-exported here (``from moeverify.oracles.export
import ShardRow``). Modules, one concept each:

- ``oracle``: ``run`` / ``run_export`` / ``run_subject`` on every rank: lockstep, per-row headers, pieces to rank 0;
- ``local``: a rank's own pieces compared with its own copy of the reference (verdicts, runs, digests);
- ``rows``: what a subject yields (``ShardRow``, ``Slot``, ``RangeSlot``, ``RunSlot``, ``DeferredSlots``; ``AnySlot``
  is any of the three slots; declared in ``moeverify.subjects.slots``) validated where it enters;
- ``wire``: the collectives (JSON gathers, chunked point-to-point pieces) on a dedicated gloo group;
- ``intervals``: which element ranges of a tensor are covered, and by whom;
- ``merge``: one HF tensor assembled from pieces and compared bit for bit (plain tensors);
- ``collect``: rank 0's open merges, reference tensors in hand and the final subchecks;
- ``feed``: the reference export in a background thread beside the collection, under a memory gate;
- ``refresh``: the ``refresh`` subcheck: a second export after an optimizer-like weight update;
- ``receiver``: the ``receiver`` subcheck: what an engine holds after loading the subject's stream, vs the
  reference (``receiver_transformers``, ``receiver_vllm``: a real vLLM process, ``receiver_mutants``);
- ``intact``: the ``model_intact`` subcheck: the model's parameters and buffers fingerprinted before and after the
  subject's stream;
- ``mutants``: injected export bugs, each shown to fail its named subchecks.
"""

from moeverify.models.checkpoint import checkpoint_shapes
from moeverify.oracles.export.collect import SUBCHECKS
from moeverify.oracles.export.oracle import SubjectContext, load_subject, run, run_export, run_subject
from moeverify.oracles.export.rows import AnySlot, DeferredSlots, RangeSlot, RunSlot, ShardRow, Slot

__all__ = [
    "ShardRow",
    "Slot",
    "RangeSlot",
    "RunSlot",
    "AnySlot",
    "DeferredSlots",
    "SubjectContext",
    "load_subject",
    "run",
    "run_export",
    "run_subject",
    "SUBCHECKS",
    "checkpoint_shapes",
]
