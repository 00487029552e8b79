"""Hundreds of malformed inputs to ``moeverify dump`` (inspect, diff, convert, finalize), each of which must be
refused loudly: exit 2 with one message naming what and where, never a traceback, never exit 0, never a hang, never
an unpickled file.

The cases are a table of mutators x base inputs, generated from a fixed seed. Every base input is first checked to
pass unmutated, so a refusal is the mutation's doing. ``python tests/unit/test_dump_bad_inputs_fuzz.py [--subprocess]``
prints the classification per case (``--subprocess`` runs each case through the real ``moeverify`` command,
``--sample N`` a seeded sample of N cases, ``-v`` every case's message).
"""

from __future__ import annotations

import contextlib
import io
import json
import random
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from dump_bad_inputs import (
    FILE_MUTATORS,
    LAYERS,
    MBS,
    NPY_MUTATORS,
    NPZ_MUTATORS,
    SAFETENSORS_MUTATORS,
    B,
    E,
    K,
    S,
    T,
    _dump_dir_mutators,
    _jsonl,
    _Pickled,
    _resized,
    _to_fifo,
    manifest_mutators,
)
from dump_bad_sources import MAP_JSON_MUTATORS, MAP_NPY_MUTATORS, TRACE_MUTATORS, _traces_dir_mutators

SEED = 1234
TIMEOUT_S = 20  # in-process; a subprocess also pays the import (seconds, more on a loaded host)
WHERE_WORDS = (
    "layer",
    "rank",
    "step",
    "request",
    "line",
    "key",
    "slot",
    "token",
    "position",
    "micro-batch",
    "mb",
    "--",
    "manifest",
    "file",
    "tensor",
    "dtype",
    "shape",
    "column",
    "entry",
    "member",
    "A ",
    "B ",
    "side",
)


@dataclass
class Case:
    name: str
    argv: list[str]  # after "dump"
    bad: str  # the file or option whose name a clear message carries ("" for: any where-word)
    label: str = ""  # the mutation


# A FIFO or a directory where a file belongs is not a missing file, nor a dump: a message saying so misleads.
MISLEADING = {
    "fifo": ("missing manifest", "not found", "is a dump", "no such file"),
    "is a dir": ("missing manifest", "not found", "is a dump", "no such file"),
}


# ------------------------------------------------------------------------------------------ base inputs
def _routes_arrays(seed: int) -> list[np.ndarray]:
    """``MBS`` micro-batches of ``[T, L, K]`` distinct expert ids in sequence order."""
    rng = np.random.default_rng(seed)
    return [
        np.stack([np.stack([rng.permutation(E)[:K] for _ in LAYERS]) for _ in range(T)]).astype(np.int64)
        for _ in range(MBS)
    ]


def _save_dump(path: Path, mbs: list[np.ndarray]) -> None:
    import torch

    from moeverify import record
    from moeverify.routing.routes import Routes

    routes = Routes(
        {layer: [torch.from_numpy(mb[:, i].copy()) for mb in mbs] for i, layer in enumerate(LAYERS)},
        num_experts=E,
        topk=K,
    )
    record.save(path, routes, order="sequence", seq_len=S, batch=B)


def _trace_records(mbs: list[np.ndarray], *, rank: int = 0) -> list[dict]:
    recs = []
    for mb in mbs[:1]:
        router = mb.reshape(B, S, len(LAYERS), K).transpose(1, 0, 2, 3).reshape(T, len(LAYERS), K)
        for i, layer in enumerate(LAYERS):
            recs.append(
                {
                    "step": 0,
                    "stage": "pre_dispatch",
                    "block": "decoder",
                    "layer": layer,
                    "rank": rank,
                    "num_tokens": T,
                    "topk": K,
                    "top_indices": router[:, i].tolist(),
                }
            )
    return recs


def build_bases(root: Path) -> dict[str, Path]:
    """Every legit input the cases mutate, under ``root/base``."""
    base = root / "base"
    base.mkdir(parents=True)
    mbs, mbs2 = _routes_arrays(0), _routes_arrays(1)
    _save_dump(base / "dump", mbs)
    _save_dump(base / "dump2", mbs2)
    np.save(base / "arr.npy", mbs[0])
    np.save(base / "arr2.npy", mbs2[0])
    np.savez(base / "arr.npz", mb0=mbs[0], mb1=mbs[1])
    requests = [seq[: S - 1] for mb in mbs for seq in mb.reshape(B, S, len(LAYERS), K)]
    np.savez(base / "ro.npz", **{f"r{i}": r for i, r in enumerate(requests)})
    padded = np.full((len(requests), S, len(LAYERS), K), -1, dtype=np.int64)
    for i, r in enumerate(requests):
        padded[i, : len(r)] = r
    np.save(base / "ro4.npy", padded)
    _jsonl(base / "trace.jsonl", _trace_records(mbs))
    (base / "traces").mkdir()
    for rank in range(2):
        _jsonl(base / "traces" / f"router_trace_rank{rank}.jsonl", _trace_records([mbs, mbs2][rank], rank=rank))
    (base / "map.json").write_text(json.dumps(list(range(E))))
    np.save(base / "map.npy", np.arange(E, dtype=np.int64))
    from moeverify.cli import main

    with contextlib.redirect_stdout(io.StringIO()):
        assert main(["dump", "convert", str(base / "dump"), str(base / "export.npz")]) == 0
    return {p.name: p for p in base.iterdir()}


# Base commands: {name: (argv template, the inputs it reads)}; "{x}" is input x, "{dst}" a fresh output path.
BASE_COMMANDS = {
    "inspect": (["inspect", "{dump}"], ["dump"]),
    "finalize": (["finalize", "{dump}"], ["dump"]),
    "diff": (["diff", "{dump}", "{dump2}"], ["dump", "dump2"]),
    "diff-mem": (["diff", "{dump2}", "{dump}", "--in-memory"], ["dump"]),
    "diff-export": (["diff", "{dump}", "{export.npz}"], ["export.npz"]),
    "diff-arr": (
        [
            "diff",
            "{arr.npy}",
            "{arr2.npy}",
            "--order-a",
            "sequence",
            "--order-b",
            "sequence",
            "--seq-len",
            str(S),
            "--batch",
            str(B),
        ],
        ["arr.npy"],
    ),
    "diff-rollout": (["diff", "{dump}", "{ro.npz}", "--rollout"], ["ro.npz"]),
    "diff-rollout4": (["diff", "{dump}", "{ro4.npy}", "--rollout"], ["ro4.npy"]),
    "diff-map": (["diff", "{dump}", "{dump2}", "--expert-map-b", "{map.json}"], ["map.json"]),
    "diff-mapnpy": (["diff", "{dump}", "{dump2}", "--expert-map-a", "{map.npy}"], ["map.npy"]),
    "convert-npy": (
        [
            "convert",
            "{arr.npy}",
            "{dst}",
            "--seq-len",
            str(S),
            "--batch",
            str(B),
            "--order",
            "sequence",
            "--moe-layers",
            "0,1,2",
        ],
        ["arr.npy"],
    ),
    "convert-npz": (
        ["convert", "{arr.npz}", "{dst}", "--seq-len", str(S), "--batch", str(B), "--order", "sequence"],
        ["arr.npz"],
    ),
    "convert-trace": (
        ["convert", "{trace.jsonl}", "{dst}", "--seq-len", str(S), "--batch", str(B), "--num-experts", str(E)],
        ["trace.jsonl"],
    ),
    "convert-traces": (
        [
            "convert",
            "{traces}",
            "{dst}",
            "--layout",
            "ep2",
            "--world-size",
            "2",
            "--num-layers",
            "3",
            "--seq-len",
            str(S),
            "--batch",
            str(B),
            "--num-experts",
            str(E),
        ],
        ["traces"],
    ),
    "convert-export": (["convert", "{dump}", "{dst}.npz"], ["dump"]),
    "convert-map": (
        [
            "convert",
            "{arr.npy}",
            "{dst}",
            "--seq-len",
            str(S),
            "--batch",
            str(B),
            "--order",
            "sequence",
            "--expert-map",
            "{map.json}",
        ],
        ["map.json"],
    ),
}


def _argv(template: list[str], paths: dict[str, Path], dst: Path) -> list[str]:
    out = []
    for word in template:
        for key, path in paths.items():
            word = word.replace("{" + key + "}", str(path))
        out.append(word.replace("{dst}", str(dst)))
    return out


OPTION_CASES = [  # (base command, extra argv, the bad option)
    ("convert-npy", ["--moe-layers", "0,0,1"], "--moe-layers"),
    ("convert-npy", ["--moe-layers", "0,1"], "--moe-layers"),
    ("convert-npy", ["--moe-layers", "0,1,2,3"], "--moe-layers"),
    ("convert-npy", ["--moe-layers", "-1,0,1"], "--moe-layers"),
    ("convert-npy", ["--moe-layers", ""], "--moe-layers"),
    ("convert-npy", ["--moe-layers", "a,b"], "--moe-layers"),
    ("convert-npy", ["--seq-len", "3"], "--seq-len"),
    ("convert-npy", ["--batch", "3"], "--batch"),
    ("convert-npy", ["--seq-len", "0"], "--seq-len"),
    ("convert-npy", ["--seq-len", "-4"], "--seq-len"),
    ("convert-npy", ["--num-experts", "4"], "--num-experts"),
    ("convert-npy", ["--num-layers", "2"], "--num-layers"),
    ("convert-npy", ["--layer-offset", "1"], "--layer-offset"),
    ("convert-npy", ["--microbatches", "1"], "--microbatches"),
    ("convert-npy", ["--world-size", "2"], "--world-size"),
    ("convert-npy", ["--order", "router", "--seq-len", "3"], "--seq-len"),
    ("convert-npy", ["--seq-len", "99999999999999999999"], "--seq-len"),
    ("convert-npz", ["--moe-layers", "2,1,0,0"], "--moe-layers"),
    ("convert-npz", ["--batch", "16"], "--batch"),
    ("convert-trace", ["--order", "sequence"], "--order"),
    ("convert-trace", ["--step", "1"], "--step"),
    ("convert-trace", ["--microbatches", "2"], "--microbatches"),
    ("convert-trace", ["--seq-len", "3"], "--seq-len"),
    ("convert-trace", ["--num-experts", "1"], "--num-experts"),
    ("convert-trace", ["--moe-layers", "0,0"], "--moe-layers"),
    ("convert-trace", ["--world-size", "2"], "--world-size"),
    ("convert-traces", ["--world-size", "3"], "--world-size"),
    ("convert-traces", ["--num-layers", "1"], "--num-layers"),
    ("convert-traces", ["--moe-layers", "0,0,1"], "--moe-layers"),
    ("convert-traces", ["--moe-layers", "5"], "--moe-layers"),
    ("convert-traces", ["--layer-offset", "1"], "--layer-offset"),
    ("convert-traces", ["--step", "0"], "--step"),
    ("convert-traces", ["--order", "sequence"], "--order"),
    ("convert-traces", ["--layout", "bogus9"], "--layout"),
    ("convert-traces", ["--layout", "tp3"], "--layout"),
    ("convert-export", ["--seq-len", "4"], "--seq-len"),
    ("convert-export", ["--moe-layers", "0"], "--moe-layers"),
    ("diff", ["--step", "5"], "step"),
    ("diff", ["--step-b", "3"], "step"),
    ("diff", ["--seq-len", "4"], "--seq-len"),
    ("diff", ["--assume-same-order"], "--assume-same-order"),
    ("diff", ["--order-a", "router"], "--order-a"),
    ("diff-arr", ["--seq-len", "3"], "--seq-len"),
    ("diff-arr", ["--batch", "4"], "--batch"),
    ("diff-arr", ["--step", "1"], "--step"),
    ("diff-rollout", ["--step-b", "0"], "--step-b"),
    ("diff-rollout", ["--seq-len", "4"], "--seq-len"),
    ("diff-rollout", ["--assume-same-order"], "--assume"),
    ("diff-rollout", ["--order-b", "sequence"], "--order-b"),
    ("diff-rollout", ["--step", "9"], "step"),
    ("diff", ["--json", "/nonexistent/dir/x.json"], "--json"),
    ("diff", ["--plot", "/nonexistent/x.png"], "--plot"),
    ("diff", ["--expert-map-a", "/nonexistent.json"], "nonexistent"),
    ("diff", ["--expert-map-b", "m.txt"], "m.txt"),
    ("inspect", ["--step", "7"], "step"),
    ("inspect", ["--json", "/proc/x.json"], "--json"),
    ("finalize", ["--world-size", "2"], "world"),
    ("convert-map", ["--num-experts", "9"], "--num-experts"),
]


# ------------------------------------------------------------------------------------------ the table
def _targets():
    """(base command, input to damage, mutators) for every family."""
    out = []
    for cmd, inputs in (("inspect", "dump"), ("diff", "dump2")):
        out.append((cmd, f"{inputs}/rank00000.safetensors", {**FILE_MUTATORS, **SAFETENSORS_MUTATORS}))
        out.append((cmd, f"{inputs}/manifest.json", FILE_MUTATORS))
    out.append(("diff-mem", "dump/rank00000.safetensors", SAFETENSORS_MUTATORS))
    for cmd, name in (("convert-npy", "arr.npy"), ("diff-arr", "arr.npy"), ("diff-rollout4", "ro4.npy")):
        some = {k: FILE_MUTATORS[k] for k in ("empty", "half", "fifo", "is a dir")}
        out.append((cmd, name, {**NPY_MUTATORS, **some}))
    for cmd, name in (("convert-npz", "arr.npz"), ("diff-rollout", "ro.npz"), ("diff-export", "export.npz")):
        out.append(
            (
                cmd,
                name,
                {
                    **NPZ_MUTATORS,
                    **{
                        k: FILE_MUTATORS[k] for k in ("empty", "half", "flip 8", "fifo", "is a dir", "dangling symlink")
                    },
                },
            )
        )
    out.append(
        (
            "convert-trace",
            "trace.jsonl",
            {**TRACE_MUTATORS, **{k: FILE_MUTATORS[k] for k in ("half", "fifo", "is a dir", "random")}},
        )
    )
    out.append(("convert-traces", "traces", _traces_dir_mutators()))
    out.append(
        ("diff-map", "map.json", {**MAP_JSON_MUTATORS, **{k: FILE_MUTATORS[k] for k in ("empty", "fifo", "is a dir")}})
    )
    out.append(("convert-map", "map.json", {k: MAP_JSON_MUTATORS[k] for k in list(MAP_JSON_MUTATORS)[:8]}))
    out.append(("diff-mapnpy", "map.npy", {**MAP_NPY_MUTATORS, "fifo": _to_fifo}))
    resized = {
        f"{k} (bytes agree)": _resized(m)
        for k, m in {
            **SAFETENSORS_MUTATORS,
            **{k: FILE_MUTATORS[k] for k in ("half", "last byte cut", "garbage appended", "flip 1", "flip 8")},
        }.items()
    }
    out.append(("inspect", "dump", resized))
    out.append(("diff", "dump2", resized))
    for cmd in ("inspect", "diff-mem", "convert-export", "finalize"):
        out.append((cmd, "dump", _dump_dir_mutators()))
    return out


# Mutations that leave a legit input for that command (documented behaviour), so they make no case there.
LEGIT = {
    ("convert-npz", "npz member id E"),  # an array's expert count is its largest id + 1
    ("convert-npz", "npz one request dropped"),
    ("convert-npz", "npz one request extra"),  # micro-batches
    ("diff-rollout4", "npy one token short"),  # positions the rollout did not return are set apart
    ("diff-rollout", "npz member empty"),  # a request of which the rollout returned no position: all set apart
    ("convert-map", "map long"),  # an array side's slots are the map's
    ("inspect", "dump garbage rank record"),
    ("diff-mem", "dump garbage rank record"),  # readers read the manifest
    ("convert-export", "dump garbage rank record"),
}


def build_cases(root: Path, *, rng_seed: int = SEED) -> tuple[list[Case], list[Case]]:
    """Build every base input and every damaged copy under ``root``; returns (good bases, bad cases)."""
    bases = build_bases(root)
    rng = random.Random(rng_seed)
    (root / "out").mkdir()
    goods = [
        Case(f"base {cmd}", _argv(t, bases, root / "out" / f"base-{cmd}"), "") for cmd, (t, _) in BASE_COMMANDS.items()
    ]
    cases = []
    manifest = json.loads((bases["dump"] / "manifest.json").read_text())
    targets = _targets() + [("inspect", "dump/manifest.json", manifest_mutators(manifest, rng))]
    made = 0
    for cmd, target, mutators in targets:
        for label, mutate in mutators.items():
            if (cmd, label) in LEGIT:
                continue
            made += 1
            case_dir = root / "cases" / f"{made:04d}"
            case_dir.mkdir(parents=True)
            paths = dict(bases)
            top = target.split("/")[0]
            copy = case_dir / top
            (shutil.copytree if bases[top].is_dir() else shutil.copy)(bases[top], copy)
            paths[top] = copy
            try:
                bad = mutate(case_dir / target)
            except Exception:  # noqa: BLE001 - a mutator that does not apply to this input makes no case
                continue
            cases.append(
                Case(f"{cmd} <- {target}: {label}", _argv(BASE_COMMANDS[cmd][0], paths, case_dir / "dst"), bad, label)
            )
    for i, (cmd, extra, bad) in enumerate(OPTION_CASES):
        cases.append(
            Case(f"{cmd} {' '.join(extra)}", _argv(BASE_COMMANDS[cmd][0], bases, root / "out" / f"o{i}") + extra, bad)
        )
    return goods, cases


# ------------------------------------------------------------------------------------------ running
class _Hang(BaseException):
    pass


def _alarm(signum, frame):
    raise _Hang()


def run_inprocess(argv: list[str], timeout: int = TIMEOUT_S) -> tuple[int | str, str]:
    """(exit code, or "TRACEBACK"/"HANG"; stderr) of ``moeverify dump ARGV`` in this process."""
    from moeverify.cli import main

    err = io.StringIO()
    old = signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(timeout)
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            rc: int | str = main(["dump", *argv])
    except _Hang:
        rc = "HANG"
    except BaseException as exc:  # noqa: BLE001 - a traceback is what the fuzz looks for
        rc = "TRACEBACK"
        err.write(f"{type(exc).__name__}: {exc}")
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    return rc, err.getvalue()


def run_subprocess(argv: list[str], timeout: int = TIMEOUT_S * 4) -> tuple[int | str, str]:
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "moeverify", "dump", *argv],
            capture_output=True,
            text=True,
            timeout=timeout,
            errors="replace",
        )
    except subprocess.TimeoutExpired:
        return "HANG", ""
    return ("TRACEBACK" if "Traceback (most recent call last)" in proc.stderr else proc.returncode), proc.stderr


def classify(case: Case, rc: int | str, err: str, marker: Path) -> str:
    if marker.exists():
        return "UNPICKLED"
    if rc in ("TRACEBACK", "HANG"):
        return rc
    if rc == 0:
        return "EXIT0"
    if rc != 2:
        return f"EXIT{rc}"
    lines = [line for line in err.strip().splitlines() if line.strip()]
    msg = lines[-1] if lines else ""
    if "error:" not in msg or any(w in msg for w in MISLEADING.get(case.label, ())):
        return "UNCLEAR"
    if case.bad and case.bad in err:
        return "OK"
    return "OK" if any(w in msg for w in WHERE_WORDS) else "UNCLEAR"


def run_all(root: Path, *, runner=run_inprocess, verbose: bool = False, sample: int = 0) -> tuple[Counter, list]:
    """Classify every case; base inputs must pass. Returns (counts, [(class, case, stderr)] of the failures)."""
    marker = root / "UNPICKLED"
    _Pickled.marker = str(marker)
    goods, cases = build_cases(root)
    if sample:
        cases = random.Random(SEED).sample(cases, min(sample, len(cases)))
    for good in goods:
        rc, err = runner(good.argv)
        assert rc == 0, f"{good.name} must pass unmutated: {rc} {err}"
    counts, bad = Counter(), []
    for case in cases:
        rc, err = runner(case.argv)
        cls = classify(case, rc, err, marker)
        counts[cls] += 1
        if cls != "OK":
            bad.append((cls, case, err.strip().splitlines()[-1:] if err.strip() else ""))
        if verbose:
            print(f"{cls:10} {case.name}: {err.strip().splitlines()[-1] if err.strip() else ''}"[:300])
    return counts, bad


@pytest.mark.timing
def test_dump_bad_inputs_are_all_refused_loudly(tmp_path):
    start = time.monotonic()
    counts, bad = run_all(tmp_path)
    total = sum(counts.values())
    assert total >= 300, counts
    assert not bad, f"{len(bad)} of {total} bad inputs not refused loudly ({dict(counts)}):\n" + "\n".join(
        f"{cls}: {case.name}: {err}" for cls, case, err in bad[:40]
    )
    assert time.monotonic() - start < 120


if __name__ == "__main__":
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        runner = run_subprocess if "--subprocess" in sys.argv else run_inprocess
        sample = int(sys.argv[sys.argv.index("--sample") + 1]) if "--sample" in sys.argv else 0
        counts, bad = run_all(Path(tmp), runner=runner, verbose="-v" in sys.argv, sample=sample)
        for cls, case, err in bad:
            print(f"{cls:10} {case.name}: {err}")
        print(dict(counts), "total", sum(counts.values()))
