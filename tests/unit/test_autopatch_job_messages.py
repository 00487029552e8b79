"""Whole-job replay holds one queue of forwards per layer over every recorded step: its messages speak of the job's
forwards and the recorded steps, not of a "micro-batch 16" no step has."""

from __future__ import annotations

import types

import torch

from moeverify.patches import autopatch


def _replaying(forwards_per_step=(2, 2), ran=0):
    ends, total = {}, 0
    for step, n in enumerate(forwards_per_step):
        total += n
        ends[step] = total
    session = types.SimpleNamespace(step=len(forwards_per_step), setting=types.SimpleNamespace(directory="rec/"))
    session._step_ends = ends
    ids = tuple(torch.zeros(4, 2, dtype=torch.int64) for _ in range(total))
    state = autopatch._JobReplaying({0: ids}, session=session, recompute="auto", rank=0, original=None)
    state.next_mb[0] = ran
    return state


def test_a_forward_past_the_recording_names_the_step_and_the_recording():
    msg = _replaying(ran=4).exhausted(0, 4)  # what ``route`` raises past the queue's end
    assert "optimizer step 2 runs forward 5 of the job, but rec/ holds 4 (2 recorded step(s))" in msg, msg
    assert "mb " not in msg


def test_forwards_left_unused_name_the_recorded_steps_that_did_not_run():
    (msg,) = _replaying(ran=2).unused()
    assert "the job ran 2 of the 4 forwards rec/ holds; recorded step(s) [1] did not run in full" in msg, msg
    assert _replaying(ran=4).unused() == []
