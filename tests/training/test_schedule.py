"""The run's cadences, without TensorFlow: calls, checkpoints, evaluations, logs, resume."""

import pytest

from tfdist.strategies import ConfigError
from tfdist.training.loop.schedule import Schedule, ScheduleError


def sched(**kw):
    base = dict(total_steps=100, steps_per_epoch=40, steps_per_execution=1, log_every=100)
    base.update(kw)
    return Schedule(**base)


def test_calls_stop_at_epoch_ends_and_the_end():
    s = sched(steps_per_execution=15)
    # 40 steps an epoch: 15, 15, 10 | 15, 15, 10 | 15, 5 (the last partial call).
    assert s.calls() == [15, 15, 10, 15, 15, 10, 15, 5]
    assert sum(s.calls()) == 100
    assert s.call_size(100) == 0


def test_checkpoint_every_not_dividing_steps_per_execution_cuts_calls():
    s = sched(total_steps=50, steps_per_epoch=1000, steps_per_execution=8, checkpoint_every=12)
    sizes = s.calls()
    assert sizes == [8, 4, 8, 4, 8, 4, 8, 4, 2]
    ends, step = [], 0
    for n in sizes:
        step += n
        ends.append(step)
    # Every checkpoint boundary is a call end, so a checkpoint holds exactly the steps before it.
    assert {12, 24, 36, 48} <= set(ends)
    assert [e for e in ends if s.checkpoint_due(e)] == [12, 24, 36, 48, 50]


def test_checkpoints_at_epoch_ends_every_n_steps_and_the_end():
    s = sched(checkpoint_every=30)
    due = [step for step in range(0, 101) if s.checkpoint_due(step)]
    assert due == [30, 40, 60, 80, 90, 100]


def test_resume_mid_epoch_continues_the_same_call_boundaries():
    full = sched(steps_per_execution=15)
    resumed = sched(steps_per_execution=15, start_step=55)
    assert resumed.calls() == [15, 10, 15, 5]  # 55..70..80 (epoch end)..95..100
    assert full.calls(55) == resumed.calls()
    # Nothing is due at the resume position itself: that checkpoint already exists.
    at_epoch_end = sched(start_step=40)
    assert not at_epoch_end.checkpoint_due(40) and at_epoch_end.checkpoint_due(80)
    assert not resumed.log_due(55, 55)
    assert resumed.epoch(56) == 2 and resumed.epoch(80) == 2 and resumed.epoch(81) == 3


def test_eval_cadence_fires_once_per_interval_and_never_at_the_end():
    s = sched(steps_per_execution=15, eval_every=25)
    fired, step = [], 0
    for n in s.calls():
        if s.eval_due(step, step + n):
            fired.append(step + n)
        step += n
    # Crossing 25, 50, 75 (first call end at or past each); 100 is the final evaluation's.
    assert fired == [30, 55, 80]
    assert not sched(eval_every=0).eval_due(0, 99)


def test_log_cadence_and_the_last_call():
    s = sched(steps_per_execution=15, log_every=30)
    logged, step = [], 0
    for n in s.calls():
        if s.log_due(step, step + n):
            logged.append(step + n)
        step += n
    assert logged == [30, 70, 95, 100]  # crossing 30, 60, 90; and the end always


def test_drain_is_due_before_checkpoints_evaluations_and_the_end():
    s = sched(steps_per_execution=15, eval_every=25)
    assert s.drain_due(15, 30)  # evaluation
    assert s.drain_due(30, 40)  # epoch end: checkpoint
    assert not s.drain_due(40, 55 - 10)
    assert s.drain_due(95, 100)


@pytest.mark.parametrize("kw,flag", [
    (dict(steps_per_execution=0), "--steps-per-execution=0"),
    (dict(checkpoint_every=-1), "--checkpoint-every=-1"),
    (dict(eval_every=-5), "--eval-every=-5"),
    (dict(log_every=True), "--log-every=True"),
    (dict(start_step=-1), "negative"),
])
def test_impossible_schedules_are_config_errors(kw, flag):
    with pytest.raises(ConfigError, match=flag):
        sched(**kw)


def test_periodic_exports_are_due_when_a_call_crosses_a_multiple():
    s = sched(export_every=10)
    assert [s.export_due(b, a) for b, a in [(0, 9), (9, 10), (10, 19), (18, 22), (5, 35)]] == \
        [False, True, False, True, True]
    assert not sched().export_due(0, 100)


def test_the_weights_are_read_at_progress_lines_and_periodic_exports():
    """What a trainer that leaves an update pending must drain for, beyond checkpoints,
    evaluations and the end."""
    s = sched(log_every=25, export_every=10)
    due = [a for a in range(1, 60) if s.weights_read_due(a - 1, a)]
    assert due == [10, 20, 25, 30, 40, 50]
    assert [a for a in range(1, 60) if sched(log_every=25).weights_read_due(a - 1, a)] == [25, 50]


@pytest.mark.parametrize("value", [-1, 1.5, True])
def test_a_bad_export_every_is_a_schedule_error(value):
    with pytest.raises(ScheduleError, match="--export-every"):
        sched(export_every=value)
