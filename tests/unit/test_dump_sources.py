"""Real sources of the same forwards line up token for token: a moeverify dump (``RouteRecorder``, which
records each micro-batch's geometry) and Megatron-Core's own ``RouterTracer`` JSONL, converted with
``dump convert --seq-len --batch``. The tracer runs on CPU ranks (the CPU runtime answers its CUDA query)."""

import json

import pytest
import torch

from moeverify import record
from moeverify.cli import main
from moeverify.spec.layout import Layout

pytestmark = pytest.mark.usefixtures("patched_megatron_world")
B, S, MICROBATCHES = 2, 8, 2


@pytest.fixture(scope="module")
def two_sources(tmp_path_factory):
    from megatron.core.transformer.moe import router_trace

    from moeverify import models
    from moeverify.patches.recorder import RouteRecorder, model_info
    from moeverify.record.commit import finalize
    from moeverify.record.writer import RankWriter

    tmp = tmp_path_factory.mktemp("sources")
    built = models.build("qwen3_moe", Layout(), seed=0)
    chunks = built.model_chunks
    tracer = router_trace.RouterTracer(str(tmp / "trace"), max_steps=1, rank=0, training_mode=True)
    tracer.register_hooks(chunks)
    writer = RankWriter(tmp / "dump", model=model_info(chunks[0].config), background=False)
    pos_BS = torch.arange(S).expand(B, S)
    with RouteRecorder(chunks, writer) as recorder, torch.no_grad():
        recorder.begin_step(0)
        for mb in range(MICROBATCHES):
            tokens = torch.randint(0, built.config.vocab_size, (B, S), generator=torch.Generator().manual_seed(mb))
            chunks[0](tokens, pos_BS, None)
    tracer.advance_step(0)
    tracer.remove_hooks()
    writer.close()
    finalize(tmp / "dump")
    return tmp


def test_megatron_router_trace_and_a_moeverify_dump_agree_token_for_token(two_sources, capsys):
    trace = two_sources / "trace" / "router_trace_rank0.jsonl"
    assert trace.stat().st_size > 0
    conv = two_sources / "from_trace"
    assert (
        main(
            [
                "dump",
                "convert",
                str(trace),
                str(conv),
                "--seq-len",
                str(S),
                "--batch",
                str(B),
                "--microbatches",
                str(MICROBATCHES),
            ]
        )
        == 0
    )
    assert record.load(conv).token_order(0) == "sequence"
    out = two_sources / "diff.json"
    assert main(["dump", "diff", str(two_sources / "dump"), str(conv), "--json", str(out), "--fail-on-diff"]) == 0
    report = json.loads(out.read_text())
    assert report["tokens_diverging_any_layer"] == 0.0 and report["tokens"] == MICROBATCHES * B * S


def test_router_trace_without_geometry_is_refused_not_compared_by_position(two_sources, capsys):
    trace = two_sources / "trace" / "router_trace_rank0.jsonl"
    conv = two_sources / "no_geometry"
    assert main(["dump", "convert", str(trace), str(conv), "--microbatches", str(MICROBATCHES)]) == 0
    capsys.readouterr()
    assert main(["dump", "diff", str(two_sources / "dump"), str(conv)]) == 2
    assert "was saved without seq_len/batch, so its token order is unknown" in capsys.readouterr().err
    # By position, the router order (s * B + b) against sequence order disagrees on most tokens:
    # exactly the silent wrong answer the refusal prevents.
    assert main(["dump", "diff", str(two_sources / "dump"), str(conv), "--assume-same-order", "--fail-on-diff"]) == 1


def test_an_injected_disagreement_is_found_at_its_layer_and_token(two_sources):
    lines = (two_sources / "trace" / "router_trace_rank0.jsonl").read_text().splitlines()
    recs = [json.loads(line) for line in lines]
    target = next(i for i, r in enumerate(recs) if r["layer"] == 1)  # layer 1, micro-batch 0
    row = recs[target]["top_indices"][3]  # router row 3 = s 1, b 1 = sequence-order token 1 * S + 1
    experts = 8
    recs[target]["top_indices"][3] = [e for e in range(experts) if e not in row][: len(row)]
    bad = two_sources / "bad.jsonl"
    bad.write_text("\n".join(json.dumps(r) for r in recs) + "\n")
    conv = two_sources / "bad_dump"
    assert (
        main(
            [
                "dump",
                "convert",
                str(bad),
                str(conv),
                "--seq-len",
                str(S),
                "--batch",
                str(B),
                "--microbatches",
                str(MICROBATCHES),
                "--num-experts",
                str(experts),
            ]
        )
        == 0
    )
    out = two_sources / "bad.json"
    assert main(["dump", "diff", str(two_sources / "dump"), str(conv), "--json", str(out), "--fail-on-diff"]) == 1
    report = json.loads(out.read_text())
    assert report["first_divergent_layer"] == {"1": 1}
    worst = report["worst_tokens"][0]
    assert (worst["microbatch"], worst["token_in_microbatch"]) == (0, 1 * S + 1)


def _rollout_arrays(dump, *, step=0, drop_last=True):
    """What a rollout engine would return for the dump's sequences: per request [S - 1, L, K], sequence order."""
    info = dump.steps[step]
    routes = dump.routes(step=step)
    out = []
    for mb, length in enumerate(info.seq_len):
        stacked = routes.stacked(mb).numpy()
        for b in range(info.batch):
            rows = stacked[b * length : (b + 1) * length]
            out.append(rows[:-1] if drop_last else rows)
    return out


def test_train_vs_rollout_lines_up_requests_and_sets_apart_the_missing_last_row_and_gaps(two_sources, capsys):
    import numpy as np

    dump = record.load(two_sources / "dump")
    requests = _rollout_arrays(dump)
    requests[1] = requests[1].copy()
    requests[1][2] = -1  # a capture gap: never compared as an expert
    requests[2] = requests[2].copy()
    row = requests[2][4, 1].copy()  # request 2, position 4, layer column 1: one real disagreement
    requests[2][4, 1] = [e for e in range(8) if e not in row][: len(row)]
    np.savez(two_sources / "rollout.npz", **{f"req{r}": a for r, a in enumerate(requests)})
    out = two_sources / "rollout.json"
    code = main(
        [
            "dump",
            "diff",
            str(two_sources / "dump"),
            str(two_sources / "rollout.npz"),
            "--rollout",
            "--json",
            str(out),
            "--fail-on-diff",
        ]
    )
    assert code == 1
    report = json.loads(out.read_text())
    sequences = MICROBATCHES * B
    assert report["rollout"] == {
        "requests": sequences,
        "compared_tokens": sequences * (S - 1) - 1,
        "uncaptured_tokens": sequences,
        "capture_gap_rows": 1,
    }
    assert report["first_divergent_layer"] == {str(dump.model.moe_layers[1]): 1}
    assert report["tokens"] == sequences * (S - 1) - 1
    # the same rollout without the injected disagreement agrees everywhere it was captured
    requests[2][4, 1] = row
    np.savez(two_sources / "rollout_ok.npz", **{f"req{r}": a for r, a in enumerate(requests)})
    assert (
        main(
            [
                "dump",
                "diff",
                str(two_sources / "dump"),
                str(two_sources / "rollout_ok.npz"),
                "--rollout",
                "--fail-on-diff",
                "--gaps-expected",  # its one capture gap, on purpose here (without: exit 1, test_dump_rollout_*)
            ]
        )
        == 0
    )
    # a request missing: refused, naming both counts
    np.savez(two_sources / "short.npz", **{f"req{r}": a for r, a in enumerate(requests[:-1])})
    capsys.readouterr()
    assert main(["dump", "diff", str(two_sources / "dump"), str(two_sources / "short.npz"), "--rollout"]) == 2
    assert f"{sequences - 1} rollout request(s) != the training step's {sequences} sequences" in capsys.readouterr().err
