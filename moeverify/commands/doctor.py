"""``moeverify doctor``: the installed stack against the supported ranges, the backend, one tiny model built.

Exit 0 when all is well, 1 with what is wrong (an unsupported version, a model that does not build).
"""

from __future__ import annotations

import contextlib
import io
import logging
import sys
import time
import warnings
from importlib import metadata

from moeverify import models
from moeverify.commands.common import user_model_ref
from moeverify.errors import MoEVerifyError
from moeverify.spec import support
from moeverify.spec.layout import Layout
from moeverify.spec.models.ref import ModelRef


def register(subparsers) -> None:
    p = subparsers.add_parser("doctor", help="check the installed stack and build one tiny model")
    p.add_argument("--backend", choices=("cpu", "cuda", "auto"), default="auto")
    p.add_argument("--family", default="qwen3_moe", help="family to build on 1 rank (default qwen3_moe)")
    p.add_argument("--model", metavar="PATH", help="build this HF model directory or config.json instead")
    p.add_argument(
        "--model-set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config.json key of --model (repeatable)",
    )
    p.add_argument("-v", "--verbose", action="store_true", help="show megatron's warnings while building")
    p.set_defaults(func=_cmd_doctor)


def _versions() -> dict[str, str]:
    out = {}
    for dist in ("torch", "megatron-core", "megatron-bridge", "transformers", "verl"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = "not installed"
    return out


def _cmd_doctor(args) -> int:
    model = user_model_ref(args)

    print(f"python           {sys.executable} ({sys.version.split()[0]})")
    versions = _versions()
    ranges = {item.dist: item for item in support.SUPPORTED}
    for dist, version in versions.items():
        item = ranges[dist]
        verdict = (
            ""
            if version == "not installed" and not item.required
            else "ok"
            if version != "not installed" and item.admits(version)
            else "UNSUPPORTED"
        )
        print(f"{dist:16} {version:24} supported {item.spec():16} {verdict}".rstrip())
    problems = support.check(versions)
    if problems:
        for problem in problems:
            print(f"doctor: {problem}", file=sys.stderr)
        return 1
    from moeverify import runtime  # lazy: torch

    with _quiet(enabled=not args.verbose, sink=io.StringIO()):
        rt = runtime.init(args.backend)
    print(f"backend          {rt.backend} ({rt.dist_backend}, device {rt.device})")
    print(f"transformer-engine real: {rt.te_real}")
    return _doctor_build(model or ModelRef.builtin(args.family), verbose=args.verbose)


def _doctor_build(model: ModelRef, *, verbose: bool) -> int:
    from moeverify import runtime  # lazy: torch

    t0 = time.perf_counter()
    noise = io.StringIO()
    try:
        with _quiet(enabled=not verbose, sink=noise), runtime.parallel(Layout(), seed=0):
            built = models.build(model, Layout())
            params = sum(p.numel() for chunk in built.model_chunks for p in chunk.parameters())
    except MoEVerifyError:
        raise
    except Exception as exc:  # noqa: BLE001 (doctor reports what broke instead of a traceback)
        print(noise.getvalue()[-4000:], end="")
        print(f"build {model.key}: FAILED: {type(exc).__name__}: {exc}")
        return 1
    print(f"build {model.key} on 1 rank: ok, {params:,} parameters ({time.perf_counter() - t0:.1f}s)")
    return 0


@contextlib.contextmanager
def _quiet(*, enabled: bool, sink: io.StringIO):
    """Keep megatron's import warnings and prints out of doctor's report (shown again on failure)."""
    if not enabled:
        yield
        return
    with warnings.catch_warnings(), contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
        warnings.simplefilter("ignore")
        logging.disable(logging.WARNING)
        try:
            yield
        finally:
            logging.disable(logging.NOTSET)
