"""An engine run as its own process on a job, read back from files (no torch): what every real engine shares.

``run_job(command, job, workdir=...)`` writes ``job.json`` into an empty ``workdir``, runs ``command + [job.json,
workdir]`` in its own process group with a timeout (``timeouts.ENGINE_S``; past it the whole group is killed), and
reads the ``result.json`` the engine's process wrote: ``{"engine": {...}, "steps": [...], "error": ...}``. A
``generate`` step's record names, per request and sample, the token ids and the routes' ``.npy`` the engine's process
saved; ``EngineRun.samples`` reads them with moeverify's own ``.npy`` reader (header checked, never unpickled). A
failing process raises ``EngineError`` naming the step, the engine's exception and its log's tail (start-up:
``EnvironmentProblem``); nothing from a failed run is returned.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import numpy as np

from moeverify.errors import EnvironmentProblem, MoEVerifyError, UsageError
from moeverify.files import atomic_write_json
from moeverify.routing.npy_file import load_npy
from moeverify.spec import timeouts


class EngineError(MoEVerifyError):
    """The engine process failed, timed out or wrote a result that does not read."""


@dataclasses.dataclass(frozen=True)
class Sample:
    """One completion: its token ids and the routed experts the engine returned (``None`` if it returned none)."""

    request: str
    index: int
    prompt: list[int]
    output: list[int]
    routes: np.ndarray | None
    finish_reason: str | None
    file: str | None = None  # the routes' .npy in the run's directory, as the engine's process saved it

    @property
    def tokens(self) -> list[int]:
        """prompt + completion: every token of the sequence (the engine forwarded all but the last)."""
        return self.prompt + self.output


@dataclasses.dataclass(frozen=True)
class EngineRun:
    engine: dict
    steps: list[dict]
    out_dir: Path
    seconds: float

    def samples(self, step: int) -> list[Sample]:
        """Every sample of a ``generate`` step, request by request, each with its routes read from its file."""
        record = self.steps[step]
        if record.get("op") != "generate":
            raise UsageError(f"step {step} is a {record.get('op')!r} step, not generate")
        out = []
        for req in record["requests"]:
            for s in req["samples"]:
                routes = None
                if s["routes"] is not None:
                    engine = self.engine.get("name", "engine")
                    where = f"{engine} step {step} request {req['id']} sample {s['index']} ({s['routes']})"
                    routes = load_npy(self.out_dir / s["routes"], error=EngineError, where=where)
                    if list(routes.shape) != s["routes_shape"] or str(routes.dtype) != s["routes_dtype"]:
                        raise EngineError(
                            f"{where}: the file holds {routes.dtype} {list(routes.shape)}, the engine reported "
                            f"{s['routes_dtype']} {s['routes_shape']}"
                        )
                out.append(
                    Sample(
                        request=str(req["id"]),
                        index=int(s["index"]),
                        prompt=list(req["prompt_token_ids"]),
                        output=list(s["token_ids"]),
                        routes=routes,
                        finish_reason=s["finish_reason"],
                        file=s["routes"],
                    )
                )
        return out

    def metric(self, step: int, name: str) -> Any:
        return self.steps[step].get("metrics", {}).get(name)


def run_job(
    command: list[str], job: dict, *, workdir: str | os.PathLike, name: str, timeout: float | None = None
) -> EngineRun:
    """Run ``command + [JOB, WORKDIR]`` on ``job`` (``name``: the engine, for messages); ``workdir`` is created and
    must be empty: the job, the result and the route files land there."""
    timeout = timeouts.value("ENGINE_S") if timeout is None else timeout
    out = Path(workdir)
    out.mkdir(parents=True, exist_ok=True)
    if any(out.iterdir()):
        raise UsageError(f"engine workdir {out}: not empty; give each run a directory of its own")
    atomic_write_json(out / "job.json", job)
    log = out / "engine.log"
    t0 = time.perf_counter()
    with open(log, "wb") as log_file:
        proc = subprocess.Popen(
            [*command, str(out / "job.json"), str(out)],
            stdin=subprocess.DEVNULL,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: a timeout kills the engine and whatever it started
        )
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise EngineError(f"{name} ran past {timeout:.0f} s and was killed; its log ends:\n{tail(log)}") from None
    seconds = time.perf_counter() - t0
    result_path = out / "result.json"
    if not result_path.is_file():
        raise EngineError(f"{name} exited {rc} without writing {result_path}; its log ends:\n{tail(log)}")
    try:
        result = json.loads(result_path.read_text())
    except json.JSONDecodeError as exc:
        raise EngineError(f"{result_path}: not JSON ({exc})") from None
    if result.get("error") or rc != 0:
        err = result.get("error") or {}
        at = "start-up" if err.get("step") is None else f"step {err['step']}"
        raise (EnvironmentProblem if err.get("step") is None else EngineError)(
            f"{name} failed at {at} (exit {rc}): "
            f"{err.get('type')}: {err.get('message')}\n{err.get('traceback', '')}\nits log ends:\n{tail(log)}"
        )
    if len(result["steps"]) != len(job["steps"]):
        raise EngineError(f"{name} ran {len(result['steps'])} of {len(job['steps'])} steps and exited 0")
    return EngineRun(engine=result["engine"], steps=result["steps"], out_dir=out, seconds=seconds)


def tail(path: Path, limit: int = 4000) -> str:
    """The last ``limit`` characters of an engine's log."""
    text = path.read_text(errors="replace") if path.exists() else ""
    return text[-limit:]
