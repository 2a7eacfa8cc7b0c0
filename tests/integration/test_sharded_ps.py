"""A user's large keras.layers.Embedding, split over two ps tasks by the library.

Under ``ps`` and ``ps-sync`` with ``--ps 2`` the table (above
``--shard-min-bytes``) is built as one shard per ps; each ps then holds
30-70 % of the variable bytes; a run saved on 2 ps resumes on 3.
"""

import json
from unittest import mock

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
# The long tier: tests/training/test_sharding.py already trains a split table on a
# ps cluster (and reshards it) in every `make test` (CI time).
@pytest.mark.long
@pytest.mark.parametrize("strategy", ["ps", "ps-sync"])
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


# A ctr table of 10M x 16 (640 MB) and its Adagrad slot: 1,280 MB on one ps,
# 640 MB on each of two. What a memory cgroup is charged is the task's own
# pages, not its resident set (TensorFlow's shared library pages are charged
# to whoever read them first). Measured here, 1 worker, 30 steps: two ps
# trained under a limit of 1,450 MiB each; one ps was killed at 1,750 MiB
# (and, with a 6M-row table, at 1,300 but not at 1,700).
ROWS, LIMIT_MIB = 10_000_000, 1600


def _ctr_under_limit(spawn, run, ps):
    return spawn(launch_cmd("ps", "--workers", "1", "--ps", str(ps),
                            "--memory-limit", f"ps={LIMIT_MIB}M", "--timeout", "400",
                            train_args=["--task", "ctr", "--task-option", f"rows={ROWS}",
                                        "--steps", "30", "--model-dir", str(run)]))


@pytest.mark.long
@pytest.mark.multiprocess
@pytest.mark.timeout(900)
def test_a_table_too_big_for_one_ps_under_its_memory_limit_trains_split_over_two(tmp_path, spawn):
    one = _ctr_under_limit(spawn, tmp_path / "one", 1)
    # The chief sees its ps gone while the table is created: one line, 75 (relaunchable).
    assert one.wait(timeout=450) == 75, one.output
    assert not any("Traceback" in l for l in one.lines), one.output
    assert any(l.startswith("[chief:0] error: a peer task became unreachable before training")
               for l in one.lines), one.output
    outcome = json.loads((tmp_path / "one" / "launch" / "outcome.json").read_text())
    assert outcome["oom_killed"] == {"ps:0": 1}, outcome
    assert any(l.startswith("[launch] ps:0 was ended by the kernel's OOM killer") for l in one.lines)

    two = _ctr_under_limit(spawn, tmp_path / "two", 2)
    assert two.wait(timeout=450) == 0, two.output
    r = read_results(tmp_path / "two")
    assert r["global_steps"] == 30
    held = r["ps_variable_bytes"]
    assert sorted(held) == ["ps:0", "ps:1"] and min(held.values()) > 0.45 * 2 * ROWS * 16 * 4
    outcome = json.loads((tmp_path / "two" / "launch" / "outcome.json").read_text())
    assert outcome["oom_killed"] is None
    assert outcome["memory_limits"] == {p: {"limit_bytes": LIMIT_MIB << 20, "max_usage_bytes": mock.ANY}
                                        for p in ("ps:0", "ps:1")}
    assert all(r["max_usage_bytes"] <= LIMIT_MIB << 20 for r in outcome["memory_limits"].values())
