"""What each subcheck of each built-in check exists for: the class of bug, a public example, and the proof.

Declared once, here, and read by the result records (``CheckRecord``: every subcheck's entry carries
``"guards": CLASS``, and a record names the declared subchecks that did not run), the run's report and the
docs tables (``markdown_table``; ``tests/unit/test_bug_classes.py`` fails when a table, a check's subcheck
names or a mutant catalogue disagrees with this declaration). Torch-free: the CLI imports it.

``caught_by`` names what shows the subcheck catches its class, as ``KIND:NAME``:

- ``export:NAME``: a subject mutant (``moeverify/oracles/export/mutants.py``) that must fail the subcheck;
- ``receiver:NAME``: a receiver mutant (``moeverify/oracles/export/receiver_mutants.py``);
- ``replay:NAME``: a broken replay implementation (``moeverify/oracles/replay/faulty.py``);
- ``impl:NAME``: a replay implementation under test found failing it (a finding in a peer, README);
- ``finding:ID``: a finding of the README's findings table, reproduced by its test or scenario;
- ``test:PATH::NAME``: the test that injects the fault.
"""

from __future__ import annotations

import dataclasses

KINDS = ("export", "receiver", "replay", "impl", "finding", "test")


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class BugClass:
    """One subcheck of one check: the class of bug it exists for, a public example and what proves the catch."""

    check: str
    subcheck: str
    guards: str  # the class of bug, one sentence
    upstream: str  # a public example of the class, in our words, with its upstream thread
    caught_by: tuple[str, ...]  # KIND:NAME (module docstring)

    def __post_init__(self) -> None:
        self._validate()

    def _validate(self) -> None:
        where = f"bug class {self.check}.{self.subcheck}"
        if not self.guards.strip() or not self.upstream.strip() or not self.caught_by:
            raise ValueError(f"{where}: guards, upstream and caught_by must all be given")
        for item in self.caught_by:
            kind, sep, name = item.partition(":")
            if not sep or kind not in KINDS or not name:
                raise ValueError(f"{where}: caught_by entry {item!r} is not KIND:NAME with KIND in {KINDS}")


def _c(check: str, subcheck: str, guards: str, upstream: str, *caught_by: str) -> BugClass:
    return BugClass(check=check, subcheck=subcheck, guards=guards, upstream=upstream, caught_by=caught_by)


_EXPORT = (
    _c("export", "lockstep",
       "ranks disagree on what is streamed, or one rank dies mid-stream: a collective sync hangs or every later "
       "tensor shifts",
       "a rank-local parameter (MTP head, adapter) streamed by one rank only",
       "export:extra_row", "export:raises_mid_stream"),
    _c("export", "slot_tables",
       "a rank declares another full shape for a tensor than the others (computed from its local shard)",
       "sgl-project/sglang#26015: under EP > 1 the engine's shape assertion fires on the synced tensor after the "
       "first training step",
       "export:different_slot_table"),
    _c("export", "coverage",
       "elements never sent: the engine keeps stale values there",
       "verl 0.9.1 under ETP2 (this project, above); ROCm/ATOM#2028: routed-expert tensors matched no engine name "
       "and were skipped silently",
       "export:uncovered_element", "export:tied_embedding_dropped", "export:key_renamed", "export:expert_local_ids"),
    _c("export", "conflicts",
       "two writers for one element with different bits: the engine keeps whichever came last",
       "vllm-project/vllm#28715: GPT-OSS expert ranges placed wrongly under EP when loading",
       "export:expert_local_ids", "export:conflicting_write"),
    _c("export", "replicas",
       "copies that must be equal (DP, expert-DP, tied embedding and output layer) drifted, and only one is sent",
       "NVIDIA/Megatron-LM#656: the tied LM head and embedding came apart under PP with overlapped communication",
       "export:diverged_replica"),
    _c("export", "shape_dtype",
       "a tensor sent in another dtype or shape (the fp32 router bias as bf16)",
       "NVIDIA-NeMo/RL#3539: refit cast every tensor to the policy dtype, the fp32 `e_score_correction_bias` "
       "included",
       "export:bias_sent_as_bf16"),
    _c("export", "bitwise",
       "wrong values under the right name: a fused layout split wrongly, a lossy cast, a norm offset",
       "NVIDIA-NeMo/RL#2802: draft QKV fused by plain concatenation where Megatron interleaves per query group; "
       "vllm-project/vllm#50761: an fp32 correction bias stored in bf16",
       "export:qkv_concatenated", "export:gate_up_swapped", "export:fp32_through_bf16", "export:flipped_bit",
       "export:gdn_in_proj_flat", "export:zero_centered_norm_unshifted"),
    _c("export", "key_set",
       "names the engine does not know, or misses: it ignores them silently",
       "sgl-project/sglang#15890: with tied embeddings under PP the last stage skipped `embed_tokens`",
       "export:key_renamed", "export:extra_key", "export:tied_embedding_dropped"),
    _c("export", "reference_keys",
       "the reference exporter itself drops or reshapes checkpoint tensors, so nothing compares them",
       "Megatron-Bridge 0.6.2 GPT-OSS under EP2 with expert FFN width 1 (F10, README) and DeepSeek-V3's MTP copies "
       "(F8)",
       "finding:F10", "test:tests/unit/test_export_refresh.py::test_reference_keys_dropped_tensor_names_the_reference",
       "test:tests/unit/test_export_refresh.py::test_reference_keys_wrong_shape_names_the_reference"),
    _c("export", "refresh",
       "state kept between exports (converted tensors, slot tables, PP-collective data) sends the first step's "
       "weights forever",
       "vllm-project/vllm#57638 and sgl-project/sglang#31937: derived weight caches not rebuilt after an RL weight "
       "update (the same class on the engine's side)",
       "export:stale_conversion_cache", "export:stale_one_row", "export:stale_pp_broadcast"),
    _c("export", "receiver",
       "the engine loads the stream wrongly (fused halves swapped, a copy that never happens, a cast), or the "
       "subject's own error reaches the engine's buffers",
       "vllm-project/vllm#42803: MiMo-V2's fused `qkv_proj` load path chunked the fused tensor naively, so 7 of 8 "
       "TP ranks held query values in their key and value slots",
       "receiver:gate_up_swapped", "receiver:load_dropped", "export:gate_up_swapped"),
    _c("export", "receiver_reload",
       "a weight sync that reports success but leaves the engine's buffers holding the previous weights",
       "verl-project/verl#7224: a refit wrote into a stale tensor left bound by a copied loader method, so "
       "`weight_scale_inv` stayed all-zero after the sync while the load reported success",
       "receiver:reload_keeps_old", "export:stale_conversion_cache"),
)

_REPLAY = (
    _c("replay", "equivalence",
       "the replayed training pass is not the native pass on the recorded routes: routes of another micro-batch "
       "or token, replayed probabilities that carry no gradient to the router, or tied scores in another slot "
       "order than native top-k's (every forward bitwise, the gradients not)",
       "areal-project/AReaL#1207 (review): rollout routes split into micro-batches by `batch // n_microbatches`, "
       "which drops samples and pairs routing rows with other inputs",
       "replay:wrong_microbatch", "replay:detached_probs", "replay:ties_by_id"),
    _c("replay", "drift",
       "replay that is silently not applied, or applied to another layer, which only shows once the weights move "
       "away from the recording",
       "verl-project/verl#7106: under THD packing and VPP, ambiguous local-router indexing could replay a "
       "recorded route into the wrong local or virtual-pipeline layer",
       "replay:layer_shift", "replay:wrong_microbatch"),
    _c("replay", "recompute",
       "activation recompute re-runs the router natively instead of replaying the forward's routes",
       "NVIDIA-NeMo/Automodel#3156: under activation checkpointing the router is re-run in backward, and a "
       "near-tie token can flip experts between the forward and its recompute",
       "replay:no_recompute_replay"),
    _c("replay", "cross_layout",
       "routes recorded under one layout (the rollout engine's, one rank) land on other tokens when converted to "
       "the training layout's local view (TP/SP, CP, PP, EP)",
       "radixark/miles#3146: replay rows were laid out batch-first while Megatron's router flattens tokens "
       "sequence-first, so tokens replayed another token's experts even at TP = CP = 1",
       "replay:wrong_microbatch"),
    _c("replay", "native_parity",
       "an implementation's own copy of the routing path drifts from Megatron-Core's (a dropped padding mask, a "
       "missing score function, another layer's routes)",
       "NVIDIA/Megatron-LM#5841 (review): a graphed MoE path routed without the padding mask its eager twin "
       "passes, so z-loss and expert-bias counts diverge from eager",
       "replay:layer_shift", "replay:wrong_microbatch", "impl:verl"),
    _c("replay", "backward_order",
       "recomputes served routes in queue order, which is wrong when backward does not run in forward order "
       "(reverse-order or summed-loss backward)",
       "areal-project/AReaL#1166 (review): a global `replay_backward_list.pop(0)` hands recomputes the oldest "
       "forward's routes, which Megatron's schedules do not guarantee to match",
       "replay:fifo_recompute", "impl:native", "impl:verl"),
    _c("replay", "validation",
       "bad routes (short table, an expert twice in a row, ids out of range, another model's layers) routed "
       "silently instead of refused",
       "NVIDIA-NeMo/RL#3208 (review): padded rollout routes filled with zeros, so every padding token replays "
       "expert 0 in every top-k slot",
       "impl:native", "impl:verl"),
    _c("replay", "token_counts",
       "load-balancing state a replayed pass leaves behind (expert-bias token counts, aux-loss inputs) counts "
       "padding or wrong tokens, which no output or gradient of the pass shows",
       "NVIDIA/Megatron-LM#6114: the expert-bias count lined the padding mask up with the expert axis (a shape "
       "error when T != E, silently wrong counts when T == E)",
       "replay:counts_padding", "impl:native", "impl:verl"),
    _c("replay", "weights",
       "the right expert ids replayed with other weights or in another slot order than the recorded pass",
       "ISEEKYAN/Megatron-LM#79: replayed scores gathered from post-top-k, scatter-zeroed probabilities, so a "
       "replayed id that the current top-k did not pick reads weight 0",
       "replay:reversed_slots"),
)

_ROUNDTRIP = (
    _c("roundtrip", "bitwise",
       "a conversion HF -> Megatron -> HF that changes a weight's bits (a lossy offset, a rounding, a copy tied "
       "to another tensor)",
       "NVIDIA-NeMo/Megatron-Bridge#5364: Step-3.5-Flash's MTP output head differs from `lm_head` in the "
       "checkpoint, while Megatron ties them, so the round trip cannot give it back",
       "finding:F7", "test:tests/unit/test_zero_centered_norm_mapping.py::"
                     "test_gdn_output_norm_round_trips_only_from_one_half_up"),
    _c("roundtrip", "key_set",
       "checkpoint tensors the bridge never loads or never exports again, or names it invents",
       "NVIDIA-NeMo/Megatron-Bridge#4883: the tied-embedding export path matched one hard-coded HF name, so "
       "bridges with another prefix never re-emitted `lm_head.weight`",
       "finding:F8", "test:tests/unit/test_mtp_family.py::test_bridge_finding_mtp_embed_and_head_copies_are_not_mapped"),
)

_HF_PARITY = (
    _c("hf_parity", "layers",
       "the Megatron model computes something else than the HF model from the same weights (a weight transposed "
       "on import and back on export, a config translated into other semantics, a layer built wrong)",
       "NVIDIA-NeMo/Megatron-Bridge#2381: a converted NemotronH gives other logits than HF from identical weights, "
       "diverging in the Mamba layers",
       "finding:F3", "finding:F4",
       "test:tests/unit/test_hf_parity.py::test_hf_parity_names_the_layer_an_attention_fault_changes"),
    _c("hf_parity", "logits",
       "the converted model's output distribution differs from the HF model's",
       "NVIDIA-NeMo/Megatron-Bridge#2381: a converted NemotronH gives other logits than HF from identical weights",
       "finding:F3", "finding:F4"),
)

CLASSES: tuple[BugClass, ...] = _EXPORT + _REPLAY + _ROUNDTRIP + _HF_PARITY
_BY_KEY = {(c.check, c.subcheck): c for c in CLASSES}
if len(_BY_KEY) != len(CLASSES):
    raise ValueError("bug classes: a (check, subcheck) is declared twice")


def lookup(check: str, subcheck: str) -> BugClass | None:
    """The declared class of ``check``'s subcheck ``subcheck``; None for a check this module does not know."""
    return _BY_KEY.get((check, subcheck))


def guards(check: str, subcheck: str) -> str | None:
    """The one-sentence class of bug ``check``'s ``subcheck`` exists for, or None."""
    found = lookup(check, subcheck)
    return None if found is None else found.guards


def subchecks(check: str) -> tuple[str, ...]:
    """Every subcheck declared for ``check``, in declaration order."""
    return tuple(c.subcheck for c in CLASSES if c.check == check)


def _caught(item: str, *, mixed: bool) -> str:
    kind, _, name = item.partition(":")
    if kind == "export" and mixed:  # beside receiver mutants of the same names
        return f"`{name}` (subject mutant)"
    if kind == "receiver":
        return f"`{name}` (receiver mutant)"
    if kind == "impl":
        return f"`{name}` (peer implementation, a finding)"
    if kind == "finding":
        return f"finding {name}"
    return f"`{name}`"


def markdown_table(check: str) -> str:
    """The docs table for ``check``: subcheck, class of bug, upstream example, mutant (each line ends in a newline)."""
    lines = ["| subcheck | class of bug | upstream example | mutant |", "|---|---|---|---|"]
    for c in CLASSES:
        if c.check == check:
            mixed = any(item.startswith("receiver:") for item in c.caught_by)
            caught = ", ".join(_caught(item, mixed=mixed) for item in c.caught_by)
            lines.append(f"| `{c.subcheck}` | {c.guards} | {c.upstream} | {caught} |")
    return "\n".join(lines) + "\n"


def with_table(text: str, check: str) -> str:
    """``text`` (a docs page) with the block between its ``bug-classes:CHECK`` markers rendered anew."""
    begin, end = f"<!-- bug-classes:{check}:begin -->\n", f"<!-- bug-classes:{check}:end -->"
    if text.count(begin) != 1 or text.count(end) != 1 or text.index(begin) > text.index(end):
        raise ValueError(f"the page lacks one {begin.strip()} ... {end} block")
    head, rest = text.split(begin)
    return head + begin + markdown_table(check) + end + rest.split(end, 1)[1]


__all__ = ["BugClass", "CLASSES", "KINDS", "guards", "lookup", "markdown_table", "subchecks", "with_table"]
