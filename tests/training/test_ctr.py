"""tfdist.models.ctr: deterministic planted data, option checks, the AUC ceiling."""

import numpy as np
import pytest

from tfdist.models import ctr

SMALL = {"rows": "20000", "features": "8", "train_size": "5000", "test_size": "4000"}


def _task(**options):
    task = ctr.CtrTask()
    task.configure(**{**SMALL, **options})
    return task


def test_auc_matches_pair_counting():
    rng = np.random.default_rng(0)
    labels = rng.random(300) < 0.3
    scores = np.round(rng.normal(size=300), 1)  # ties on purpose
    pos, neg = scores[labels], scores[~labels]
    pairs = (pos[:, None] > neg[None, :]).sum() + 0.5 * (pos[:, None] == neg[None, :]).sum()
    assert ctr.auc(labels, scores) == pytest.approx(pairs / (len(pos) * len(neg)))


def test_data_is_deterministic_and_seeded():
    a, b = _task()._examples("train"), _task()._examples("train")
    np.testing.assert_array_equal(a[0], b[0])
    np.testing.assert_array_equal(a[1], b[1])
    other = _task(seed="1")._examples("train")
    assert not np.array_equal(a[0], other[0])
    test = _task()._examples("test")
    assert not np.array_equal(a[0][:100], test[0][:100])


def test_ids_stay_in_their_feature_block_and_the_ceiling_is_informative():
    task = _task()
    ids, labels, _ = task._examples("test")
    assert ids.shape == (4000, 8) and ids.dtype == np.int32
    for f, (offset, size) in enumerate(task._blocks()):
        assert ids[:, f].min() >= offset and ids[:, f].max() < offset + size
    assert 0.1 < labels.mean() < 0.4
    assert 0.7 < task.extra_results()["auc_ceiling"] < 1.0


def test_dataset_is_unbatched_examples_matching_the_model():
    task = _task()
    ids, label = next(iter(task.dataset("train")))
    assert ids.shape == (8,) and label.shape == (1,)
    model = task.build_model()
    assert model.output_shape == (None, 1)
    assert "AUC" in str(model.get_compile_config()["metrics"])


@pytest.mark.parametrize("options, message", [
    ({"rows": "many"}, "not an integer"),
    ({"features": "30"}, "between 8 and 26"),
    ({"rows": "10"}, "at least 2 per feature"),
    ({"colour": "red"}, "no option 'colour'"),
    ({"learning_rate": "0"}, "above 0"),
])
def test_bad_options_are_one_clear_error(options, message):
    with pytest.raises(ValueError, match=message) as err:
        ctr.CtrTask().configure(**options)
    assert "\n" not in str(err.value)


def test_default_table_is_at_least_128_mb():
    assert ctr.DEFAULTS["rows"] * ctr.DEFAULTS["dim"] * 4 >= 128 * 10**6
