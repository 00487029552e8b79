"""After a failed attempt: which scenario and check broke, on which rank, and why.

Reads the ranks' event files (where each rank was) and stacks files (what it said when it died).
The rank whose stacks file was written first is the cause; the others were usually torn down by
torchrun after it (their SIGTERM stacks show where they waited).
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import signal
from pathlib import Path

from moeverify.runner.plan import Plan, events_path, read_lines, stacks_path

TAIL_LINES = 60


@dataclasses.dataclass(frozen=True, kw_only=True)
class Crash:
    """Where an attempt broke. ``fatal``: no rank got past start-up, so retrying cannot help."""

    index: int
    check: str | None  # None when it broke between checks (model-parallel setup or teardown)
    message: str
    seconds: float = 0.0
    peak_rss_mb: tuple[float, ...] = ()
    fatal: bool = False


@dataclasses.dataclass(frozen=True, kw_only=True)
class _RankState:
    rank: int
    ready: bool
    index: int | None
    check: str | None
    started_t: float | None
    peak_rss_mb: float
    stacks: str
    stacks_mtime: float


def _rank_state(directory: Path, rank: int, plan: Plan) -> _RankState:
    ready, index, check, started_t, rss = False, None, None, None, math.nan
    for event in read_lines(events_path(directory, rank)):
        kind = event.get("event")
        rss = event.get("peak_rss_mb", rss)
        if kind == "ready":
            ready, index, check = True, plan.start, None
        elif kind == "scenario":
            index, check = event["index"], None
        elif kind == "start":
            index, check, started_t = event["index"], event["check"], event["t"]
        elif kind in ("end", "scenario_end"):
            index, check = event["index"] + (kind == "scenario_end"), None
    path = stacks_path(directory, rank)
    text = path.read_text(errors="replace") if path.exists() else ""
    mtime = path.stat().st_mtime if text.strip() else math.inf
    return _RankState(
        rank=rank,
        ready=ready,
        index=index,
        check=check,
        started_t=started_t,
        peak_rss_mb=rss,
        stacks=text.strip(),
        stacks_mtime=mtime,
    )


def _tail(text: str) -> str:
    """The end of a Python traceback (most recent call last)."""
    lines = text.splitlines()
    cut = len(lines) - TAIL_LINES
    return "\n".join((["..."] if cut > 0 else []) + lines[max(cut, 0) :])


def _head(text: str) -> str:
    """The start of a faulthandler dump (most recent call first)."""
    lines = text.splitlines()
    return "\n".join(lines[:TAIL_LINES] + (["..."] if len(lines) > TAIL_LINES else []))


# A rank whose peer vanished reports this; the peer that vanished first is the cause, not it.
_VICTIM_ERRORS = ("Connection closed by peer", "Connection reset by peer", "Broken pipe")


def _is_victim(text: str) -> bool:
    """Ranks torn down because another rank died come after the ones that failed on their own."""
    last = text.strip().splitlines()[-1] if text.strip() else ""
    return _kind(text) == "was terminated" or any(err in last for err in _VICTIM_ERRORS)


def _kind(text: str) -> str:
    if text.startswith("Killed: "):
        return "was killed"
    if text.startswith("moeverify: rank"):
        return "raised"
    if text.startswith("Timeout ("):
        return "timed out"
    if text.startswith("Fatal Python error"):
        return "died"
    return "was terminated"


_FRAME = re.compile(r'^\s*File "(?P<file>[^"]+)", line (?P<line>\d+),? in (?P<func>\S+)')


def innermost_frame(text: str) -> str:
    """The innermost frame outside installed packages, as ``file.py:LINE in func`` ("" if none)."""
    frames = [m for m in map(_FRAME.match, text.splitlines()) if m]
    if _kind(text) == "raised":
        frames.reverse()  # tracebacks list the most recent call last; faulthandler first
    own = [m for m in frames if "site-packages" not in m["file"] and not m["file"].startswith("<")]
    for m in own or frames:
        return f"{os.path.basename(m['file'])}:{m['line']} in {m['func']}"
    return ""


def _exception_line(trace: str) -> str:
    """``Type: first line of the message`` of a traceback (a message may run over several lines)."""
    lines = trace.splitlines()
    last_frame = max((i for i, line in enumerate(lines) if _FRAME.match(line)), default=None)
    for line in lines[last_frame + 1 :] if last_frame is not None else ():
        if line.strip() and not line[0].isspace():
            return line.strip()
    rest = [line for line in lines if line.strip()]
    return rest[-1].strip() if rest else "an exception"


def _describe(state: _RankState, plan: Plan) -> str:
    """First line: what happened, on which rank, in which check; then the traceback or stacks."""
    text, rank = state.stacks, state.rank
    where = f" in check {state.check}" if state.check else ""
    kind = _kind(text)
    at = innermost_frame(text)
    where += f" at {at}" if at else ""
    if kind == "raised":
        _, _, trace = text.partition("\n")
        return f"rank {rank} raised {_exception_line(trace)}{where}\n{_tail(trace)}"
    if kind == "timed out":
        return (
            f"rank {rank} timed out{where}: still running after --timeout {plan.timeout_s:.0f} s; "
            f"its threads' stacks (most recent call first):\n{_head(text)}"
        )
    if kind == "died":
        return f"rank {rank} died{where}: {text.splitlines()[0]}\n{_head(text)}"
    if kind == "was killed":
        return f"rank {rank} was killed{where}: {text.removeprefix('Killed: ')}"
    return f"rank {rank} was terminated{where}; its stacks (most recent call first):\n{_head(text)}"


_FAILURE = re.compile(r"^\s*rank\s*:\s*(?P<rank>\d+)[^\n]*\n(?:[^\n]*\n)*?\s*exitcode\s*:\s*(?P<code>-?\d+)", re.M)


def torchrun_failures(log_text: str) -> dict[int, int]:
    """``{rank: exit code}`` of every failure in torchrun's summary (negative: killed by that signal)."""
    return {int(m["rank"]): int(m["code"]) for m in _FAILURE.finditer(log_text)}


def _signal_name(code: int) -> str:
    try:
        return f"signal {-code} ({signal.Signals(-code).name})"
    except ValueError:
        return f"signal {-code}"


def _silent_root_cause(directory: Path, states: list[_RankState]) -> _RankState | None:
    """A rank that a signal ended without a word (SIGKILL, the OOM killer): no stacks of its own, and torchrun
    saw it die of a signal it did not send itself (torchrun ends the survivors with SIGTERM)."""
    log = directory / "torchrun.log"
    failures = torchrun_failures(log.read_text(errors="replace")) if log.exists() else {}
    silent = sorted(
        rank
        for rank, code in failures.items()
        if code < 0 and code != -signal.SIGTERM and 0 <= rank < len(states) and not states[rank].stacks
    )
    if not silent:
        return None
    state = states[silent[0]]
    text = (
        f"Killed: rank {state.rank} ended by {_signal_name(failures[state.rank])} without a traceback or "
        f"stacks of its own (a signal Python cannot catch: kill -9, or the kernel's out-of-memory killer)"
    )
    return dataclasses.replace(state, stacks=text, stacks_mtime=-math.inf)


def diagnose(
    directory: Path, *, world_size: int, plan: Plan, returncode: int | None, killed: bool, done: set[tuple[int, str]]
) -> Crash:
    """Explain a failed attempt from the ranks' files and torchrun's summary."""
    states = [_rank_state(directory, rank, plan) for rank in range(world_size)]
    rss = tuple(s.peak_rss_mb for s in states)
    silent = _silent_root_cause(directory, states)
    if silent is not None:
        states[silent.rank] = silent
    culprits = sorted((s for s in states if s.stacks), key=lambda s: (_is_victim(s.stacks), s.stacks_mtime))
    placed = [(s.index, s) for s in states if s.index is not None]
    primary = culprits[0] if culprits else None
    if not placed:
        why = _describe(primary, plan) if primary else f"torchrun exited with code {returncode}"
        return Crash(
            index=plan.start,
            check=None,
            fatal=True,
            peak_rss_mb=rss,
            message=f"no rank got past start-up (runtime init): {why}\nfiles: {directory}",
        )
    if primary is not None and primary.index is not None:
        at, where = primary.index, primary
    else:
        at, where = min(placed, key=lambda pair: pair[0])
    index = min(at, len(plan.scenarios) - 1)
    parts = []
    if killed:
        parts.append(
            f"the group was killed at the parent's overall deadline (no rank's watchdog fired); "
            f"torchrun exit code {returncode}"
        )
    if primary is not None:
        parts.append(_describe(primary, plan))
    elif not killed:
        parts.append(
            f"torchrun exited with code {returncode} and no rank wrote an error "
            f"(killed by a signal, or out of memory?); see {directory / 'torchrun.log'}"
        )
    if culprits[1:]:
        parts.append(
            "then: "
            + "; ".join(
                f"rank {s.rank} {_kind(s.stacks)} at {innermost_frame(s.stacks) or '?'} (rank{s.rank}.stacks.txt)"
                for s in culprits[1:]
            )
        )
    parts.append(f"files: {directory}")
    seconds = 0.0
    if where.started_t is not None and where.check is not None:
        end_t = where.stacks_mtime if math.isfinite(where.stacks_mtime) else where.started_t
        seconds = max(0.0, end_t - where.started_t)
    return Crash(index=index, check=where.check, message="\n".join(parts), seconds=seconds, peak_rss_mb=rss)
