"""Token identity of whole-job record/replay (``MOEVERIFY_ROUTER_REPLAY=record:DIR`` / ``replay:DIR``), 1 CPU rank.

A tiny real megatron-core MoE model (Qwen3-MoE family) trains two optimizer steps of three micro-batches under
the autopatch, built after the patch is installed as the entry point does. Replaying a recording into a run fed
other tokens must raise at the first forward; the same tokens replay bitwise; ``dump diff`` of two runs on other
tokens says so first and refuses unless ``--tokens-differ-ok``.
"""

from __future__ import annotations

import gc

import pytest
import torch

from moeverify.errors import RouteError
from moeverify.patches import autopatch, identity
from moeverify.patches import router_replay as rr
from moeverify.patches import token_keys as tk
from moeverify.spec.layout import Layout

B, S, MB, STEPS = 2, 8, 3, 2


@pytest.fixture(scope="module", autouse=True)
def world():
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    from moeverify import runtime

    runtime.init("cpu")
    scale = MoEAuxLossAutoScaler.main_loss_backward_scale
    with runtime.parallel(Layout(), seed=0):
        try:
            yield
        finally:
            MoEAuxLossAutoScaler.main_loss_backward_scale = scale
            autopatch.uninstall()
            rr.revert()


def data(vocab: int, seed: int) -> list[list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [[torch.randint(0, vocab, (B, S), generator=g) for _ in range(MB)] for _ in range(STEPS)]


def job(directory, mode: str, seed: int, *, tokens=None) -> list[torch.Tensor]:
    """A training job under the autopatch: model built after install, SGD steps; returns the losses.

    ``tokens``: replace the data (``data(vocab, seed)``) by a function of it."""
    from moeverify import models

    gc.collect()  # models are numbered over live routers: earlier jobs' models must be gone
    autopatch.install(autopatch.Setting(mode=mode, directory=directory))
    try:
        built = models.build("qwen3_moe", Layout(), seed=0)
        chunk = built.model_chunks[0]
        chunk.train()
        batches = data(built.config.vocab_size, seed)
        if tokens is not None:
            batches = tokens(batches)
        opt = torch.optim.SGD(chunk.parameters(), lr=0.1)
        pos = torch.arange(S).expand(B, S)
        losses = []
        for step in batches:
            opt.zero_grad()
            for ids in step:
                loss = chunk(ids, pos, None).float().square().mean()
                loss.backward()
                losses.append(loss.detach())
            opt.step()
        assert autopatch.session().finish() == []
    finally:
        autopatch.uninstall()
    return losses


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    directory = tmp_path_factory.mktemp("identity") / "run1"
    return directory, job(directory, "record", seed=1234)


def test_recording_carries_one_fingerprint_per_sequence_and_micro_batch(recorded):
    from moeverify import record

    directory, _ = recorded
    dump = record.load(directory)
    assert dump.has_fingerprints and sorted(dump.steps) == [0, 1]
    got = [dump.fingerprints(step=s, mb=m) for s in range(STEPS) for m in range(MB)]
    assert [None if g is None else tuple(g.shape) for g in got] == [(B,)] * STEPS * MB
    assert len({int(v) for g in got for v in g}) == STEPS * MB * B  # random sequences: all distinct


def test_replay_on_other_tokens_is_refused_at_the_first_forward(recorded, tmp_path):
    """Issue 22, observed 1: a recording replayed into a run whose data seed differs trained silently."""
    directory, _ = recorded
    with pytest.raises(
        RouteError,
        match=r"rank 0 forward 0 \(recorded step 0, micro-batch 0\): tokens differ in 2 "
        r"of 2 sequence\(s\); first: sequence 0 has fingerprint [0-9a-f]{16}, the "
        r"recording .* holds [0-9a-f]{16}",
    ):
        job(directory, "replay", seed=99)


def test_replay_one_token_changed_in_a_later_micro_batch_is_refused_there(recorded):
    directory, _ = recorded

    def one_token_changed(batches):
        batches[1][2] = batches[1][2].clone()
        batches[1][2][1, 5] = (batches[1][2][1, 5] + 1) % 100
        return batches

    with pytest.raises(
        RouteError,
        match=r"rank 0 forward 5 \(recorded step 1, micro-batch 2\): tokens differ in 1 of "
        r"2 sequence\(s\); first: sequence 1 ",
    ):
        job(directory, "replay", seed=1234, tokens=one_token_changed)


def test_replay_of_the_same_data_fed_in_another_order_names_the_recorded_micro_batch(recorded):
    # The recorded data with each step's micro-batches reversed: forward 0 holds recorded micro-batch 2's
    # sequences. The message says so (a batching or order change), not that the job's data differ.
    directory, _ = recorded
    with pytest.raises(
        RouteError,
        match=r"rank 0 forward 0 \(recorded step 0, micro-batch 0\): this forward's sequences are those of "
        r"recorded step 0, micro-batch 2 .* another order or number per step",
    ):
        job(directory, "replay", seed=1234, tokens=lambda batches: [list(reversed(step)) for step in batches])


def test_replay_on_the_same_tokens_is_bitwise_the_recorded_run(recorded):
    directory, losses = recorded
    replayed = job(directory, "replay", seed=1234)
    assert len(losses) > 0
    assert [i for i, (a, b) in enumerate(zip(replayed, losses, strict=True)) if not torch.equal(a, b)] == []


def test_fingerprints_see_content_length_padding_and_packed_slot():
    ids = torch.tensor([[5, 6, 7, 0], [5, 6, 7, 9]])
    plain = tk.row_fingerprints(ids)
    assert plain[0] != plain[1]
    pad = torch.tensor([[False, False, False, True], [False, False, False, False]])
    padded = tk.row_fingerprints(ids, padding_mask_BS=pad)
    assert padded[0] != plain[0]  # length 3, not 4
    three = tk.row_fingerprints(ids[:1, :3])
    assert padded[0] == three[0]  # right padding the model is told about is not content
    swapped = tk.row_fingerprints(torch.tensor([[6, 5, 7, 0]]))
    assert swapped[0] != plain[0]  # position counts
    packed = tk.packed_fingerprints(torch.tensor([[5, 6, 7, 5, 6, 7]]), cu_seqlens=torch.tensor([0, 3, 6]))
    assert packed[0] != packed[1]  # same content, other slot in the pack
    slotted = tk.packed_fingerprints(
        torch.tensor([[5, 6, 7, 0, 5, 6, 7, 0]]),
        cu_seqlens=torch.tensor([0, 3, 6]),
        cu_seqlens_padded=torch.tensor([0, 4, 8]),
    )
    assert torch.equal(slotted, packed)  # slot padding is not content
    assert identity.fingerprints_of((torch.zeros(2, 3),), {}) is None  # no integer input_ids: identity unknown


def run_diff(capsys, *argv) -> tuple[int, str]:
    import argparse

    from moeverify.commands import dump as cli

    parser = argparse.ArgumentParser()
    cli.register(parser.add_subparsers())
    args = parser.parse_args(["dump", "diff", *argv])
    code = args.func(args)
    out = capsys.readouterr()
    return code, out.out + out.err


def test_dump_diff_of_runs_on_other_tokens_says_so_and_refuses(recorded, tmp_path, capsys):
    """Issue 22, observed 2: the diff of two runs on different data read as 97 % routing divergence."""
    directory, _ = recorded
    other = tmp_path / "run2"
    job(other, "record", seed=99)
    # two steps each: one diff compares one step, which must be named (the first alone passed a later divergence)
    code, text = run_diff(capsys, str(directory), str(other))
    assert code == 2 and "holds steps [0, 1]: a diff compares one step; name it with --step S" in text
    code, text = run_diff(capsys, str(directory), str(other), "--step", "0")
    assert code == 2
    assert "tokens differ in 6 of 6 sequences (first: micro-batch 0, dp rank 0, sequence 0)" in text
    assert "--tokens-differ-ok" in text
    out = tmp_path / "diff.json"
    code, text = run_diff(capsys, str(directory), str(other), "--step", "0", "--tokens-differ-ok", "--json", str(out))
    assert code == 0
    import json

    assert json.loads(out.read_text())["token_identity"] == {
        "identity": "differ",
        "sequences": 6,
        "differ": 6,
        "first": "micro-batch 0, dp rank 0, sequence 0",
    }
    assert text.index("tokens differ in 6 of 6 sequences") < text.index("DIFFERING tokens") < text.index("layer")
    code, text = run_diff(capsys, str(directory), str(directory), "--step", "1")
    assert code == 0 and "tokens: the same in all 6 sequences" in text


def test_dump_diff_with_a_dump_without_fingerprints_says_identity_unknown(recorded, tmp_path, capsys):
    """A dump written without fingerprints (older dumps, record.save) still reads; the diff says identity is unknown."""
    from moeverify import record

    directory, _ = recorded
    dump = record.load(directory)
    old = record.save(
        tmp_path / "old",
        dump.routes(step=0),
        num_layers=dump.model.num_layers,
        moe_layers=dump.model.moe_layers,
        seq_len=S,
        batch=B,
        order="sequence",
    )
    assert not record.load(old).has_fingerprints
    from moeverify.record.summary import summarize

    assert (summarize(record.load(old))["token_identity"], summarize(dump)["token_identity"]) == (
        "unknown",
        "fingerprints",
    )
    code, text = run_diff(capsys, str(directory), str(old), "--step", "0")
    assert code == 0
    assert f"token identity unknown: B ({old}, step 0) carries no token fingerprints" in text
