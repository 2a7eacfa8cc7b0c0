"""``--carry-all-reduce auto``'s trial (``training.sync.carry_trial``): pure bookkeeping."""

import pytest

from tfdist.training.sync.carry_trial import CARRIED, PLAIN, CarryTrial


def test_windows_alternate_each_first_call_untimed_then_the_trial_ends():
    trial = CarryTrial(window=3, rounds=2, warm=1)
    kinds = []
    while trial.next_kind() is not None:
        kinds.append(trial.next_kind())
        trial.record(1, 0.01)
    assert kinds == [PLAIN] * 4 + [CARRIED] * 4 + [PLAIN] * 4 + [CARRIED] * 4
    assert trial.steps == {PLAIN: 6, CARRIED: 6}
    assert trial.seconds[PLAIN] == pytest.approx(0.06)
    with pytest.raises(RuntimeError):
        trial.record(1, 0.01)


def test_a_call_counts_whole_in_the_window_it_starts_in():
    trial = CarryTrial(window=10, rounds=1, warm=1)
    trial.record(15, 9.0)  # the window's first call (a trace): not timed
    assert trial.next_kind() == PLAIN and trial.totals() == [0.0, 0.0, 0.0, 0.0]
    trial.record(15, 1.5)  # one call of 15 steps (--steps-per-execution) closes the window
    assert trial.next_kind() == CARRIED and trial.steps == {PLAIN: 15, CARRIED: 0}


def test_the_faster_step_per_step_wins_and_a_tie_keeps_the_plain_one():
    # Two replicas' totals summed: plain 2 x 10 steps in 2 x 0.9 s, carried in 2 x 0.8 s.
    result = CarryTrial().choose([1.8, 20.0, 1.6, 20.0], 2)
    assert result.carried and result.steps_each == 10
    assert result.plain_ms == pytest.approx(90.0) and result.carried_ms == pytest.approx(80.0)
    assert "carried over the step's end" in result.line()
    assert not CarryTrial().choose([1.0, 10.0, 1.0, 10.0], 1).carried
    assert not CarryTrial().choose([1.0, 10.0, 0.0, 0.0], 1).carried  # carried never timed


@pytest.mark.parametrize("window, rounds", [(0, 2), (10, 0)])
def test_a_trial_needs_windows(window, rounds):
    with pytest.raises(ValueError):
        CarryTrial(window=window, rounds=rounds)


def test_the_default_leaves_two_calls_of_each_window_untimed():
    trial = CarryTrial(window=2, rounds=1)
    for seconds in (5.0, 3.0, 0.1, 0.1):  # a trace and a first run, then two timed calls
        trial.record(1, seconds)
    assert trial.next_kind() == CARRIED and trial.totals()[:2] == [pytest.approx(0.2), 2.0]
