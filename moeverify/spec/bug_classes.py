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
    # sensitivity: the smallest injected difference shown caught, as "KIND:NAME: what it changes" (KIND:NAME one of
    # caught_by, so the same tests prove it), and the smallest difference the subcheck cannot see, with the reason
    minimal: str = ""
    blind_to: str = ""

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
        if self.minimal and self.minimal_item not in self.caught_by:
            raise ValueError(
                f"{where}: minimal {self.minimal!r} does not start with one of caught_by's KIND:NAME and ': '"
            )
        if bool(self.minimal.strip()) != bool(self.blind_to.strip()):
            raise ValueError(f"{where}: minimal and blind_to are given together")

    @property
    def minimal_item(self) -> str:
        """The KIND:NAME of the minimal mutant (``minimal`` up to its first ``": "``)."""
        return self.minimal.split(": ", 1)[0]

    @property
    def minimal_change(self) -> str:
        """What the minimal mutant changes (``minimal`` after its KIND:NAME)."""
        return self.minimal.split(": ", 1)[1] if ": " in self.minimal else ""


def _c(check: str, subcheck: str, guards: str, upstream: str, *caught_by: str) -> BugClass:
    return BugClass(check=check, subcheck=subcheck, guards=guards, upstream=upstream, caught_by=caught_by)


_EXPORT = (
    _c(
        "export",
        "lockstep",
        "ranks disagree on what is streamed, or one rank dies mid-stream: a collective sync hangs or every later "
        "tensor shifts",
        "a rank-local parameter (MTP head, adapter) streamed by one rank only",
        "export:extra_row",
        "export:raises_mid_stream",
    ),
    _c(
        "export",
        "slot_tables",
        "a rank declares another full shape for a tensor than the others (computed from its local shard)",
        "sgl-project/sglang#26015: under EP > 1 the engine's shape assertion fires on the synced tensor after the "
        "first training step",
        "export:different_slot_table",
    ),
    _c(
        "export",
        "coverage",
        "elements never sent: the engine keeps stale values there",
        "verl 0.9.1 under ETP2 (this project, above); ROCm/ATOM#2028: routed-expert tensors matched no engine name "
        "and were skipped silently",
        "export:uncovered_element",
        "export:tied_embedding_dropped",
        "export:key_renamed",
        "export:expert_local_ids",
    ),
    _c(
        "export",
        "conflicts",
        "two writers for one element with different bits: the engine keeps whichever came last",
        "vllm-project/vllm#28715: GPT-OSS expert ranges placed wrongly under EP when loading",
        "export:expert_local_ids",
        "export:conflicting_write",
    ),
    _c(
        "export",
        "replicas",
        "copies that must be equal (DP, expert-DP, tied embedding and output layer) drifted, and only one is sent",
        "NVIDIA/Megatron-LM#656: the tied LM head and embedding came apart under PP with overlapped communication",
        "export:diverged_replica",
    ),
    _c(
        "export",
        "shape_dtype",
        "a tensor sent in another dtype or shape (the fp32 router bias as bf16)",
        "NVIDIA-NeMo/RL#3539: refit cast every tensor to the policy dtype, the fp32 `e_score_correction_bias` included",
        "export:bias_sent_as_bf16",
        "export:one_shard_widened",
    ),
    _c(
        "export",
        "bitwise",
        "wrong values under the right name: a fused layout split wrongly, a lossy cast, a norm offset",
        "NVIDIA-NeMo/RL#2802: draft QKV fused by plain concatenation where Megatron interleaves per query group; "
        "vllm-project/vllm#50761: an fp32 correction bias stored in bf16",
        "export:qkv_concatenated",
        "export:gate_up_swapped",
        "export:fp32_through_bf16",
        "export:flipped_bit",
        "export:gdn_in_proj_flat",
        "export:zero_centered_norm_unshifted",
    ),
    _c(
        "export",
        "key_set",
        "names the engine does not know, or misses: it ignores them silently",
        "sgl-project/sglang#15890: with tied embeddings under PP the last stage skipped `embed_tokens`",
        "export:key_renamed",
        "export:extra_key",
        "export:tied_embedding_dropped",
    ),
    _c(
        "export",
        "reference_keys",
        "the reference exporter itself drops or reshapes checkpoint tensors, so nothing compares them",
        "Megatron-Bridge 0.6.2 GPT-OSS under EP2 with expert FFN width 1 (F10, README) and DeepSeek-V3's MTP copies "
        "(F8)",
        "finding:F10",
        "test:tests/unit/test_export_refresh.py::test_reference_keys_dropped_tensor_names_the_reference",
        "test:tests/unit/test_export_refresh.py::test_reference_keys_wrong_shape_names_the_reference",
    ),
    _c(
        "export",
        "model_intact",
        "an exporter that converts the live parameter instead of its copy (a norm offset, a scale, a cast in place): "
        "the model trains on from the changed weights, and the reference, read after it, agrees with the export",
        "this project's doc-driven exporter probe: a subject that adds a norm offset to the live parameter in place "
        "passed every other subcheck",
        "export:writes_model",
    ),
    _c(
        "export",
        "refresh",
        "state kept between exports (converted tensors, slot tables, PP-collective data) sends the first step's "
        "weights forever",
        "vllm-project/vllm#57638 and sgl-project/sglang#31937: derived weight caches not rebuilt after an RL weight "
        "update (the same class on the engine's side)",
        "export:stale_conversion_cache",
        "export:stale_one_row",
        "export:stale_pp_broadcast",
        "export:stale_one_element",
    ),
    _c(
        "export",
        "receiver",
        "the engine loads the stream wrongly (fused halves swapped, a copy that never happens, a cast), or the "
        "subject's own error reaches the engine's buffers",
        "vllm-project/vllm#42803: MiMo-V2's fused `qkv_proj` load path chunked the fused tensor naively, so 7 of 8 "
        "TP ranks held query values in their key and value slots",
        "receiver:gate_up_swapped",
        "receiver:load_dropped",
        "export:gate_up_swapped",
        "receiver:one_ulp_in_one_expert",
    ),
    _c(
        "export",
        "receiver_reload",
        "a weight sync that reports success but leaves the engine's buffers holding the previous weights",
        "verl-project/verl#7224: a refit wrote into a stale tensor left bound by a copied loader method, so "
        "`weight_scale_inv` stayed all-zero after the sync while the load reported success",
        "receiver:reload_keeps_old",
        "export:stale_conversion_cache",
        "receiver:reload_keeps_one_element",
    ),
    # the weight-sync classes of 2026 (issue #37): the live post-step model, every engine rank, repeated loads,
    # sleep/wake, tied heads and MTP drafts
    _c(
        "export",
        "refresh_delta",
        "an export that is not the live post-step model: the frozen base shipped (LoRA), a copy read before the "
        "optimizer step or before pending parameter all-gathers finished, or a buffer reused before every rank read "
        "it; the second export must differ from the first exactly where the weights changed, to the new bits",
        "verl-project/verl#7495: a LoRA sync pushed the bit-identical initial model on every update; "
        "NVIDIA-NeMo/RL#4086: refit paths read Megatron parameters with deferred all-gathers still pending "
        "(`overlap_param_gather`), so the engine got stale weights",
        "export:lora_frozen_base",
        "export:read_before_gathers",
        "export:read_before_step",
        "export:bucket_reused_early",
        "export:stale_one_element",
        "test:tests/unit/test_export_refresh.py::test_refresh_delta_names_a_change_where_the_built_in_update_held_the_weights",
    ),
    _c(
        "export",
        "receiver_ranks",
        "an engine rank other than the first loads the sync wrongly or not at all (only the driver worker updated, "
        "a rank reading a buffer already overwritten), unseen when only one rank's receiver is checked",
        "sgl-project/sglang#6626: TP workers other than TP 0 were not held while TP 0 updated, so TP 1 loaded "
        "`lm_head` from a gather buffer already overwritten with the next tensor",
        "receiver:sync_rank0_only",
        "receiver:one_rank_one_element_stale",
    ),
    _c(
        "export",
        "receiver_repeat",
        "a loader that is not idempotent: loading the same export again (a repeated or retried update) changes what "
        "the engine holds, e.g. a layout shuffle re-applied to weights already shuffled, or a repeat answered from "
        "state captured at the first repeat (right once, wrong after a sync)",
        "sgl-project/sglang#28963: ROCm's aiter FP8 path pre-shuffled weights after every load, so each RL reload "
        "shuffled already-shuffled weights again",
        "receiver:shuffle_every_load",
        "receiver:repeat_cache_taken_once",
        "receiver:repeat_nudges_one_element",
    ),
    _c(
        "export",
        "receiver_wake",
        "a sleep/wake cycle of the engine that does not give back what it held: an old backup restored over freshly "
        "synced weights, or a backup taken at the first sleep only (right once, wrong from the second cycle on)",
        "vllm-project/vllm#48310 (RFC): sleep/wake correctness for RL, collecting engine state lost or restored "
        "stale across a sleep/wake cycle in downstream RL frameworks; verl #7904: the second wake restores the "
        "first sync's weights",
        "receiver:wake_restores_old_backup",
        "receiver:wake_backup_taken_once",
        "receiver:wake_restores_one_element",
    ),
    _c(
        "export",
        "receiver_copies",
        "engine-side copies of synced weights left stale: a tied `lm_head` copied from the embedding once, MTP / "
        "draft layers the sync never reaches (and a receiver that holds neither, so nothing would show it)",
        "PrimeIntellect-ai/prime-rl#2823 (review): a receiver cloned `embed_tokens` into its own `lm_head`, and "
        "updates of the embedding left the head stale; sgl-project/sglang#27718: the NCCL update path never "
        "updated the EAGLE/MTP draft model",
        "receiver:tied_head_stale",
        "receiver:mtp_not_synced",
        "receiver:tied_head_one_element_stale",
    ),
)

_REPLAY = (
    _c(
        "replay",
        "equivalence",
        "the replayed training pass is not the native pass on the recorded routes: routes of another micro-batch "
        "or token, replayed probabilities that carry no gradient to the router, or tied scores in another slot "
        "order than native top-k's (every forward bitwise, the gradients not)",
        "areal-project/AReaL#1207 (review): rollout routes split into micro-batches by `batch // n_microbatches`, "
        "which drops samples and pairs routing rows with other inputs",
        "replay:wrong_microbatch",
        "replay:detached_probs",
        "replay:ties_by_id",
        "replay:one_ulp_one_prob",
        "replay:one_token_one_layer_route",
    ),
    _c(
        "replay",
        "drift",
        "replay that is silently not applied, or applied to another layer, which only shows once the weights move "
        "away from the recording",
        "verl-project/verl#7106: under THD packing and VPP, ambiguous local-router indexing could replay a "
        "recorded route into the wrong local or virtual-pipeline layer",
        "replay:layer_shift",
        "replay:wrong_microbatch",
        "replay:one_token_one_layer_route",
    ),
    _c(
        "replay",
        "recompute",
        "activation recompute re-runs the router natively instead of replaying the forward's routes",
        "NVIDIA-NeMo/Automodel#3156: under activation checkpointing the router is re-run in backward, and a "
        "near-tie token can flip experts between the forward and its recompute",
        "replay:no_recompute_replay",
        "replay:one_layer_no_recompute_replay",
    ),
    _c(
        "replay",
        "cross_layout",
        "routes recorded under one layout (the rollout engine's, one rank) land on other tokens when converted to "
        "the training layout's local view (TP/SP, CP, PP, EP)",
        "radixark/miles#3146: replay rows were laid out batch-first while Megatron's router flattens tokens "
        "sequence-first, so tokens replayed another token's experts even at TP = CP = 1",
        "replay:wrong_microbatch",
        "replay:one_token_one_layer_route",
    ),
    _c(
        "replay",
        "native_parity",
        "an implementation's own copy of the routing path drifts from Megatron-Core's (a dropped padding mask, a "
        "missing score function, another layer's routes)",
        "NVIDIA/Megatron-LM#5841 (review): a graphed MoE path routed without the padding mask its eager twin "
        "passes, so z-loss and expert-bias counts diverge from eager",
        "replay:layer_shift",
        "replay:wrong_microbatch",
        "impl:verl",
        "replay:one_ulp_one_prob",
        "replay:one_token_one_layer_route",
    ),
    _c(
        "replay",
        "backward_order",
        "recomputes served routes in queue order, which is wrong when backward does not run in forward order "
        "(reverse-order or summed-loss backward)",
        "areal-project/AReaL#1166 (review): a global `replay_backward_list.pop(0)` hands recomputes the oldest "
        "forward's routes, which Megatron's schedules do not guarantee to match",
        "replay:fifo_recompute",
        "impl:native",
        "impl:verl",
        "replay:one_layer_fifo_recompute",
    ),
    _c(
        "replay",
        "validation",
        "bad routes (short table, an expert twice in a row, ids out of range, another model's layers) routed "
        "silently instead of refused",
        "NVIDIA-NeMo/RL#3208 (review): padded rollout routes filled with zeros, so every padding token replays "
        "expert 0 in every top-k slot",
        "impl:native",
        "impl:verl",
    ),
    _c(
        "replay",
        "token_counts",
        "load-balancing state a replayed pass leaves behind (expert-bias token counts, aux-loss inputs) counts "
        "padding or wrong tokens, which no output or gradient of the pass shows",
        "NVIDIA/Megatron-LM#6114: the expert-bias count lined the padding mask up with the expert axis (a shape "
        "error when T != E, silently wrong counts when T == E)",
        "replay:counts_padding",
        "impl:native",
        "impl:verl",
        "replay:one_count_extra",
    ),
    _c(
        "replay",
        "weights",
        "the right expert ids replayed with other weights or in another slot order than the recorded pass, or, "
        "with the router moved, combine weights that are not the router's scoring function at the replayed ids "
        "(read from its post-top-k probabilities, where a replayed expert it no longer picks weighs 0)",
        "ISEEKYAN/Megatron-LM#79: replayed scores gathered from post-top-k, scatter-zeroed probabilities, so a "
        "replayed id that the current top-k did not pick reads weight 0",
        "replay:reversed_slots",
        "replay:masked_probs",
        "replay:one_masked_weight",
        "replay:one_ulp_one_prob",
        "replay:one_token_one_layer_route",
    ),
)

_ROUNDTRIP = (
    _c(
        "roundtrip",
        "bitwise",
        "a conversion HF -> Megatron -> HF that changes a weight's bits (a lossy offset, a rounding, a copy tied "
        "to another tensor)",
        "NVIDIA-NeMo/Megatron-Bridge#5364: Step-3.5-Flash's MTP output head differs from `lm_head` in the "
        "checkpoint, while Megatron ties them, so the round trip cannot give it back",
        "finding:F7",
        "finding:F4",
        "test:tests/unit/test_zero_centered_norm_mapping.py::test_gdn_output_norm_round_trips_only_from_one_half_up",
        "test:tests/unit/test_roundtrip_sensitivity.py::test_roundtrip_bitwise_sees_one_ulp_in_one_element",
    ),
    _c(
        "roundtrip",
        "key_set",
        "checkpoint tensors the bridge never loads or never exports again, or names it invents",
        "NVIDIA-NeMo/Megatron-Bridge#4883: the tied-embedding export path matched one hard-coded HF name, so "
        "bridges with another prefix never re-emitted `lm_head.weight`",
        "finding:F8",
        "test:tests/unit/test_mtp_family.py::test_bridge_finding_mtp_embed_and_head_copies_are_not_mapped",
        "test:tests/unit/test_roundtrip_sensitivity.py::test_roundtrip_key_set_sees_one_tensor_never_exported",
    ),
)

_HF_PARITY = (
    _c(
        "hf_parity",
        "layers",
        "the Megatron model computes something else than the HF model from the same weights (a weight transposed "
        "on import and back on export, a config translated into other semantics, a layer built wrong)",
        "NVIDIA-NeMo/Megatron-Bridge#2381: a converted NemotronH gives other logits than HF from identical weights, "
        "diverging in the Mamba layers",
        "finding:F3",
        "finding:F4",
        "test:tests/unit/test_hf_parity.py::test_hf_parity_names_the_layer_an_attention_fault_changes",
    ),
    _c(
        "hf_parity",
        "logits",
        "the converted model's output distribution differs from the HF model's",
        "NVIDIA-NeMo/Megatron-Bridge#2381: a converted NemotronH gives other logits than HF from identical weights",
        "finding:F3",
        "finding:F4",
        "test:tests/unit/test_hf_parity.py::test_hf_parity_names_the_layer_an_attention_fault_changes",
    ),
)

# Sensitivity per subcheck: (check, subcheck) -> (minimal, blind_to) (``BugClass.minimal``/``blind_to``). The minimal
# mutant is the smallest unit of its subcheck (one element, one ulp, one token, one expert, one layer, one rank, one
# step stale) that the catalogue tests run and see caught; ``blind_to`` is the smallest difference it cannot see.
_ULP = "one ulp (the lowest bit)"
_SENSITIVITY: dict[tuple[str, str], tuple[str, str]] = {
    ("export", "lockstep"): (
        "export:extra_row: one rank (the last) streams one row more than the others",
        "rows alike in number and names on every rank: lockstep compares no slot tables and no values (one ulp is "
        "bitwise's)",
    ),
    ("export", "slot_tables"): (
        "export:different_slot_table: one rank declares one tensor's first dimension one larger",
        "a wrong table every rank agrees on (shape_dtype, coverage and key_set see it); no values compared",
    ),
    ("export", "coverage"): (
        "export:uncovered_element: one element (the last of rank 0's first written piece) never sent",
        "an element sent with wrong bits counts as covered: coverage sees whether an element is written, not its "
        "value (one ulp is bitwise's)",
    ),
    ("export", "conflicts"): (
        f"export:conflicting_write: one element written twice (by two ranks, or twice by one), {_ULP} apart",
        "two writes with identical bits (harmless), or one writer with wrong bits (bitwise's)",
    ),
    ("export", "replicas"): (
        f"export:diverged_replica: one element of one rank's replica {_ULP} off, the sent copy right",
        "drift in a copy its rank does not yield (a rank that yields the sent copy's bits as its replica): "
        "replicas compares the copies the subject streams",
    ),
    ("export", "shape_dtype"): (
        "export:one_shard_widened: one rank's piece of one tensor sent as fp32 instead of bf16 (fp32 as fp64), "
        "every value exact",
        "a lossy cast back to the reference dtype (fp32 -> bf16 -> fp32, `fp32_through_bf16`): shape and dtype "
        "right, values not compared (bitwise's)",
    ),
    ("export", "bitwise"): (
        f"export:flipped_bit: {_ULP} of one element of one tensor, on every rank that holds it",
        "an error the reference shares: the reference is Megatron-Bridge's own export, so a value the bridge gets "
        "wrong under the right name and shape passes (F4: GPT-OSS's square gate_up_proj comes back transposed; "
        "roundtrip bitwise and hf_parity fail there)",
    ),
    ("export", "key_set"): (
        "export:key_renamed: one tensor's name misspelt (`model.norm.weight` as `model.final_norm.weight`)",
        "a right name carrying another same-shaped tensor's values: names only (bitwise's)",
    ),
    ("export", "model_intact"): (
        "export:writes_model: the lowest bit of one element of one parameter (the last rank's first) flipped in place "
        "during the export",
        "a write the subject undoes before its stream ends (the model is fingerprinted before and after, not during), "
        "and state outside the model chunks' parameters and buffers (an optimizer's, a receiver's)",
    ),
    ("export", "reference_keys"): (
        "test:tests/unit/test_export_refresh.py::test_reference_keys_dropped_tensor_names_the_reference: the "
        "reference drops one tensor (`norm`, 4 elements)",
        "a reference tensor with the checkpoint's name and shape but other values (F4's transposed gate_up_proj): "
        "names and shapes against the source checkpoint only (roundtrip bitwise compares the values)",
    ),
    ("export", "refresh"): (
        "export:stale_one_element: one element (the first rank 0 sends) one step stale, every other fresh",
        "staleness that starts after the second export (a cache refreshed once, or every other step), and state "
        "the update does not touch (buffers other than the expert bias, integer tensors): one update, two exports; "
        "the update moves every float element by at least one bf16 ulp, except one in 16 of a tensor of 64 or more "
        "(held for refresh_delta): a stale copy of a held element is the same bits",
    ),
    ("export", "receiver"): (
        f"receiver:one_ulp_in_one_expert: {_ULP} in one element of one expert's down_proj (one layer) as held",
        "what a real engine does after loading (kernel repacking, quantisation, post-load hooks): the receivers "
        "model the loader's layout, compared bit for bit",
    ),
    ("export", "receiver_reload"): (
        "receiver:reload_keeps_one_element: a weight sync that leaves one element of one expert's down_proj at the "
        "previous step's value",
        "a sync that goes wrong only from the second sync on: one sync after the first load is compared here",
    ),
    ("export", "refresh_delta"): (
        "export:stale_one_element: one element (the first rank 0 sends) keeps the first export's bits where the "
        "weights changed",
        "tensors the first export already sent wrong anywhere (left to its own subchecks); a change where the "
        "weights did not change is seen at the elements the built-in update holds (one in 16 of a tensor of 64 or "
        "more) and nowhere else (one update, two exports)",
    ),
    ("export", "receiver_ranks"): (
        "receiver:one_rank_one_element_stale: one rank (rank 1 of 2) keeps one element of one expert's down_proj at "
        "the previous weights after a sync, rank 0 right",
        "a fault every rank shares with rank 0 (that is `receiver`'s and the others'), and engine ranks beyond the "
        "trainer's: one receiver per trainer rank, each loading the whole stream",
    ),
    ("export", "receiver_repeat"): (
        "receiver:repeat_nudges_one_element: loading bits it already holds moves one element of one expert's "
        f"down_proj {_ULP}",
        "a loader that breaks only from a third repeat or a second sync on (a counter, a cache filled at the second "
        "repeat): each load, the first and the sync, is repeated once and judged against itself, no more",
    ),
    ("export", "receiver_wake"): (
        "receiver:wake_restores_one_element: one sleep/wake cycle after one sync gives one element of one expert's "
        "down_proj back from the first load",
        "a receiver without sleep()/wake_up() (not applicable, said so); a cycle that goes wrong only from the "
        "third cycle on (one cycle after the first load and one after the sync); state a cycle loses outside the "
        "tensors the receiver returns (a KV cache, a copy held under no name)",
    ),
    ("export", "receiver_copies"): (
        "receiver:tied_head_one_element_stale: one element of the receiver's own lm_head (a copy of the tied "
        "embedding) one step stale",
        "a copy the receiver does not declare as a part (a tied model's head must be declared, another hidden copy "
        "is invisible) and draft tensors the reference does not export (F8's MTP embedding and head copies)",
    ),
    ("replay", "equivalence"): (
        f"replay:one_ulp_one_prob: {_ULP} in one routing weight (token 0's first slot, first MoE layer, "
        "micro-batch 0), the ids right",
        "a fault in load-balancing state alone (token counts, which no output or gradient of the pass carries: "
        "token_counts'); outputs, routes, probabilities and gradients are compared bit for bit",
    ),
    ("replay", "drift"): (
        "replay:one_token_one_layer_route: one token of one layer (token 0, first MoE layer, micro-batch 0) "
        "replayed to another expert in its last slot",
        "a replay not applied to a token whose native route after the perturbation is still its recorded one (no "
        "way to tell them apart); routing weights (expert choice only: one ulp is equivalence's and weights')",
    ),
    ("replay", "recompute"): (
        "replay:one_layer_no_recompute_replay: one layer's recompute routes natively, the others replay",
        "a native recompute in a token whose drifted native route equals its recorded one (the same route either way)",
    ),
    ("replay", "cross_layout"): (
        "replay:one_token_one_layer_route: one token of one layer replayed to another expert",
        "a conversion that lands a row on another token with the same experts; loss differences within 1e-4 "
        "(atol + rtol): other layouts reduce in another order, so one ulp of a loss is not seen",
    ),
    ("replay", "native_parity"): (
        f"replay:one_ulp_one_prob: {_ULP} in one routing weight of one token of one layer",
        "what Megatron-Core's native RouterReplay itself does the same way (it is the reference: F12's no-grad "
        "slot order is noted, not failed)",
    ),
    ("replay", "backward_order"): (
        "replay:one_layer_fifo_recompute: one layer's recomputes served in queue order",
        "queue order while backward runs in forward order (then it is right: `fifo_recompute` passes recompute); "
        "only reverse-order and summed-loss backward tell the two apart",
    ),
    ("replay", "validation"): (
        "impl:verl: routes a table one row short (one token without a route) and one token with an expert twice "
        "in its row",
        "wrong routes of the right form (in range, no duplicates, right shape): validation checks form; drift, "
        "equivalence and cross_layout check which experts",
    ),
    ("replay", "token_counts"): (
        "replay:one_count_extra: one token counted twice, for one expert of one layer",
        "a count off by one above 256 in a bf16 build can round away: Megatron holds the counts in bf16 (F13) and "
        "they are compared as it holds them (bf16's step there is 2, 4 above 512)",
    ),
    ("replay", "weights"): (
        f"replay:one_ulp_one_prob: {_ULP} in one routing weight, the ids right (on the moved router: "
        "`one_masked_weight`, one replayed expert's weight read as 0 from the masked probabilities)",
        "another slot order whose sums come out the same bits: at top-2 a + b == b + a, so only top-k >= 3 can "
        "show a reversed order (`reversed_slots` runs on deepseek_v3_wide); on the moved router, a weight within "
        "2n fp32 epsilons and one rounding to the pass's dtype (relative) plus n fp32 epsilons (absolute) of the "
        "float64 reference, n the scores it is normalised over: implementations sum them in a slot order of their "
        "own there (bit for bit only on the unmoved router)",
    ),
    ("roundtrip", "bitwise"): (
        "test:tests/unit/test_roundtrip_sensitivity.py::test_roundtrip_bitwise_sees_one_ulp_in_one_element: "
        f"{_ULP} of one element of one exported tensor",
        "a model that computes otherwise from weights that round-trip (F3: another score function): weights only "
        "(hf_parity's)",
    ),
    ("roundtrip", "key_set"): (
        "test:tests/unit/test_roundtrip_sensitivity.py::test_roundtrip_key_set_sees_one_tensor_never_exported: "
        "one tensor (`model.norm.weight`) never exported",
        "a tensor the checkpoint does not hold either (F8's MTP copies, on a checkpoint without them): names of "
        "this checkpoint only",
    ),
    ("hf_parity", "layers"): (
        "test:tests/unit/test_hf_parity.py::test_hf_parity_names_the_layer_an_attention_fault_changes: the "
        "sliding window one key token short in the attention of the sliding-window layers (layer 0 named)",
        "differences below 1e-4 x max|HF| of a layer's output: transformers and Megatron compute in another op "
        "order (3e-7 .. 5e-7 relative apart when right), so nothing is compared bit for bit, and one ulp of a "
        "weight, which moves a layer's output far less, is not seen",
    ),
    ("hf_parity", "logits"): (
        "test:tests/unit/test_hf_parity.py::test_hf_parity_names_the_layer_an_attention_fault_changes: the "
        "sliding window one key token short in the attention of the sliding-window layers",
        "logit differences below 1e-4 x max|HF logit| (the op-order reason of `layers`): one ulp of a weight is "
        "not seen",
    ),
}


def _with_sensitivity(classes: tuple[BugClass, ...]) -> tuple[BugClass, ...]:
    return tuple(
        dataclasses.replace(
            c, minimal=_SENSITIVITY[c.check, c.subcheck][0], blind_to=_SENSITIVITY[c.check, c.subcheck][1]
        )
        if (c.check, c.subcheck) in _SENSITIVITY
        else c
        for c in classes
    )


CLASSES: tuple[BugClass, ...] = _with_sensitivity(_EXPORT + _REPLAY + _ROUNDTRIP + _HF_PARITY)
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
    """The docs table for ``check``: subcheck, class of bug, upstream example, mutant, the minimal mutant caught and
    the smallest difference not seen (each line ends in a newline)."""
    lines = [
        "| subcheck | class of bug | upstream example | mutant | minimal mutant caught | smallest difference "
        "not seen |",
        "|---|---|---|---|---|---|",
    ]
    for c in CLASSES:
        if c.check == check:
            mixed = any(item.startswith("receiver:") for item in c.caught_by)
            caught = ", ".join(_caught(item, mixed=mixed) for item in c.caught_by)
            minimal = f"{_caught(c.minimal_item, mixed=mixed)}: {c.minimal_change}" if c.minimal else ""
            lines.append(f"| `{c.subcheck}` | {c.guards} | {c.upstream} | {caught} | {minimal} | {c.blind_to} |")
    return "\n".join(lines) + "\n"


def with_table(text: str, check: str) -> str:
    """``text`` (a docs page) with the block between its ``bug-classes:CHECK`` markers rendered anew."""
    begin, end = f"<!-- bug-classes:{check}:begin -->\n", f"<!-- bug-classes:{check}:end -->"
    if text.count(begin) != 1 or text.count(end) != 1 or text.index(begin) > text.index(end):
        raise ValueError(f"the page lacks one {begin.strip()} ... {end} block")
    head, rest = text.split(begin)
    return head + begin + markdown_table(check) + end + rest.split(end, 1)[1]


__all__ = ["BugClass", "CLASSES", "KINDS", "guards", "lookup", "markdown_table", "subchecks", "with_table"]
