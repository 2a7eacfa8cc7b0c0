"""A user's large keras.layers.Embedding, split over two ps tasks by the library.

Under ``ps`` and ``ps-sync`` with ``--ps 2`` the table (above
``--shard-min-bytes``) is built as one shard per ps; each ps then holds
30-70 % of the variable bytes; a run saved on 2 ps resumes on 3.
"""

import json

import pytest

from conftest import REPO, launch_cmd, read_results

TASK = str(REPO / "tests" / "training" / "sample_tasks.py") + ":BIG_EMBEDDING"


def _balanced(results, ps):
    held = results["ps_variable_bytes"]
    assert sorted(held) == [f"ps:{i}" for i in range(ps)], held
    total = sum(held.values())
    # The table (9.6 MB) and its Adagrad slot dominate; each ps holds its share.
    assert total > 2 * 300_000 * 8 * 4 * 0.99
    assert all(0.3 / (ps / 2) <= b / total <= 0.7 / (ps / 2) for b in held.values()), held


@pytest.mark.multiprocess
# ps under the long tier: tests/training/test_sharding.py already trains a split
# table on a ps cluster (and reshards it) in every `make test`.
@pytest.mark.parametrize("strategy", [pytest.param("ps", marks=pytest.mark.long), "ps-sync"])
def test_a_large_embedding_trains_split_over_two_ps(tmp_path, spawn, strategy):
    run = tmp_path / "run"
    p = spawn(launch_cmd(strategy, "--workers", "2", "--ps", "2",
                         train_args=["--task", TASK, "--steps", "60", "--model-dir", str(run)]))
    assert p.wait(timeout=300) == 0, p.output
    r = read_results(run)
    _balanced(r, 2)
    assert r["global_steps"] == 60 and r["test_metrics"]["accuracy"] > 0.9
    # Each task's peak resident memory, sampled by the launcher: a TensorFlow
    # process holds a few hundred MB (its runtime alone), none holds 8 GB here.
    peaks = json.loads((run / "launch" / "outcome.json").read_text())["peak_rss_bytes"]
    assert set(peaks) == {"chief:0", "worker:0", "worker:1", "ps:0", "ps:1"}, peaks
    assert all(200 * 2**20 < b < 8 * 2**30 for b in peaks.values()), peaks
    if strategy == "ps":
        # The same run directory on 3 ps: the split table reshards on restore.
        p = spawn(launch_cmd(strategy, "--workers", "2", "--ps", "3",
                             train_args=["--task", TASK, "--steps", "90", "--model-dir", str(run)]))
        assert p.wait(timeout=300) == 0, p.output
        r = read_results(run)
        assert r["resumed_from_step"] == 60 and r["global_steps"] == 90
        _balanced(r, 3)
