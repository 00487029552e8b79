"""The parent side of ``moeverify run``: one torchrun per world size, restarted after a crash or hang.

For a group, an *attempt* runs ``scenarios[start:]`` in one torchrun. If a rank raises, hangs past
``--timeout`` or dies, the ranks' files (``plan``) say where; that scenario is recorded as crashed
with the rank and its traceback or stacks, and a new attempt starts from the next scenario. The
parent also holds a deadline (no progress from rank 0 for --timeout plus grace) and kills torchrun's
whole process group past it.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import moeverify
from moeverify.oracles.results import CheckRecord
from moeverify.runner import interrupts, nodes
from moeverify.runner.diagnose import Crash, diagnose
from moeverify.runner.lifetime import die_with_parent
from moeverify.runner.plan import Plan, events_path, read_lines, results_path
from moeverify.runner.report import Result
from moeverify.spec import timeouts
from moeverify.spec.scenario import Scenario

POLL_S = 0.5


def __getattr__(name: str) -> float:
    """``STARTUP_SLACK_S`` (past the ranks' own start-up watchdog: theirs fires first): the public name of
    ``timeouts.STARTUP_SLACK_S``, read when used (never at import)."""
    if name == "STARTUP_SLACK_S":
        return timeouts.STARTUP_SLACK_S
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class GroupSpec:
    """One world size's scenarios and how to run them."""

    world_size: int
    scenarios: tuple[Scenario, ...]
    backend: str  # resolved: "cpu" | "cuda"
    options: dict[str, Any]
    timeout_s: float
    run_dir: Path
    verbose: bool = False
    cluster: Cluster | None = None  # several nodes: this is node 0, the one that reports


class Cluster:
    """Node 0's side of a several-node run: the control store and the count of multi-node launches."""

    def __init__(self, node: nodes.NodeSpec, control: nodes.Control):
        self.node, self.control = node, control
        self.launches = 0
        self.lost: str | None = None  # set once a node is gone: later multi-node groups cannot run

    def finish(self, exit_code: int) -> None:
        """Tell the other nodes to stop with ``exit_code``; wait (briefly) until they have read it."""
        self.control.put(f"launch/{self.launches}", {"done": True, "exit": exit_code})
        deadline = time.monotonic() + 10.0
        for rank in range(1, self.node.nnodes):
            while not self.control.store.check([f"bye/{rank}"]) and time.monotonic() < deadline:
                time.sleep(0.1)
        self.control.close()


def torchrun_command(
    *, world_size: int, plan_file: Path, node: nodes.NodeSpec | None = None, launch: int = 0
) -> list[str]:
    """torchrun for one attempt, no elastic restarts: a local c10d rendezvous on a free port; or, spread over
    several nodes, a static rendezvous (node R holds global ranks R*k..) at node 0's launch port."""
    if node is not None and node.runs_everywhere(world_size):
        where = [
            "--nnodes",
            str(node.nnodes),
            "--node-rank",
            str(node.node_rank),
            "--nproc-per-node",
            str(node.per_node(world_size)),
            "--rdzv-backend",
            "static",
            "--master-addr",
            node.host,
            "--master-port",
            str(node.launch_port(launch)),
        ]
    else:
        where = ["--nproc-per-node", str(world_size), "--rdzv-backend", "c10d", "--rdzv-endpoint", "localhost:0"]
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        *where,
        "--max-restarts",
        "0",
        "--monitor-interval",
        "0.2",
        "-m",
        "moeverify.runner.worker",
        str(plan_file),
    ]


def _child_env(world_size: int) -> dict[str, str]:
    env = dict(os.environ)
    root = str(Path(moeverify.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // world_size)))
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def _kill_group(proc: subprocess.Popen) -> None:
    for sig, wait_s in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


class _Collector:
    """Follows an attempt's files: rank 0's records as they appear, and the check rank 0 is in."""

    def __init__(
        self,
        directory: Path,
        world_size: int,
        *,
        on_result: Callable[[Result], None],
        on_start: Callable[[int, str], None] | None = None,
    ):
        self.directory, self.world_size = directory, world_size
        self.on_result, self.on_start = on_result, on_start
        self.records: dict[tuple[int, str], CheckRecord] = {}
        self._current: tuple[int, str] | None = None
        self.last_progress = time.monotonic()  # when rank 0 last started a check or wrote a record

    @property
    def seen(self) -> set[tuple[int, str]]:
        return set(self.records)

    def poll(self) -> None:
        for line in read_lines(results_path(self.directory)):
            key = (line["index"], line["record"]["check"])
            if key not in self.records:
                self.records[key] = CheckRecord.from_dict(line["record"])
                self.last_progress = time.monotonic()
                self.on_result(Result(record=self.records[key]))
        starts = [e for e in read_lines(events_path(self.directory, 0)) if e.get("event") == "start"]
        if starts and (starts[-1]["index"], starts[-1]["check"]) != self._current:
            self._current = (starts[-1]["index"], starts[-1]["check"])
            self.last_progress = time.monotonic()
            if self.on_start is not None:
                self.on_start(*self._current)

    def results(self) -> list[Result]:
        """Every record so far with each rank's peak RSS at the end of that check (read once ranks are done)."""
        ends: dict[tuple[int, str, int], float] = {}
        gpu: dict[tuple[int, str, int], float] = {}
        for rank in range(self.world_size):
            for e in read_lines(events_path(self.directory, rank)):
                if e.get("event") == "end":
                    ends[e["index"], e["check"], rank] = e["peak_rss_mb"]
                    if e.get("peak_gpu_mb") is not None:
                        gpu[e["index"], e["check"], rank] = e["peak_gpu_mb"]
        ranks = range(self.world_size)
        return [
            Result(
                record=record,
                peak_rss_mb=tuple(ends.get((*key, r), float("nan")) for r in ranks),
                peak_gpu_mb=tuple(gpu.get((*key, r), float("nan")) for r in ranks)
                if any((*key, r) in gpu for r in ranks)
                else (),
            )
            for key, record in self.records.items()
        ]


def _spread(spec: GroupSpec) -> Cluster | None:
    """The cluster ``spec`` runs spread over; None where it runs on this node alone."""
    if spec.cluster is not None and spec.cluster.node.runs_everywhere(spec.world_size):
        return spec.cluster
    return None


def _attempt(spec: GroupSpec, plan: Plan, directory: Path, collector: _Collector) -> tuple[int, bool]:
    """Run one torchrun; returns (exit code, killed by the parent's deadline).

    The deadline is a backstop behind the ranks' own watchdogs: start-up slack, then --timeout (plus
    grace) after rank 0 last made progress. Spread over several nodes, the other nodes are told first.
    """
    plan_file = plan.write(directory)
    node, launch = None, 0
    cluster = _spread(spec)
    if cluster is not None:
        node, launch = cluster.node, cluster.launches
        cluster.launches += 1
        cluster.control.put(
            f"launch/{launch}",
            {"world_size": spec.world_size, "start": plan.start, "backend": plan.backend, "attempt": directory.name},
        )
    startup_deadline = time.monotonic() + timeouts.STARTUP_SLACK_S
    log = None if spec.verbose else open(directory / "torchrun.log", "w")  # noqa: SIM115
    try:
        proc = subprocess.Popen(
            torchrun_command(world_size=spec.world_size, plan_file=plan_file, node=node, launch=launch),
            env=_child_env(node.per_node(spec.world_size) if node else spec.world_size),
            stdout=log,
            stderr=subprocess.STDOUT if log else None,
            start_new_session=True,
            preexec_fn=die_with_parent,
        )
        try:
            while proc.poll() is None:
                collector.poll()
                deadline = max(startup_deadline, collector.last_progress + spec.timeout_s + timeouts.LAUNCH_GRACE_S)
                if time.monotonic() > deadline:
                    _kill_group(proc)
                    collector.poll()
                    return proc.returncode, True
                interrupts.check()  # Ctrl-C lands here, outside any lock a progress line holds
                time.sleep(POLL_S)
        except BaseException:
            _kill_group(proc)
            raise
        collector.poll()
        return proc.returncode, False
    finally:
        if log is not None:
            log.close()
        if cluster is not None:
            _gather_nodes(cluster, launch, directory)


def _gather_nodes(cluster: Cluster, launch: int, directory: Path) -> None:
    """The other nodes' rank files into node 0's attempt directory; a node that did not report is lost."""
    missing = cluster.control.collect_reports(launch, directory)
    dead = cluster.control.dead_nodes()
    lost = sorted(set(dead) | {rank for rank, _ in missing})
    if lost:
        why = dict(missing)
        cluster.lost = "; ".join(f"node {r} lost: {why.get(r, 'it stopped responding')}" for r in lost)


def _crashed_results(spec: GroupSpec, crash: Crash, done: set[tuple[int, str]]) -> list[Result]:
    """The crashed check gets the rank's error; the scenario's checks after it are marked not run."""
    scenario = spec.scenarios[crash.index]
    pending = [c for c in scenario.checks if (crash.index, c) not in done]
    culprit = crash.check if crash.check in pending else (pending[0] if pending else "(teardown)")
    out = []
    for check in pending or [culprit]:
        if check == culprit:
            record = CheckRecord.crashed(
                scenario=scenario.name, check=check, seconds=crash.seconds, error=crash.message
            )
        else:
            record = CheckRecord.crashed(
                scenario=scenario.name,
                check=check,
                seconds=0.0,
                error=f"not run: the scenario crashed in check {culprit}",
            )
        out.append(Result(record=record, peak_rss_mb=crash.peak_rss_mb))
    return out


def run_group(
    spec: GroupSpec, *, on_result: Callable[[Result], None], on_start: Callable[[Scenario, str], None] | None = None
) -> list[Result]:
    """Run every scenario of one world size; a crash or hang costs one scenario, not the group.

    ``on_result`` sees each result as it arrives (for progress; peak RSS is filled in the returned
    list), ``on_start`` the scenario and check rank 0 starts.
    """
    results: list[Result] = []
    cluster = _spread(spec)
    if cluster is not None and cluster.lost:
        lost = _not_run(spec.scenarios, why=cluster.lost)
        for result in lost:
            on_result(result)
        return lost
    start, attempt = 0, 0
    while start < len(spec.scenarios):
        attempt += 1
        directory = spec.run_dir / f"world{spec.world_size}" / f"attempt{attempt}"
        directory.mkdir(parents=True, exist_ok=True)
        plan = Plan(
            scenarios=spec.scenarios, options=spec.options, backend=spec.backend, timeout_s=spec.timeout_s, start=start
        )
        started = None if on_start is None else (lambda index, check: on_start(spec.scenarios[index], check))
        collector = _Collector(directory, spec.world_size, on_result=on_result, on_start=started)
        rc, killed = _attempt(spec, plan, directory, collector)
        results += collector.results()
        if rc == 0 and not killed and _all_done(spec, collector.seen, start):
            break
        crash = diagnose(
            directory, world_size=spec.world_size, plan=plan, returncode=rc, killed=killed, done=collector.seen
        )
        if cluster is not None and cluster.lost:  # the group cannot run again without that node
            crash = dataclasses.replace(crash, fatal=True, message=f"{cluster.lost}\n{crash.message}")
        lost = _crashed_results(spec, crash, collector.seen)
        if crash.fatal:  # nothing ran: the next attempt would fail the same way
            lost += _not_run(spec.scenarios[crash.index + 1 :], why=crash.message.splitlines()[0])
        for result in lost:
            on_result(result)
        results += lost
        if crash.fatal:
            break
        start = crash.index + 1
    return results


def _not_run(scenarios: Sequence[Scenario], *, why: str) -> list[Result]:
    return [
        Result(record=CheckRecord.crashed(scenario=s.name, check=c, seconds=0.0, error=f"not run: {why}"))
        for s in scenarios
        for c in s.checks
    ]


def _all_done(spec: GroupSpec, seen: set[tuple[int, str]], start: int) -> bool:
    return all((i, c) in seen for i in range(start, len(spec.scenarios)) for c in spec.scenarios[i].checks)


def follow(node: nodes.NodeSpec, control: nodes.Control, groups: Sequence[GroupSpec]) -> int:
    """Node R > 0: run this node's share of every torchrun node 0 announces; node 0's exit code at the end."""
    by_world = {g.world_size: g for g in groups}
    launch = 0
    try:
        while True:
            msg = control.get(f"launch/{launch}", timeout_s=float("inf"), watch=0)
            if msg.get("done"):
                return int(msg["exit"])
            spec = by_world[msg["world_size"]]
            directory = spec.run_dir / f"world{spec.world_size}" / msg["attempt"]
            directory.mkdir(parents=True, exist_ok=True)
            plan = Plan(
                scenarios=spec.scenarios,
                options=spec.options,
                backend=msg["backend"],
                timeout_s=spec.timeout_s,
                start=int(msg["start"]),
            )
            plan_file = plan.write(directory)
            with open(directory / "torchrun.log", "w") as log:
                proc = subprocess.Popen(
                    torchrun_command(world_size=spec.world_size, plan_file=plan_file, node=node, launch=launch),
                    env=_child_env(node.per_node(spec.world_size)),
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                    preexec_fn=die_with_parent,
                )
                try:
                    proc.wait()
                except BaseException:
                    _kill_group(proc)
                    raise
            k = node.per_node(spec.world_size)
            control.put(
                f"report/{launch}/{node.node_rank}",
                nodes.report_files(directory, range(node.node_rank * k, node.node_rank * k + k)),
            )
            launch += 1
    finally:
        try:
            control.put(f"bye/{node.node_rank}", True)
        except Exception:  # noqa: BLE001 (node 0 is gone already)
            pass
        control.close()
