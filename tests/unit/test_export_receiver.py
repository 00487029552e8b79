"""The receiver subcheck's mapping and comparison on synthetic HF tensors; each receiver mutant is caught."""

import json

import pytest
import torch

from moeverify.errors import SHOW_NAMES, UsageError
from moeverify.oracles.export.receiver import (
    CopiesScope,
    FusedReceiver,
    Held,
    Part,
    compare,
    copies_scope,
    fused_layout,
    load_again,
    load_receiver,
    same_held,
    sleep_wake,
)
from moeverify.oracles.export.receiver_mutants import CONTROLS, MUTANTS
from moeverify.oracles.results import Tally
from moeverify.spec.models.configs import hf_config_dict

E, I, H = 3, 4, 6  # experts, expert intermediate, hidden


def _export(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)

    def r(*shape, dtype=torch.bfloat16):
        return torch.randn(shape, generator=g).to(dtype)

    out = {"model.embed_tokens.weight": r(10, H), "model.norm.weight": r(H, dtype=torch.float32)}
    pre = "model.layers.0"
    out |= {
        f"{pre}.self_attn.q_proj.weight": r(8, H),
        f"{pre}.self_attn.k_proj.weight": r(4, H),
        f"{pre}.self_attn.v_proj.weight": r(4, H),
        f"{pre}.mlp.gate.weight": r(E, H),
    }
    for e in range(E):
        out |= {
            f"{pre}.mlp.experts.{e}.gate_proj.weight": r(I, H),
            f"{pre}.mlp.experts.{e}.up_proj.weight": r(I, H),
            f"{pre}.mlp.experts.{e}.down_proj.weight": r(H, I),
        }
    out |= {f"{pre}.mlp.shared_expert.gate_proj.weight": r(I, H), f"{pre}.mlp.shared_expert.up_proj.weight": r(I, H)}
    return out


def test_fused_layout_names_and_shapes():
    ref = _export()
    held = FusedReceiver().load(ref.items())
    t = held.tensors
    assert tuple(t["model.layers.0.self_attn.qkv_proj.weight"].shape) == (16, H)
    assert tuple(t["model.layers.0.mlp.experts.w13_weight"].shape) == (E, 2 * I, H)
    assert tuple(t["model.layers.0.mlp.experts.w2_weight"].shape) == (E, H, I)
    assert tuple(t["model.layers.0.mlp.shared_expert.gate_up_proj.weight"].shape) == (2 * I, H)
    assert held.parts["model.layers.0.mlp.experts.w13_weight"][3] == Part(
        hf_name="model.layers.0.mlp.experts.1.up_proj.weight", index=1, start=I, length=I
    )
    assert torch.equal(
        t["model.layers.0.mlp.experts.w13_weight"][2, :I], ref["model.layers.0.mlp.experts.2.gate_proj.weight"]
    )
    assert t["model.norm.weight"].dtype == torch.float32


def test_control_passes_and_reloads_into_same_buffers():
    first, second = _export(0), _export(1)
    receiver = CONTROLS["fused"]()
    tally = compare(receiver.load(first.items()), first, Tally())
    assert tally.passed and tally.checked == len(first)
    before = receiver.tensors["model.layers.0.mlp.experts.w13_weight"]
    again = compare(receiver.load(second.items()), second, Tally())
    assert again.passed and receiver.tensors["model.layers.0.mlp.experts.w13_weight"] is before


@pytest.mark.parametrize("name", sorted(n for n, (_, s) in MUTANTS.items() if s in ("receiver", "receiver_reload")))
def test_each_mutant_caught_by_its_subcheck(name):
    factory, subcheck = MUTANTS[name]
    first, second = _export(0), _export(1)
    receiver = factory()
    tallies = {"receiver": compare(receiver.load(first.items()), first, Tally())}
    tallies["receiver_reload"] = compare(receiver.load(second.items()), second, Tally(), when="after the weight sync: ")
    assert not tallies[subcheck].passed, name
    if subcheck == "receiver_reload":  # a fault of the weight sync alone: the first load is clean
        assert tallies["receiver"].passed, tallies["receiver"].failures


def test_failure_names_tensor_part_and_first_element():
    ref = _export()
    held = FusedReceiver().load(ref.items())
    held.tensors["model.layers.0.mlp.experts.w13_weight"][1, I + 2, 3] += 1
    tally = compare(held, ref, Tally())
    assert tally.failures == [
        "model.layers.0.mlp.experts.w13_weight[1].narrow(dim=0, 4, 4) = model.layers.0.mlp.experts.1.up_proj.weight: "
        f"1 of {I * H} element(s) differ, first at [2, 3]: held "
        f"{held.tensors['model.layers.0.mlp.experts.w13_weight'][1, I + 2, 3].item()!r}, reference "
        f"{ref['model.layers.0.mlp.experts.1.up_proj.weight'][2, 3].item()!r}"
    ]


def test_dropped_extra_dtype_and_empty():
    ref = _export()
    held = FusedReceiver().load(ref.items())
    fewer = Held(
        tensors={k: v for k, v in held.tensors.items() if k != "model.norm.weight"},
        parts={k: v for k, v in held.parts.items() if k != "model.norm.weight"},
    )
    assert compare(fewer, ref, Tally()).failures == [
        "dropped: 1 reference tensor(s) that no declared part names: ['model.norm.weight'] "
        "(Held.parts must cover every reference tensor)"
    ]
    short = {k: v for k, v in ref.items() if k != "model.norm.weight"}
    assert compare(held, short, Tally()).failures == [
        "model.norm.weight(whole) = model.norm.weight: the reference has no tensor 'model.norm.weight'"
    ]
    cast = Held(tensors={"n": ref["model.norm.weight"].bfloat16()}, parts={"n": (Part(hf_name="model.norm.weight"),)})
    failures = compare(cast, {"model.norm.weight": ref["model.norm.weight"]}, Tally()).failures
    assert failures == [f"n(whole) = model.norm.weight: held ({H},) torch.bfloat16 != reference ({H},) torch.float32"]
    assert compare(Held(tensors={}, parts={}), {}, Tally()).failures == [
        "the receiver held no tensor: nothing compared"
    ]


def test_bad_receiver_input_is_a_usage_error():
    with pytest.raises(UsageError, match="weight sync sent 'new.weight', which the first load did not"):
        r = FusedReceiver()
        r.load([("a.weight", torch.zeros(2))])
        r.load([("new.weight", torch.zeros(2))])
    with pytest.raises(UsageError, match="stacks unequal experts"):
        fused_layout(
            {
                "x.experts.0.down_proj.weight": ((2, 3), torch.float32),
                "x.experts.1.down_proj.weight": ((2, 4), torch.float32),
            }
        )
    with pytest.raises(UsageError, match="receiver 'nope'"):
        load_receiver("nope")
    assert isinstance(load_receiver("fused")(), FusedReceiver)


def _tiny_hf(tmp_path, *, tied: bool):
    import safetensors.torch
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    cfg = Qwen3MoeConfig(
        vocab_size=32,
        hidden_size=16,
        intermediate_size=32,
        moe_intermediate_size=8,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        num_experts=4,
        num_experts_per_tok=2,
        tie_word_embeddings=tied,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).save_pretrained(tmp_path)
    return safetensors.torch.load_file(str(tmp_path / "model.safetensors"))


@pytest.mark.parametrize("tied", [False, True])
def test_transformers_receiver_round_trip(tmp_path, tied):
    from moeverify.oracles.export.receiver_transformers import transformers_receiver

    export = _tiny_hf(tmp_path, tied=tied)
    assert ("lm_head.weight" in export) is not tied
    held = transformers_receiver(hf_path=tmp_path).load(export.items())
    assert tuple(held.tensors["model.layers.0.mlp.experts.gate_up_proj"].shape) == (4, 16, 16)
    tally = compare(held, export, Tally())
    assert tally.passed and tally.checked >= len(export), tally.failures


def test_transformers_receiver_catches_a_cast(tmp_path):
    from moeverify.oracles.export.receiver_transformers import transformers_receiver

    export = _tiny_hf(tmp_path, tied=False)
    export["model.norm.weight"] = export["model.norm.weight"].float() + 2**-12  # bits bf16 cannot hold
    failures = compare(transformers_receiver(hf_path=tmp_path).load(export.items()), export, Tally()).failures
    assert failures == [
        "model.norm.weight(whole) = model.norm.weight: held (16,) torch.bfloat16 != reference (16,) torch.float32"
    ]


def test_receiver_option_validates():
    from moeverify.spec import options

    assert options.validate("s.yaml", "receiver", "transformers") == "transformers"
    assert options.validate("s.yaml", "receiver", "vllm") == "vllm"  # a real vLLM process (tests/engines)
    with pytest.raises(UsageError, match="option receiver: receiver 'sglang' is not fused, transformers, vllm, "):
        options.validate("s.yaml", "receiver", "sglang")


def test_a_receiver_that_cannot_load_is_refused_before_launch():
    from moeverify.runner.select import check_plugins
    from moeverify.spec.layout import Layout
    from moeverify.spec.scenario import Scenario

    s = Scenario(family="qwen3_moe", layout=Layout(ep=2), world_size=2, checks=("export",))
    check_plugins([s], {"receiver": "fused"})
    with pytest.raises(UsageError, match="receiver 'no_such_pkg.mod:factory': no module named 'no_such_pkg.mod'"):
        check_plugins([s], {"receiver": "no_such_pkg.mod:factory"})


# -- the life cycle on one rank: load, sync, sleep/wake, the same export again, tied head and MTP draft ------------
def _life_cycle(receiver, first, second, *, scope: CopiesScope) -> dict[str, Tally]:
    """The receiver subchecks of one rank, as ``ReceiverRun`` runs them with a weight sync (synthetic tensors)."""
    t = {
        name: Tally() for name in ("receiver", "receiver_reload", "receiver_wake", "receiver_repeat", "receiver_copies")
    }
    for export, name, after in ((first, "receiver", "the first load"), (second, "receiver_reload", "the weight sync")):
        sent = [(n, x.clone()) for n, x in export.items()]  # what was streamed: the receiver may write into it
        held = receiver.load(iter(sent))
        compare(held, export, t[name], copies=t["receiver_copies"], scope=scope)
        loaded = {n: x.clone() for n, x in held.tensors.items()}
        held = sleep_wake(receiver, held, loaded, t["receiver_wake"], after=after) or held
        load_again(receiver, held, sent, loaded, t["receiver_repeat"], after=after)
    return t


def _tied_mtp_export(seed: int) -> dict[str, torch.Tensor]:
    out = _export(seed)
    g = torch.Generator().manual_seed(seed + 100)
    out |= {
        "model.layers.1.enorm.weight": torch.randn(H, generator=g),
        "model.layers.1.eh_proj.weight": torch.randn(H, 2 * H, generator=g),
    }  # an MTP layer past the one decoder layer
    return out


SCOPE = CopiesScope(tied="model.embed_tokens.weight", mtp_layers=1, num_layers=1)
NEW = {n: s for n, (_, s) in MUTANTS.items() if s not in ("receiver", "receiver_reload")}


def _made(factory_or_name, **kw):
    factory = MUTANTS[factory_or_name][0] if isinstance(factory_or_name, str) else factory_or_name
    return factory(**{"hf_path": None, "rank": 0, "world_size": 1, **kw})


def test_life_cycle_control_passes_every_subcheck_with_a_tied_head_and_a_draft():
    t = _life_cycle(FusedReceiver(tied=SCOPE.tied), _tied_mtp_export(0), _tied_mtp_export(1), scope=SCOPE)
    assert all(x.passed for x in t.values()), {k: x.failures for k, x in t.items()}
    assert t["receiver_copies"].checked == 2 * 4  # embedding and head, two MTP tensors, after each load


def test_copies_refuses_a_receiver_that_declares_no_tied_head_or_no_draft():
    first = _tied_mtp_export(0)
    copies = Tally()
    held = FusedReceiver().load(first.items())  # no head of its own
    mtp = {k: v for k, v in first.items() if k.startswith("model.layers.1.")}
    held = Held(
        tensors={k: v for k, v in held.tensors.items() if k not in mtp},
        parts={k: v for k, v in held.parts.items() if k not in mtp},
    )
    compare(held, first, Tally(), copies=copies, scope=SCOPE)
    assert any("no output head" in f for f in copies.failures), copies.failures
    assert any("2 MTP (draft) tensor(s) the receiver does not hold" in f for f in copies.failures), copies.failures


@pytest.mark.parametrize("name", sorted(NEW))
def test_each_life_cycle_mutant_caught_by_its_subcheck(name, monkeypatch):
    subcheck = NEW[name]
    first, second = _tied_mtp_export(0), _tied_mtp_export(1)
    if subcheck == "receiver_ranks":  # on a rank other than 0: its receiver_reload is that rank's, in receiver_ranks
        t = _life_cycle(_made(name, rank=1), first, second, scope=SCOPE)
        assert not t["receiver_reload"].passed and t["receiver"].passed
        assert _life_cycle(_made(name, rank=0), first, second, scope=SCOPE)["receiver_reload"].passed
        return
    import moeverify.oracles.export.receiver_mutants as rm

    monkeypatch.setattr(rm, "copies_scope", lambda _path: SCOPE)
    t = _life_cycle(_made(name), first, second, scope=SCOPE)
    assert not t[subcheck].passed, (name, t[subcheck].failures)
    assert t["receiver"].passed, t["receiver"].failures  # right after the first load


@pytest.mark.parametrize("name", sorted(n for n, s in NEW.items() if s in ("receiver_wake", "receiver_repeat")))
def test_wake_and_repeat_faults_are_told_apart(name):
    """A sleep/wake cycle that restores old bits fails receiver_wake alone (the repeated load that puts the right
    bits back is not blamed), a loader that is not idempotent fails receiver_repeat alone."""
    t = _life_cycle(_made(name), _tied_mtp_export(0), _tied_mtp_export(1), scope=SCOPE)
    other = "receiver_repeat" if NEW[name] == "receiver_wake" else "receiver_wake"
    assert not t[NEW[name]].passed and t[other].passed, (name, t[other].failures)


class _WakeOldNormSkipsUnchanged(FusedReceiver):
    """wake_up restores ``model.norm.weight`` from the first load, and a load skips the tensors whose bits it was sent
    last time (a loader that trusts its buffers): the repeated load leaves the cycle's stale norm in place."""

    def load(self, stream):
        sent = getattr(self, "_sent", {})
        fresh = [(n, x) for n, x in stream if n not in sent or not torch.equal(sent[n], x)]
        self._sent = {**sent, **{n: x.clone() for n, x in fresh}}
        held = super().load(iter(fresh)) if fresh or not self.tensors else Held(tensors=self.tensors, parts=self.parts)
        if getattr(self, "_old", None) is None:
            self._old = self.tensors["model.norm.weight"].clone()
        return held

    def wake_up(self) -> Held:
        held = super().wake_up()
        self.tensors["model.norm.weight"].copy_(self._old)
        return held


def test_repeat_does_not_judge_what_the_wake_broke_and_the_repeat_left():
    t = _life_cycle(_WakeOldNormSkipsUnchanged(), _export(0), _export(1), scope=CopiesScope(None, 0, 1))
    assert (
        t["receiver_wake"]
        .failures[0]
        .startswith("after sleep/wake following the weight sync: model.norm.weight(whole) = model.norm.weight: ")
    ), t["receiver_wake"].failures
    assert t["receiver_repeat"].passed, t["receiver_repeat"].failures
    engine_tensors = len(FusedReceiver().load(_export(0).items()).tensors)
    # every engine tensor after the first load; after the sync every one but the norm the cycle broke
    assert t["receiver_repeat"].checked == 2 * engine_tensors - 1


def test_undeclared_held_tensors_are_named_not_called_never_loaded():
    ref = _export()
    tensors = {n: x.clone() for n, x in ref.items()}
    held = Held(tensors=tensors, parts={"model.norm.weight": (Part(hf_name="model.norm.weight"),)})
    failures = compare(held, ref, Tally()).failures
    n = len(ref) - 1
    assert len(failures) == 1 and failures[0].startswith(
        f"dropped: {n} reference tensor(s) that no declared part names: ['model.embed_tokens.weight', "
    ), failures
    assert "never loaded" not in failures[0]
    bare = sorted(n for n in tensors if n != "model.norm.weight")  # the first SHOW_NAMES quoted, then a count
    assert failures[0].endswith(
        f"(the receiver holds {n} tensor(s) with no parts, e.g. {bare[:SHOW_NAMES]} (+{n - SHOW_NAMES} more): "
        "Held.parts must cover every reference tensor)"
    ), failures


def test_same_held_names_the_tensor_and_element():
    held = FusedReceiver().load(_export(0).items())
    before = {n: x.clone() for n, x in held.tensors.items()}
    held.tensors["model.norm.weight"][2] += 1
    failures = same_held(held, before, Tally(), when="again: ").failures
    assert len(failures) == 1 and failures[0].startswith(
        "again: model.norm.weight(whole) = model.norm.weight: 1 of 6 element(s) differ, first at [2]"
    ), failures


def test_a_factory_written_before_ranks_is_called_as_before():
    """Receivers are made on every rank with ``rank`` and ``world_size``; a factory that takes neither (nor
    ``**kwargs``) is still called, with the options and ``hf_path`` alone, and one that takes them gets them."""
    from moeverify.oracles.export.receiver import _make

    def old(*, hf_path, refresh=None):
        return ("old", hf_path)

    def new(*, hf_path, rank, world_size, **options):
        return ("new", rank, world_size)

    def only_rank(*, hf_path, rank):
        return ("rank", rank)

    kwargs = {"hf_path": "/m"}
    assert _make(old, kwargs, rank=3, world_size=4) == ("old", "/m")
    assert _make(new, kwargs, rank=3, world_size=4) == ("new", 3, 4)
    assert _make(only_rank, kwargs, rank=3, world_size=4) == ("rank", 3)


def test_a_backup_taken_at_the_first_sleep_only_needs_the_second_cycle():
    """verl #7904's shape: one sleep/wake cycle after the sync (what receiver_wake ran once) gives the weights back
    right; the cycle after the first load takes the backup, and the one after the sync then restores it."""
    first, second = _export(1), _export(2)
    late = MUTANTS["wake_backup_taken_once"][0]()
    late.load((n, x.clone()) for n, x in first.items())
    held = late.load((n, x.clone()) for n, x in second.items())
    one = Tally()
    sleep_wake(late, held, {n: x.clone() for n, x in held.tensors.items()}, one)
    assert one.passed and one.checked > 0  # a single cycle cannot see it
    assert not _life_cycle(MUTANTS["wake_backup_taken_once"][0](), first, second, scope=SCOPE)["receiver_wake"].passed


def test_a_repeat_answered_from_state_taken_at_the_first_repeat_needs_the_second_cycle():
    """A state captured once and reused: a loader answering a repeated update from a cache filled at the first
    repeat passes one repeat after the sync (what receiver_repeat ran once); repeating the first load too fills the
    cache there, and the repeat after the sync then puts the first load's weights back, named by HF tensor."""
    first, second = _export(1), _export(2)
    once = MUTANTS["repeat_cache_taken_once"][0]()
    once.load((n, x.clone()) for n, x in first.items())
    held = once.load((n, x.clone()) for n, x in second.items())
    one = Tally()
    load_again(once, held, list(second.items()), {n: x.clone() for n, x in held.tensors.items()}, one)
    assert one.passed and one.checked > 0  # a single repeat cannot see it
    t = _life_cycle(MUTANTS["repeat_cache_taken_once"][0](), first, second, scope=CopiesScope(None, 0, 1))
    assert [n for n, x in t.items() if x.failures] == ["receiver_repeat"], {n: x.failures for n, x in t.items()}
    w2 = "model.layers.0.mlp.experts.w2_weight"
    down = "model.layers.0.mlp.experts.0.down_proj.weight"
    failure = next(f for f in t["receiver_repeat"].failures if w2 in f)
    assert failure.startswith(
        f"after loading the export of the weight sync a second time: {w2}[0] = {down}: "
        f"{int((first[down] != second[down]).sum())} of {H * I} element(s) differ, first at [0, 0]: "
        f"held {first[down][0, 0].item()!r}, before {second[down][0, 0].item()!r} (+{E - 1} more part(s) of {w2} "
        "changed)"
    ), failure


def test_wake_failures_name_the_hf_tensor_as_receiver_does():
    """receiver_wake names the HF tensor of the part that changed (the engine tensor and part as ``compare`` names
    them), not the engine tensor alone: one element of expert 0's down_proj restored from the first load."""
    first, second = _export(0), _export(1)
    t = _life_cycle(MUTANTS["wake_restores_one_element"][0](), first, second, scope=CopiesScope(None, 0, 1))
    down = "model.layers.0.mlp.experts.0.down_proj.weight"
    assert t["receiver_wake"].failures == [
        "after sleep/wake following the weight sync: model.layers.0.mlp.experts.w2_weight[0] = "
        f"{down}: 1 of {H * I} element(s) differ, first at [0, 0]: held {first[down][0, 0].item()!r}, before "
        f"{second[down][0, 0].item()!r}"
    ]
    # a tensor held under no part (nothing to name) keeps the engine's name
    held = FusedReceiver().load(first.items())
    before = {n: x.clone() for n, x in held.tensors.items()}
    held.tensors["model.norm.weight"][2] += 1
    bare = Held(tensors=held.tensors, parts={k: v for k, v in held.parts.items() if k != "model.norm.weight"})
    assert same_held(bare, before, Tally(), when="").failures[0].startswith("model.norm.weight: 1 of 6 element(s)")


@pytest.mark.parametrize(
    ("family", "tied", "mtp_layers"),
    [("qwen2_tied", "model.embed_tokens.weight", 0), ("deepseek_v3_mtp", None, 1), ("qwen3_moe", None, 0)],
)
def test_copies_scope_reads_the_checkpoint_config_through_the_traits(tmp_path, family, tied, mtp_layers):
    """receiver_copies' scope is the model's traits (tied head, MTP depth) and decoder depth, read from the
    checkpoint's config.json as every check reads a model; no config.json: nothing in scope."""
    (tmp_path / "config.json").write_text(json.dumps(hf_config_dict(family)))
    assert copies_scope(tmp_path) == CopiesScope(tied=tied, mtp_layers=mtp_layers, num_layers=4)
    assert copies_scope(tmp_path / "absent") == copies_scope(None) == CopiesScope(tied=None, mtp_layers=0, num_layers=0)
    (tmp_path / "config.json").write_text(json.dumps({**hf_config_dict(family), "architectures": []}))
    with pytest.raises(UsageError, match=r"config\.json: config 'architectures' must name exactly one model class"):
        copies_scope(tmp_path)
