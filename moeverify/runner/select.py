"""Which scenarios a run executes, on which backend, and which are skipped: decided before any work.

Everything here is pure (no torch import) so that option conflicts and impossible requests are
rejected in a fraction of a second, with the fix.
"""

from __future__ import annotations

import dataclasses
import fnmatch
from collections.abc import Callable, Iterator, Mapping, Sequence

from moeverify.errors import UsageError
from moeverify.runner import probe
from moeverify.runner.report import Result
from moeverify.spec import plugins
from moeverify.spec.options import OPTIONS
from moeverify.spec.scenario import CPU_MAX_WORLD_SIZE, Scenario, group_by_world_size


def select(scenarios: Sequence[Scenario], *, filters: Sequence[str] = (), check: str | None = None) -> list[Scenario]:
    """Scenarios whose name matches any ``filters`` glob, narrowed to ``check`` when given."""
    chosen = [s for s in scenarios if not filters or any(fnmatch.fnmatchcase(s.name, g) for g in filters)]
    if not chosen:
        raise UsageError(
            f"--filter {' '.join(filters)} matches none of the {len(scenarios)} scenarios; "
            "`moeverify run --list` shows their names"
        )
    if check is None:
        return chosen
    narrowed = [dataclasses.replace(s, checks=(check,)) for s in chosen if check in s.checks]
    if not narrowed:
        raise UsageError(
            f"--check {check}: none of the {len(chosen)} selected scenarios runs {check!r}; "
            "`moeverify run --list` shows each scenario's checks"
        )
    return narrowed


def check_option_use(scenarios: Sequence[Scenario], options: dict) -> None:
    """Reject a command-line option that no selected check reads (it would be silently ignored)."""
    checks = {c for s in scenarios for c in s.checks}
    for key, value in options.items():
        option = OPTIONS[key]
        flag = option.flag_for(value)
        if value is not None and option.check not in checks:
            raise UsageError(
                f"{flag} applies to the {option.check} check, which none of the selected scenarios "
                f"runs; drop {flag} or select {option.check} (e.g. --check {option.check})"
            )


def _plugin_uses(scenarios: Sequence[Scenario], options: dict) -> Iterator[tuple[str, str, Mapping[str, str]]]:
    """``(spec, what, builtins)`` of every plugin option (subject, receiver, replay implementation) the selected
    scenarios' checks read, once each."""
    plugin_options = [(o, plugin) for o in OPTIONS.values() if (plugin := o.plugin)]
    seen = set()
    for s in scenarios:
        merged = {**s.options, **{k: v for k, v in options.items() if v is not None}}
        for option, (what, builtins) in plugin_options:
            spec = merged.get(option.name)
            if spec is None or (option.name, spec) in seen or option.check not in s.checks:
                continue
            seen.add((option.name, spec))
            yield spec, what, builtins


def check_plugins(scenarios: Sequence[Scenario], options: dict) -> None:
    """Refuse, before torchrun starts, a plugin option (subject, receiver, replay implementation) that cannot load:
    read without running it (``plugins.check``: a fraction of a second, also for ``--list``)."""
    for spec, what, builtins in _plugin_uses(scenarios, options):
        plugins.check(spec, what=what, builtins=builtins)


def probe_plugins(scenarios: Sequence[Scenario], options: dict, *, say=print) -> None:
    """Refuse, before torchrun starts, a user's plugin whose loading raises on a rank (its import raises, its
    attribute is not callable): each one loaded in a child Python (``moeverify.runner.probe``; built-ins skipped)."""
    for spec, what, builtins in _plugin_uses(scenarios, options):
        if spec not in builtins:
            say(f"loading {what} {spec} as a rank would, before any rank starts ...", flush=True)
            probe.probe(spec, what=what, builtins=builtins)


@dataclasses.dataclass(frozen=True, kw_only=True)
class GroupPlan:
    """One world size: its backend and the scenarios that will run."""

    world_size: int
    backend: str
    scenarios: tuple[Scenario, ...]


def plan_backends(
    scenarios: Sequence[Scenario], *, backend: str, gpu_count: int, per_node: Callable[[int], int] = lambda world: world
) -> tuple[list[GroupPlan], list[Result], list[str]]:
    """Groups to run, skipped results (GPU-only scenarios on CPU ranks), and notices to print.

    ``backend`` is the request (cpu, cuda or auto). auto runs a group on GPUs when there is one per
    rank, else on CPU ranks; cuda with fewer GPUs than ranks is refused up front. ``per_node``: how many of
    a group's ranks one node runs (several nodes), which is what this node's GPUs and CPU limit are held to.
    """
    if backend == "cuda" and gpu_count == 0:
        raise UsageError("--backend cuda: torch sees no GPU here; use --backend cpu (or auto)")
    groups, skipped, notices = [], [], []
    for world, members in group_by_world_size(scenarios).items():
        chosen = _group_backend(per_node(world), backend=backend, gpu_count=gpu_count)
        if chosen == "cpu" and backend == "auto" and gpu_count:
            notices.append(
                f"world size {world}: {gpu_count} GPU(s) visible, fewer than {world} ranks: running on CPU ranks (gloo)"
            )
        runnable = []
        for scenario in members:
            if scenario.unfit:
                skipped += [
                    Result.skip(scenario=scenario.name, check=c, reason=scenario.unfit) for c in scenario.checks
                ]
            elif chosen == "cpu" and scenario.gpu_only:
                skipped += [
                    Result.skip(scenario=scenario.name, check=c, reason=f"gpu only: {scenario.gpu_only}")
                    for c in scenario.checks
                ]
            else:
                runnable.append(scenario)
        if runnable:
            groups.append(GroupPlan(world_size=world, backend=chosen, scenarios=tuple(runnable)))
    return groups, skipped, notices


def _group_backend(world: int, *, backend: str, gpu_count: int) -> str:
    if backend == "cuda":
        if world > gpu_count:
            raise UsageError(
                f"--backend cuda: scenarios of world size {world} need {world} GPUs, this machine has "
                f"{gpu_count}; use --backend auto to run them on CPU ranks, or --filter to drop them"
            )
        return "cuda"
    if backend == "auto" and 0 < world <= gpu_count:
        return "cuda"
    if world > CPU_MAX_WORLD_SIZE:
        raise UsageError(f"world size {world} exceeds the {CPU_MAX_WORLD_SIZE} CPU ranks a run may start")
    return "cpu"
