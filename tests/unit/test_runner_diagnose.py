"""Crash diagnosis from synthetic rank files, the plan file, and the parent's crash records."""

from __future__ import annotations

import dataclasses
import os
import signal
import sys
import time
import types

import pytest
from waiting import SLOW_HOST_S, alive, wait_for

from moeverify.runner import launch
from moeverify.runner.diagnose import diagnose, innermost_frame
from moeverify.runner.plan import Plan, append_line, events_path, read_lines, results_path, stacks_path
from moeverify.spec.layout import Layout
from moeverify.spec.scenario import Scenario

SCENARIOS = (
    Scenario(family="qwen2", layout=Layout(tp=2), world_size=2, checks=("roundtrip", "export")),
    Scenario(
        family="qwen2", layout=Layout(pp=2), world_size=2, checks=("roundtrip", "export"), options={"subject": "bridge"}
    ),
)
PLAN = Plan(scenarios=SCENARIOS, options={"replay_impl": "native"}, backend="cpu", timeout_s=30.0)

RAISED = """moeverify: rank 1 raised in scenario qwen2/pp2 check export
Traceback (most recent call last):
  File "/x/moeverify/runner/worker.py", line 77, in _run_check
    tallies = run(ctx)
  File "/x/moeverify/oracles/export.py", line 12, in run
    raise ValueError("bad row")
ValueError: bad row
"""
TIMEOUT = """Timeout (0:00:30)!
Thread 0x00007f (most recent call first):
  File "/v/site-packages/torch/distributed/distributed_c10d.py", line 6371 in barrier
  File "/x/moeverify/oracles/export.py", line 40 in _merge
  File "/x/moeverify/runner/worker.py", line 77 in _run_check
"""


def _events(directory, rank, *events):
    for kind, data in events:
        append_line(events_path(directory, rank), {"event": kind, "t": time.time(), "peak_rss_mb": 10.0 + rank, **data})


def _stacks(directory, rank, text, *, age_s=0.0):
    path = stacks_path(directory, rank)
    path.write_text(text)
    t = time.time() - age_s
    os.utime(path, (t, t))


def _in_check(directory, rank, index, check):
    _events(directory, rank, ("ready", {}), ("scenario", {"index": index}), ("start", {"index": index, "check": check}))


def test_plan_write_read_round_trip(tmp_path):
    PLAN.write(tmp_path)
    assert Plan.read(tmp_path / "plan.json") == PLAN


def test_read_lines_ignores_torn_last_line(tmp_path):
    path = results_path(tmp_path)
    append_line(path, {"a": 1})
    with open(path, "a") as f:
        f.write('{"b": ')
    assert list(read_lines(path)) == [{"a": 1}]


def test_diagnose_earliest_stacks_file_names_rank_and_check(tmp_path):
    for rank in (0, 1):
        _in_check(tmp_path, rank, 1, "export")
    _stacks(tmp_path, 1, RAISED, age_s=2.0)
    _stacks(tmp_path, 0, TIMEOUT)
    crash = diagnose(tmp_path, world_size=2, plan=PLAN, returncode=1, killed=False, done=set())
    assert (crash.index, crash.check, crash.fatal) == (1, "export", False)
    first = crash.message.splitlines()[0]
    assert first == "rank 1 raised ValueError: bad row in check export at export.py:12 in run"
    assert "then: rank 0 timed out at export.py:40 in _merge (rank0.stacks.txt)" in crash.message
    assert crash.peak_rss_mb == (10.0, 11.0)


def test_diagnose_timeout_reports_stacks_most_recent_first(tmp_path):
    _in_check(tmp_path, 0, 0, "roundtrip")
    _stacks(tmp_path, 0, TIMEOUT)
    crash = diagnose(tmp_path, world_size=1, plan=PLAN, returncode=1, killed=False, done=set())
    assert crash.message.startswith(
        "rank 0 timed out in check roundtrip at export.py:40 in _merge: still running after --timeout 30 s"
    )
    assert "line 6371 in barrier" in crash.message


def test_diagnose_silent_death_points_to_log(tmp_path):
    _in_check(tmp_path, 0, 0, "roundtrip")
    crash = diagnose(tmp_path, world_size=1, plan=PLAN, returncode=-9, killed=False, done=set())
    assert (crash.index, crash.check) == (0, "roundtrip")
    assert "torchrun exited with code -9 and no rank wrote an error" in crash.message


def test_diagnose_parent_deadline_is_said(tmp_path):
    _in_check(tmp_path, 0, 1, "roundtrip")
    crash = diagnose(tmp_path, world_size=1, plan=PLAN, returncode=-15, killed=True, done=set())
    assert crash.message.startswith("the group was killed at the parent's overall deadline")


def test_diagnose_crash_in_setup_has_no_check(tmp_path):
    _events(
        tmp_path,
        0,
        ("ready", {}),
        ("scenario", {"index": 0}),
        ("start", {"index": 0, "check": "roundtrip"}),
        ("end", {"index": 0, "check": "roundtrip"}),
        ("start", {"index": 0, "check": "export"}),
        ("end", {"index": 0, "check": "export"}),
        ("scenario_end", {"index": 0}),
    )
    crash = diagnose(tmp_path, world_size=1, plan=PLAN, returncode=1, killed=False, done=set())
    assert (crash.index, crash.check) == (1, None)


def test_diagnose_no_rank_started_is_fatal(tmp_path):
    _stacks(tmp_path, 0, RAISED.replace("export", "init"))
    crash = diagnose(tmp_path, world_size=2, plan=PLAN, returncode=1, killed=False, done=set())
    assert crash.fatal and crash.index == 0
    assert crash.message.startswith("no rank got past start-up (runtime init): rank 0 raised ValueError: bad row")


def test_innermost_frame_prefers_own_code():
    assert innermost_frame(TIMEOUT) == "export.py:40 in _merge"
    assert innermost_frame(RAISED) == "export.py:12 in run"
    assert innermost_frame("no frames") == ""


def _spec(tmp_path):
    return launch.GroupSpec(
        world_size=2, scenarios=SCENARIOS, backend="cpu", options={}, timeout_s=30.0, run_dir=tmp_path
    )


def test_crashed_results_mark_culprit_and_not_run(tmp_path):
    crash = launch.Crash(index=0, check="roundtrip", message="rank 1 raised X", seconds=1.5)
    got = launch._crashed_results(_spec(tmp_path), crash, done=set())
    assert [(r.record.check, r.record.error, r.record.seconds) for r in got] == [
        ("roundtrip", "rank 1 raised X", 1.5),
        ("export", "not run: the scenario crashed in check roundtrip", 0.0),
    ]


def test_crashed_results_skip_checks_already_recorded(tmp_path):
    crash = launch.Crash(index=1, check=None, message="setup broke")
    got = launch._crashed_results(_spec(tmp_path), crash, done={(1, "roundtrip")})
    assert [(r.record.check, r.record.error) for r in got] == [("export", "setup broke")]


def test_crashed_results_after_every_check_is_a_teardown_record(tmp_path):
    done = {(0, "roundtrip"), (0, "export")}
    got = launch._crashed_results(_spec(tmp_path), launch.Crash(index=0, check=None, message="teardown hung"), done)
    assert [(r.record.check, r.record.error) for r in got] == [("(teardown)", "teardown hung")]


def test_torchrun_command_uses_local_c10d_and_no_restarts(tmp_path):
    cmd = launch.torchrun_command(world_size=4, plan_file=tmp_path / "plan.json")
    joined = " ".join(cmd)
    assert "-m torch.distributed.run --nproc-per-node 4 --rdzv-backend c10d --rdzv-endpoint localhost:0" in joined
    assert "--max-restarts 0" in joined and joined.endswith(f"-m moeverify.runner.worker {tmp_path / 'plan.json'}")


def test_collector_reports_records_once_and_fills_rss_per_rank(tmp_path):
    seen, starts = [], []
    collector = launch._Collector(tmp_path, 2, on_result=seen.append, on_start=lambda i, c: starts.append((i, c)))
    _in_check(tmp_path, 0, 0, "roundtrip")
    record = {
        "scenario": "qwen2/tp2-dp1",
        "check": "roundtrip",
        "passed": True,
        "seconds": 1.0,
        "subchecks": {"bitwise": {"passed": True, "checked": 1, "failures": []}},
    }
    append_line(results_path(tmp_path), {"index": 0, "record": record})
    _events(tmp_path, 0, ("end", {"index": 0, "check": "roundtrip"}))
    collector.poll()
    collector.poll()
    assert [r.record.check for r in seen] == ["roundtrip"] and starts == [(0, "roundtrip")]
    _events(tmp_path, 1, ("end", {"index": 0, "check": "roundtrip"}))  # rank 1 finishes after rank 0 wrote
    (result,) = collector.results()
    assert result.peak_rss_mb == (10.0, 11.0) and result.record.passed


@pytest.mark.timing
def test_attempt_kills_whole_group_that_makes_no_progress(tmp_path, monkeypatch):
    """A group that makes no progress for --timeout is killed, grandchildren too. The child's no-progress clock
    starts once it has started its grandchild and written the pid (however long a loaded host takes to get there:
    up to ``SLOW_HOST_S``), so the test does not bet on how fast a process starts."""
    pid_file = tmp_path / "grandchild.pid"
    child = (
        "import os, subprocess, sys, time; "
        "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); "
        f"open({str(pid_file)!r} + '.tmp', 'w').write(str(p.pid)); "
        f"os.replace({str(pid_file)!r} + '.tmp', {str(pid_file)!r}); time.sleep(600)"
    )
    monkeypatch.setattr(launch, "torchrun_command", lambda **_: [sys.executable, "-c", child])
    monkeypatch.setattr(launch, "timeouts", types.SimpleNamespace(STARTUP_SLACK_S=0.0, LAUNCH_GRACE_S=0.0))
    spec = dataclasses.replace(_spec(tmp_path), timeout_s=2.0)
    t0 = time.monotonic()

    class Started(launch._Collector):
        """Counts the time before the pid file appears as progress (up to ``SLOW_HOST_S``)."""

        ready_at = None

        def poll(self) -> None:
            super().poll()
            if self.ready_at is None and pid_file.exists():
                self.ready_at = self.last_progress = time.monotonic()
            elif self.ready_at is None and time.monotonic() - t0 < SLOW_HOST_S:
                self.last_progress = time.monotonic()

    collector = Started(tmp_path, 2, on_result=lambda r: None)
    rc, killed = launch._attempt(spec, PLAN, tmp_path, collector)
    assert collector.ready_at is not None, f"the child did not start its grandchild within {SLOW_HOST_S:.0f} s"
    # killed at its deadline (2 s after it was up), long before the child's own 600 s end
    assert killed and rc in (-signal.SIGTERM, -signal.SIGKILL) and time.monotonic() - collector.ready_at < SLOW_HOST_S
    grandchild = int(pid_file.read_text())
    wait_for(lambda: not alive(grandchild), what=f"process {grandchild} of the killed group ending")


def test_diagnose_rank_that_lost_its_peer_is_not_the_cause(tmp_path):
    for rank in (0, 1):
        _in_check(tmp_path, rank, 1, "export")
    victim = RAISED.replace(
        "ValueError: bad row", "RuntimeError: [pair.cc:561] Connection closed by peer [127.0.0.1]:5021"
    )
    _stacks(tmp_path, 0, victim, age_s=5.0)  # written first, yet only a consequence
    _stacks(tmp_path, 1, RAISED)
    crash = diagnose(tmp_path, world_size=2, plan=PLAN, returncode=1, killed=False, done=set())
    assert crash.message.startswith("rank 1 raised ValueError: bad row")


TERM_STACKS = """Thread 0x00007f (most recent call first):
  File "/v/site-packages/torch/distributed/distributed_c10d.py", line 4800 in barrier
  File "/x/moeverify/oracles/export.py", line 40 in _merge
"""
TORCHRUN_SIGKILL_SUMMARY = """torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
Failures:
[1]:
  rank      : 0 (local_rank: 0)
  exitcode  : -15 (pid: 12625)  (SIGTERM)
  traceback : Signal 15 (SIGTERM) received by PID 12625
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-12-01_13:51:56
  rank      : 1 (local_rank: 1)
  exitcode  : -9 (pid: 12626)  (SIGKILL)
  traceback : Signal 9 (SIGKILL) received by PID 12626
"""


TORCHRUN_VICTIM_FIRST = """Failures:
[1]:
  rank      : 1 (local_rank: 1)
  exitcode  : -9 (pid: 12626)  (SIGKILL)
  traceback : Signal 9 (SIGKILL) received by PID 12626
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  rank      : 0 (local_rank: 0)
  exitcode  : 3 (pid: 12625)
"""


def test_diagnose_rank_killed_without_a_word_is_named_with_its_signal(tmp_path):
    # SIGKILL leaves no stacks; the rank torchrun then SIGTERMs writes its stacks first. The root cause
    # in torchrun's summary names the killed rank, so blame goes there and not to the torn-down rank 0.
    _in_check(tmp_path, 0, 1, "export")
    _in_check(tmp_path, 1, 1, "export")
    _stacks(tmp_path, 0, TERM_STACKS)
    (tmp_path / "torchrun.log").write_text(TORCHRUN_SIGKILL_SUMMARY)
    crash = diagnose(tmp_path, world_size=2, plan=PLAN, returncode=1, killed=False, done=set())
    first = crash.message.splitlines()[0]
    assert first.startswith("rank 1 was killed in check export: rank 1 ended by signal 9 (SIGKILL)"), first
    assert "then: rank 0 was terminated" in crash.message
    assert (crash.index, crash.check) == (1, "export")


def test_diagnose_root_cause_that_explained_itself_keeps_its_traceback(tmp_path):
    _in_check(tmp_path, 1, 1, "export")
    _stacks(tmp_path, 1, RAISED)
    (tmp_path / "torchrun.log").write_text(TORCHRUN_SIGKILL_SUMMARY.replace("-9 (pid: 12626)  (SIGKILL)", "3 (pid: 1)"))
    crash = diagnose(tmp_path, world_size=2, plan=PLAN, returncode=1, killed=False, done=set())
    assert crash.message.startswith("rank 1 raised"), crash.message


def test_diagnose_torchrun_first_seeing_the_victim_still_blames_the_killed_rank(tmp_path):
    # Seen in CI: rank 0 lost its peer, raised and exited 3 before torchrun noticed rank 1's SIGKILL, so
    # torchrun's "root cause" is rank 0. The rank a signal killed without a word is still the cause.
    for rank in (0, 1):
        _in_check(tmp_path, rank, 1, "export")
    victim = RAISED.replace("moeverify: rank 1", "moeverify: rank 0").replace(
        "ValueError: bad row", "RuntimeError: [pair.cc:561] Connection closed by peer [127.0.0.1]:5021"
    )
    _stacks(tmp_path, 0, victim)
    (tmp_path / "torchrun.log").write_text(TORCHRUN_VICTIM_FIRST)
    crash = diagnose(tmp_path, world_size=2, plan=PLAN, returncode=1, killed=False, done=set())
    assert crash.message.startswith("rank 1 was killed in check export: rank 1 ended by signal 9 (SIGKILL)"), (
        crash.message
    )


def test_diagnose_a_raising_rank_seen_first_by_torchrun_is_not_called_killed(tmp_path):
    # CI: rank 0 (a victim) exited 3 first; rank 1 raised the planted error. Exit code 3 is not a signal.
    for rank in (0, 1):
        _in_check(tmp_path, rank, 1, "export")
    victim = RAISED.replace(
        "ValueError: bad row", "RuntimeError: [pair.cc:561] Connection closed by peer [127.0.0.1]:5021"
    )
    _stacks(tmp_path, 0, victim)
    _stacks(tmp_path, 1, RAISED)
    (tmp_path / "torchrun.log").write_text(
        "Root Cause (first observed failure):\n[0]:\n  rank      : 0 (local_rank: 0)\n  exitcode  : 3 (pid: 1)\n"
    )
    crash = diagnose(tmp_path, world_size=2, plan=PLAN, returncode=1, killed=False, done=set())
    assert crash.message.startswith("rank 1 raised ValueError: bad row"), crash.message


def test_a_multi_line_exception_message_is_named_by_its_first_line():
    from moeverify.runner.diagnose import _exception_line

    trace = (
        'Traceback (most recent call last):\n  File "/x/builder.py", line 105, in build\n'
        "    bridge = AutoBridge.from_hf_pretrained(str(hf_path))\n             ^^^^^^^^^^\n"
        "ValueError: Model architecture 'MixtralForCausalLM' is not yet supported.\n\nSupported:\n"
        "  • src/megatron/bridge/models/qwen/qwen_2_causal_bridge.py\n"
    )
    assert _exception_line(trace) == "ValueError: Model architecture 'MixtralForCausalLM' is not yet supported."
    assert _exception_line("Traceback (most recent call last):\nKeyError: 'x'\n") == "KeyError: 'x'"
