"""Peak host RSS per phase of the roundtrip, export and replay checks, as a ratio to the model's bytes.

One CPU rank, a user model config (``--model PATH/config.json``, default: ``bench/qwen3_30b_a3b_narrow.json``,
Qwen3-30B-A3B's architecture narrowed to hidden 1024, 64 experts top-8, expert FFN 384, vocab 32000), at
each depth of ``--layers`` (``num_hidden_layers`` overridden); or ``--model DIR``, a directory of safetensors
(real weights, read where they are: no checkpoint phase), at its own depth. Phases, each in a fresh process so
that each peak is its own:

- ``import``: torch + transformers + moeverify imported, nothing built (the fixed cost);
- ``checkpoint``: the seeded checkpoint made (``hf_checkpoint``: a config alone gets its weights made per tensor
  when read, so this phase writes the config and the tensor list only); model bytes = the sum of every tensor's
  bytes (its shape and dtype);
- ``bare_export``: the peer of every check's time: the model loaded through Megatron-Bridge and one plain
  ``export_hf_weights`` pass over it, nothing compared (what a trainer's weight sync costs), its experts built as the
  checks build them (``replay_experts: grouped`` in ``--options``: grouped for both);
- ``check:<name>``: ``python -m moeverify run`` of a 1-rank scenario with that check alone, the checkpoint
  already cached: bridge load, model build, the check and its reference export. Peak = the largest
  ``ru_maxrss`` of any process of the run (``getrusage(RUSAGE_CHILDREN)`` of a fresh wrapper).

``--layout tp1 ep2 pp2`` runs each check under each layout (a scenario layout name, read with
``moeverify.spec.layout.parse_layout_name``; the world size is the least the layout admits, or tp*pp*cp*dp when the
name gives dpN): a multi-rank ``moeverify run`` on CPU ranks, and each rank's own peak RSS (VmHWM at the end
of the check, the run's ``peak_rss_mb``) recorded as ``rank_peaks`` next to the wrapper's peak (the largest
process alone). The per-rank share is the largest rank's peak over the model's bytes.

Reports peak RSS / model bytes per phase and depth, and the least-squares slope per layer (bytes of RSS per
byte of model added per layer: the part that grows with depth). Writes JSON under bench/results/ and a PNG.

    python bench/memory.py [--model config.json] [--layers 1 2 4] [--checks roundtrip export replay]
                           [--backend cpu|cuda] [--layout tp1 ep2 pp2] [--options JSON]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_MODEL = ROOT / "bench" / "qwen3_30b_a3b_narrow.json"
CHECKS = ("roundtrip", "export", "replay")

_WRAP = (
    "import json, resource, subprocess, sys, time\n"
    "t = time.perf_counter(); rc = subprocess.run(sys.argv[1:]).returncode\n"
    "print(json.dumps(dict(rc=rc, wall=time.perf_counter() - t,\n"
    "      peak=resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024)))\n"
)

_IMPORT = "import torch, transformers, moeverify.models.families  # noqa\n"

# The peer: build (bridge load) and one export pass, nothing kept or compared.
_BARE = (
    "import sys, time\nfrom moeverify import models, runtime\nfrom moeverify.spec.layout import Layout\n"
    "from moeverify.spec.models import user\n"
    "import json\nkey = user.read(sys.argv[1], json.loads(sys.argv[2])).ref\n"
    "runtime.init(sys.argv[3])\n"
    "with runtime.parallel(Layout(), seed=0):\n"
    "    built = models.build(key, Layout(), overrides=json.loads(sys.argv[4]))\n"
    "    n = sum(t.numel() for _, t in built.bridge.export_hf_weights(built.model_chunks, cpu=True,\n"
    "                                                                    show_progress=False))\n"
    "print(n)\n"
)

# The seeded checkpoint as a check's rank makes it (``hf_checkpoint``, into MOEVERIFY_CACHE_DIR): the checks
# that follow find it cached, so their peaks are the bridge load, build and check alone.
_CHECKPOINT = (
    "import json, sys\nfrom moeverify.models import families\nfrom moeverify.spec.models import user\n"
    "key = user.read(sys.argv[1], json.loads(sys.argv[2])).ref\n"
    "print(families.hf_checkpoint(key, 0))\n"
)


def _peak(cmd: list[str], *, env: dict | None = None, log: Path | None = None) -> dict:
    """Run ``cmd`` under a fresh wrapper: its exit code, wall seconds and the largest RSS of any descendant."""
    proc = subprocess.run([sys.executable, "-c", _WRAP, *cmd], cwd=ROOT, env=env, capture_output=True, text=True)
    if log is not None:
        log.write_text(proc.stderr)
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    if out["rc"] != 0:
        raise SystemExit(f"bench/memory.py: {' '.join(cmd)} exited {out['rc']}:\n{proc.stderr[-3000:]}")
    return out


def parse_layout(name: str) -> tuple[str, dict, int]:
    """A scenario layout name (``tp1``, ``ep2``, ``pp2``, ``ep2-dp2``): its canonical name, its scenario mapping
    (the non-default fields) and its world size (tp*pp*cp*dp when the name gives dpN, else the least world
    size the layout admits)."""
    from moeverify.spec.layout import Layout, parse_layout_name

    layout, dp = parse_layout_name(name)
    if any(part.startswith("dp") for part in name.split("-")):
        world = layout.model_parallel_size() * dp
    else:
        world = math.lcm(layout.model_parallel_size(), layout.expert_tp * layout.ep * layout.pp)
    layout.validate(world_size=world)
    default = Layout().as_dict()
    return layout.name(world), {k: v for k, v in layout.as_dict().items() if v != default.get(k)}, world


def weights_dir(model: Path) -> bool:
    """``model`` is a directory of safetensors (real weights, at their own depth), not a config alone."""
    return model.is_dir() and any(model.glob("*.safetensors"))


def depth_overrides(model: Path, layers: int) -> dict:
    """The config change that gives ``model`` ``layers`` layers: none for a weights directory, whose depth is its
    own (refused when ``--layers`` asks for another)."""
    if not weights_dir(model):
        return {"num_hidden_layers": layers}
    own = json.loads((model / "config.json").read_text())["num_hidden_layers"]
    if layers != own:
        raise SystemExit(
            f"bench/memory.py: {model} holds weights of {own} layers; --layers {layers} cannot change "
            f"them (give --layers {own})"
        )
    return {}


def _scenario(
    path: Path,
    model: Path,
    layers: int,
    check: str,
    layout: dict | None = None,
    world_size: int = 1,
    options: dict | None = None,
) -> None:
    overrides = depth_overrides(model, layers)
    path.write_text(
        json.dumps(
            {
                "scenarios": [
                    {
                        "model": str(model),
                        **({"model_set": overrides} if overrides else {}),
                        "world_size": world_size,
                        "layout": layout or {},
                        "checks": [check],
                        **({"options": options} if options else {}),
                    }
                ]
            }
        )
    )


def _rank_peaks(report: Path) -> list[int]:
    """Each rank's peak RSS in bytes at the end of the check (the run's JSON ``peak_rss_mb``, MiB)."""
    (record,) = json.loads(report.read_text())
    peaks = record.get("peak_rss_mb") or []
    if not peaks or any(v is None for v in peaks):
        raise SystemExit(f"bench/memory.py: {report}: no peak_rss_mb for every rank (got {peaks!r})")
    return [round(v * 2**20) for v in peaks]


def _gpu_peaks(report: Path) -> list[int]:
    """Each GPU rank's most GPU memory held (the run's JSON ``peak_gpu_mb``, MiB), in bytes; [] on CPU ranks."""
    (record,) = json.loads(report.read_text())
    return [round(v * 2**20) for v in record.get("peak_gpu_mb") or [] if v is not None]


def _model_bytes(ckpt: Path) -> int:
    """Bytes of the model's tensors: seeded weights made on demand (their list) or safetensors files."""
    from moeverify.models import seeded

    if seeded.is_seeded(ckpt):
        weights = seeded.SeededWeights(ckpt)
        return sum(
            math.prod(shape) * dtype.itemsize
            for shape, dtype in zip(weights.shapes().values(), weights.dtypes().values(), strict=True)
        )
    return sum(f.stat().st_size for f in ckpt.glob("*.safetensors"))


def _gpu_card() -> dict | None:
    """The card the run used: model, driver, memory (``router_replay.gpu_info``, in a child: this process imports
    no torch)."""
    code = "import json, sys; sys.path.insert(0, 'bench'); import router_replay as r; print(json.dumps(r.gpu_info()))"
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    return json.loads(proc.stdout.strip().splitlines()[-1]) if proc.returncode == 0 else {"error": proc.stderr[-300:]}


def _bare_build(options: dict | None) -> dict:
    """The bare export's build overrides: the experts built as the checks build them (``replay_experts``)."""
    return {"moe_grouped_gemm": True} if (options or {}).get("replay_experts") == "grouped" else {}


def measure(
    model: Path,
    layers: list[int],
    checks: list[str],
    work: Path,
    backend: str = "cpu",
    save=lambda rows: None,
    layouts: tuple[str, ...] = ("tp1",),
    options: dict | None = None,
) -> dict:
    """Every phase at every depth; ``save(rows)`` after each row (a cut-off run keeps what it measured)."""
    env = dict(os.environ, MOEVERIFY_CACHE_DIR=str(work / "cache"))
    rows = _Rows(save)
    rows += [dict(phase="import", layers=0, **_peak([sys.executable, "-c", _IMPORT], env=env))]
    print(f"import only: peak {rows[0]['peak'] / 1e9:.2f} GB", flush=True)
    for n in layers:
        overrides = json.dumps(depth_overrides(model, n))
        if weights_dir(model):  # real weights: read where they are, nothing made
            model_bytes = _model_bytes(model)
            print(f"{n} layers: model {model_bytes / 1e9:.3f} GB of safetensors in {model}", flush=True)
        else:
            before = set((work / "cache").glob("models/*"))
            row = _peak([sys.executable, "-c", _CHECKPOINT, str(model), overrides], env=env)
            (ckpt,) = set((work / "cache").glob("models/*")) - before
            model_bytes = _model_bytes(ckpt)
            rows.append(dict(phase="checkpoint", layers=n, model_bytes=model_bytes, **row))
            print(
                f"{n} layers: model {model_bytes / 1e9:.3f} GB; checkpoint peak {row['peak'] / 1e9:.2f} GB "
                f"({row['peak'] / model_bytes:.2f}x)",
                flush=True,
            )
        bare = _peak(
            [sys.executable, "-c", _BARE, str(model), overrides, backend, json.dumps(_bare_build(options))],
            env=env,
            log=work / f"{n}-bare.log",
        )
        rows.append(dict(phase="bare_export", layers=n, model_bytes=model_bytes, **bare))
        print(
            f"{n} layers: bare export peak {bare['peak'] / 1e9:.2f} GB ({bare['peak'] / model_bytes:.2f}x), "
            f"{bare['wall']:.0f} s",
            flush=True,
        )
        for check in checks:
            for name in layouts:
                name, mapping, world = parse_layout(name)
                tag = f"{n}-{check}-{name}"
                scen = work / f"scen-{tag}.json"
                _scenario(scen, model, n, check, mapping, world, options)
                row = _peak(
                    [
                        sys.executable,
                        "-m",
                        "moeverify",
                        "run",
                        str(scen),
                        "--backend",
                        backend,
                        "--json",
                        str(work / f"{tag}.json"),
                        "--run-dir",
                        str(work / f"run-{tag}"),
                    ],
                    env=env,
                    log=work / f"{tag}.log",
                )
                ranks = _rank_peaks(work / f"{tag}.json")
                gpu = _gpu_peaks(work / f"{tag}.json")
                rows.append(
                    dict(
                        phase=f"check:{check}",
                        layers=n,
                        model_bytes=model_bytes,
                        layout=name,
                        world_size=world,
                        rank_peaks=ranks,
                        rank_share=round(max(ranks) / model_bytes, 3),
                        time_vs_bare_export=round(row["wall"] / bare["wall"], 3),
                        gpu_peaks=gpu,
                        **row,
                    )
                )
                on_gpu = f", GPU peak {max(gpu) / 1e9:.1f} GB ({max(gpu) / model_bytes:.2f}x)" if gpu else ""
                print(
                    f"{n} layers, {name} ({world} rank(s)): {check} peak {row['peak'] / 1e9:.2f} GB "
                    f"({row['peak'] / model_bytes:.2f}x), ranks {[round(r / 1e9, 2) for r in ranks]} GB "
                    f"(largest {max(ranks) / model_bytes:.2f}x){on_gpu}, {row['wall']:.0f} s "
                    f"({row['wall'] / bare['wall']:.2f}x the bare export)",
                    flush=True,
                )
    return dict(model=str(model), rows=list(rows), fits=_fits(rows))


class _Rows(list):
    def __init__(self, save) -> None:
        super().__init__()
        self._save = save

    def append(self, row: dict) -> None:
        super().append(row)
        self._save(list(self))

    def __iadd__(self, rows):
        for row in rows:
            self.append(row)
        return self


def _fits(rows: list[dict]) -> dict:
    """Per phase (and layout other than tp1: ``check:export@ep2-dp2``): RSS = a + b * model_bytes over the
    depths (b: RSS bytes per model byte a layer adds). RSS: the largest rank's peak where ranks were
    measured, else the wrapper's peak."""
    fits = {}
    for key in sorted({_key(r) for r in rows if r["layers"]}):
        pts = [(r["model_bytes"], max(r.get("rank_peaks") or [r["peak"]])) for r in rows if _key(r) == key]
        if len(pts) < 2:
            continue
        mx = sum(x for x, _ in pts) / len(pts)
        my = sum(y for _, y in pts) / len(pts)
        b = sum((x - mx) * (y - my) for x, y in pts) / sum((x - mx) ** 2 for x, _ in pts)
        fits[key] = dict(slope=round(b, 3), fixed_gb=round((my - b * mx) / 1e9, 3))
    return fits


def _key(row: dict) -> str:
    layout = row.get("layout", "tp1")
    return row["phase"] if layout == "tp1" else f"{row['phase']}@{layout}"


def _plot(result: dict, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for key in sorted({_key(r) for r in result["rows"] if r["layers"]}):
        pts = [r for r in result["rows"] if _key(r) == key]
        ax.plot(
            [r["layers"] for r in pts],
            [max(r.get("rank_peaks") or [r["peak"]]) / r["model_bytes"] for r in pts],
            marker="o",
            label=key,
        )
    ax.set_xlabel("layers")
    ax.set_ylabel("peak RSS (largest rank) / model bytes")
    ax.set_title(
        f"host memory per phase (and layout), largest {result.get('backend', 'cpu')} rank ({result.get('label', '')})"
    )
    ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=100)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--model",
        type=Path,
        default=DEFAULT_MODEL,
        help="a config.json, or a directory of safetensors at its own depth (default %(default)s)",
    )
    p.add_argument("--layers", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--checks", nargs="+", choices=CHECKS, default=list(CHECKS))
    p.add_argument("--label", default="memory", help="results file stem under bench/results/")
    p.add_argument("--backend", choices=("cpu", "cuda"), default="cpu")
    p.add_argument(
        "--layout",
        nargs="+",
        default=["tp1"],
        help="scenario layout names, each check runs under each (e.g. tp1 ep2 pp2; default tp1)",
    )
    p.add_argument(
        "--options",
        type=json.loads,
        default=None,
        help='scenario options as JSON, e.g. \'{"replay_subchecks": "in_layout"}\'',
    )
    args = p.parse_args(argv)
    for name in args.layout:
        try:
            parse_layout(name)
        except Exception as exc:  # LayoutError: a clear message, before anything runs
            p.error(f"--layout {name}: {exc}")
    out = ROOT / "bench" / "results" / f"{args.label}.json"
    gpu = _gpu_card() if args.backend == "cuda" else None

    def save(result: dict) -> None:
        tmp_out = out.with_suffix(".json.tmp")
        tmp_out.write_text(
            json.dumps(dict(result, label=args.label, backend=args.backend, options=args.options, gpu=gpu), indent=1)
        )
        os.replace(tmp_out, out)

    with tempfile.TemporaryDirectory(prefix="moeverify-membench-") as tmp:
        result = measure(
            args.model.resolve(),
            args.layers,
            args.checks,
            Path(tmp),
            args.backend,
            save=lambda rows: save(dict(model=str(args.model), rows=rows, fits=_fits(rows))),
            layouts=tuple(args.layout),
            options=args.options,
        )
    result.update(label=args.label, backend=args.backend, options=args.options, gpu=gpu)
    save(result)
    print(json.dumps(result["fits"], indent=1))
    try:
        _plot(result, out.with_suffix(".png"))
    except ImportError:
        print("matplotlib missing: no PNG", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
