"""One rank of a torchrun group: runs ``plan.scenarios[plan.start:]`` and reports through files.

Run as ``python -m moeverify.runner.worker ATTEMPT_DIR/plan.json`` under torchrun. Imports and
process groups are paid once; model-parallel state is re-initialised per scenario. A check that
raises on this rank, or a scenario that outlives the plan's timeout, ends the rank hard
(``os._exit``) after writing its traceback or every thread's stack to ``rank{R}.stacks.txt``, so
torchrun tears the group down and the parent restarts it from the next scenario.
"""

from __future__ import annotations

import faulthandler
import gc
import os
import resource
import signal
import sys
import time
import traceback
from pathlib import Path

from moeverify.oracles.context import CheckContext
from moeverify.oracles.results import CheckRecord, Tally
from moeverify.runner.lifetime import die_with_parent
from moeverify.runner.plan import Plan, append_line, events_path, results_path, stacks_path
from moeverify.spec import checks, timeouts
from moeverify.spec.scenario import Scenario

EXIT_RAISED = 3  # a check raised on this rank (a faulthandler timeout exits 1)


def peak_rss_mb() -> float:
    """This process's peak resident set size so far, in MiB.

    Linux's ``VmHWM`` (``/proc/self/status``, KiB) is this process's own high-water mark, reset at exec.
    ``ru_maxrss`` is only the fallback: on Linux a child starts with its parent's figure, so a rank forked
    from a large launcher would report the launcher's peak.
    """
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return round(int(line.split()[1]) / 1024, 1)
    except (OSError, ValueError, IndexError):
        pass
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)


def peak_gpu_mb() -> float | None:
    """The most GPU memory this process's tensors have held so far (``torch.cuda.max_memory_allocated``), in MiB;
    None where CUDA was never initialised (CPU ranks)."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        return None
    return round(torch.cuda.max_memory_allocated() / 2**20, 1)


class _Rank:
    """This rank's files and its watchdog."""

    def __init__(self, directory: Path, rank: int, timeout_s: float):
        self.directory, self.rank, self.timeout_s = directory, rank, timeout_s
        self.stacks = open(stacks_path(directory, rank), "a", encoding="utf-8")  # noqa: SIM115 (kept open)
        faulthandler.enable(file=self.stacks, all_threads=True)  # segfaults and aborts land here too
        # torchrun ends the other ranks with SIGTERM when one fails: their stacks show where they waited.
        faulthandler.register(signal.SIGTERM, file=self.stacks, all_threads=True, chain=True)

    def arm(self, timeout_s: float | None = None) -> None:
        """Dump every thread's stack and exit if the current scenario outlives the timeout."""
        faulthandler.dump_traceback_later(timeout_s or self.timeout_s, repeat=False, file=self.stacks, exit=True)

    def disarm(self) -> None:
        faulthandler.cancel_dump_traceback_later()

    def event(self, kind: str, **data) -> None:
        append_line(
            events_path(self.directory, self.rank),
            {"event": kind, "t": time.time(), "peak_rss_mb": peak_rss_mb(), "peak_gpu_mb": peak_gpu_mb(), **data},
        )

    def die(self, where: str) -> None:
        """Write the active exception's traceback and end the process without cleanup."""
        self.stacks.write(f"moeverify: rank {self.rank} raised {where}\n{traceback.format_exc()}")
        self.stacks.flush()
        os.fsync(self.stacks.fileno())
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(EXIT_RAISED)


def _tallies(result: object, check: str) -> dict[str, Tally]:
    if not isinstance(result, dict) or not all(isinstance(t, Tally) for t in result.values()):
        raise TypeError(f"check {check!r} must return dict[str, Tally], got {type(result).__name__}")
    return result


def _run_check(me: _Rank, ctx: CheckContext, *, index: int, check: str, total: int) -> None:
    scenario = ctx.scenario
    me.event("start", index=index, check=check)
    t0 = time.perf_counter()
    try:
        tallies = _tallies(checks.resolve(check)(ctx), check)
    except BaseException:  # noqa: BLE001 (any escape ends the rank; the parent reports it)
        me.die(f"in scenario {scenario.name} check {check}")
    seconds = time.perf_counter() - t0
    me.event("end", index=index, check=check, seconds=seconds)
    if me.rank == 0:
        spec = checks.CHECKS.get(check)  # tests add checks of their own, with no options declared
        decisions = spec.options.from_options(ctx.options).decisions() if spec is not None else {}
        record = CheckRecord.from_tallies(
            scenario=scenario.name, check=check, seconds=seconds, tallies=tallies, decisions=decisions
        )
        append_line(results_path(me.directory), {"index": index, "record": record.as_dict()})
        verdict = "PASS" if record.passed else "FAIL"
        print(f"[moeverify] {index + 1}/{total} {scenario.name} {check}: {verdict} ({seconds:.1f}s)", flush=True)


def _run_scenario(me: _Rank, runtime, scenario: Scenario, *, index: int, plan: Plan) -> None:
    options = {**scenario.options, **plan.options}
    me.event("scenario", index=index)
    with runtime.parallel(scenario.layout, seed=scenario.seed):
        ctx = CheckContext(
            scenario=scenario,
            rank=me.rank,
            world_size=scenario.world_size,
            backend=plan.backend,
            options=options,
            timeout_s=plan.timeout_s,
        )
        for check in scenario.checks:
            _run_check(me, ctx, index=index, check=check, total=len(plan.scenarios))
        del ctx
    gc.collect()
    me.event("scenario_end", index=index)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    plan_file = Path(argv[0])
    plan = Plan.read(plan_file)
    rank = int(os.environ.get("RANK", "0"))
    die_with_parent(signal.SIGKILL)  # torchrun gone (killed with its parent): nothing to report to
    me = _Rank(plan_file.parent, rank, plan.timeout_s)
    me.arm(max(plan.timeout_s, timeouts.STARTUP_S))
    try:
        from moeverify import runtime  # lazy: torch

        runtime.init(plan.backend)  # collective timeouts: runtime.DEFAULT_TIMEOUT_S
    except BaseException:  # noqa: BLE001
        me.die("in runtime.init")
    me.event("ready")
    for index in range(plan.start, len(plan.scenarios)):
        me.arm()
        try:
            _run_scenario(me, runtime, plan.scenarios[index], index=index, plan=plan)
        except BaseException:  # noqa: BLE001 (parallel() setup or teardown raised)
            me.die(f"in scenario {plan.scenarios[index].name} (setup/teardown)")
        me.disarm()
    me.event("done")
    _shutdown(me)
    return 0


def _shutdown(me: _Rank) -> None:
    import torch.distributed as dist  # lazy: torch

    me.arm()  # a teardown that hangs is killed too
    try:
        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()
    finally:
        me.disarm()


if __name__ == "__main__":
    sys.exit(main())
