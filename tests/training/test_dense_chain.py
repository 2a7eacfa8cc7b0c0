"""The ``dense-chain`` built-in task: a compute-heavy chain for ``--strategy pipeline``."""

import numpy as np
import pytest

from tfdist.models import BUILTIN_TASKS
from tfdist.training.pipeline import stages
from tfdist.training.workload import tasks


def _task(**options):
    task = tasks.load(tasks.parse_spec("dense-chain"))
    task.configure(**options)
    return task


def test_the_chain_is_four_wide_layers_over_256_features_and_cuts_one_to_two():
    task = _task(train_size=64, test_size=32)
    model = task.build_model()
    assert "dense-chain" in BUILTIN_TASKS
    assert model.count_params() == 256 * 2048 + 3 * 2048 * 2048 + 4 * 2048 + 2048 * 10 + 10
    local, cut = stages.local_stages(task, model, stages.PipelinePlan(2, 8, 1))
    # Three equal 2048 x 2048 layers do not halve: the best cut is 4.7 M | 8.4 M.
    assert [m.count_params() for m in local] == [4_722_688, 8_413_194], cut


def test_the_data_is_deterministic_and_learnable():
    a, b = _task(train_size=2000, test_size=500), _task(train_size=2000, test_size=500)
    xa, ya = a._examples("train")
    xb, yb = b._examples("train")
    assert xa.shape == (2000, 256) and np.array_equal(xa, xb) and np.array_equal(ya, yb)
    # Every class occurs, none dominates: chance is near 1/10, not near 1.
    counts = np.bincount(ya, minlength=10)
    assert counts.min() > 0 and counts.max() < 0.5 * len(ya), counts
    xt, _ = a._examples("test")
    assert not np.array_equal(xt[:10], xa[:10])


def test_bad_options_are_one_line():
    with pytest.raises(ValueError, match="dense-chain has no option 'depth'"):
        _task(depth=3)
    with pytest.raises(ValueError, match="width='wide' must be a positive integer"):
        _task(width="wide")


def _plan(*argv):
    from tfdist.cli.train import config_from_args, parse_args
    from tfdist.training.plan import resolve

    return resolve(config_from_args(parse_args(["--task", "dense-chain", *argv])), [],
                   train_examples=60_000, test_examples=10_000)


def test_it_trains_with_its_compiled_optimizer_unless_a_flag_is_given():
    # The flags' defaults (Adam 5e-3, cosine) left the chain at the class prior.
    assert not _plan().optimizer.library
    given = _plan("--learning-rate", "0.002").optimizer
    assert given.library and given.learning_rate == 0.002
