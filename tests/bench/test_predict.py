"""The predictor's model (pure): each strategy's step from compute, bytes, overlap and
latency, the term that bounds it, the profile solved from a run, and the refusals."""

import json
from dataclasses import replace

import pytest

from tfdist.bench import predict as pr

CNN = 225_034
WIRE = 1514 / 1448
MBIT100 = 100e6
# One worker's step: 32 ms of compute at batch 64 on half a core.
PROFILE = pr.Profile("mnist-cnn", CNN, 64, 0.032, 0.5)


def link_s(size, rate=MBIT100):
    return size * WIRE / (rate / 8)


def test_one_worker_is_its_compute_under_every_kind_of_sync():
    p = pr.predict(PROFILE, pr.Target(1), "multiworker")
    assert p.examples_per_sec == pytest.approx(64 / 0.032)
    assert p.bound == "compute"


def test_compute_scales_with_batch_cores_and_accumulation():
    t = pr.Target(1, cores=1.0, per_worker_batch=128, accumulation=2)
    # Twice the batch, twice the cores, two batches per step: 2 x 1/2 x 2 the compute.
    p = pr.predict(PROFILE, t, "multiworker")
    assert p.step_seconds == pytest.approx(0.064)
    assert p.examples_per_sec == pytest.approx(256 / 0.064)


def test_the_ring_moves_2_n_minus_1_over_n_of_the_gradients_each_way():
    for n in (2, 4, 16):
        p = pr.predict(PROFILE, pr.Target(n, link_bits_per_sec=MBIT100), "multiworker")
        link = link_s(2 * (n - 1) / n * 4 * CNN)
        assert p.terms["link"] == pytest.approx(link, rel=1e-5)
        assert p.step_seconds == pytest.approx(0.032 + link)
        assert p.bound == "link"
    # 16-bit gradients halve the bytes.
    half = pr.predict(PROFILE, pr.Target(2, link_bits_per_sec=MBIT100, gradient_dtype="bfloat16"),
                      "multiworker")
    assert half.terms["link"] == pytest.approx(link_s(2 * CNN), rel=1e-5)


def test_overlap_hides_the_all_reduce_under_compute():
    hidden = replace(PROFILE, hidden=0.5)
    t = pr.Target(2, link_bits_per_sec=1e9)
    link = link_s(4 * CNN, 1e9)  # 7.5 ms, under half of 32 ms
    assert link < 0.016
    assert pr.predict(hidden, t, "multiworker").step_seconds == pytest.approx(0.032)
    assert pr.predict(PROFILE, t, "multiworker").step_seconds == pytest.approx(0.032 + link)


def test_latency_rounds_bound_a_large_ring_and_are_named():
    t = pr.Target(1024, link_bits_per_sec=10e9, latency=50e-6)
    p = pr.predict(PROFILE, t, "multiworker")
    assert p.terms["all-reduce ring"] == pytest.approx(2 * 1023 * 50e-6)
    assert p.bound == "all-reduce ring"


def test_byte_cpu_is_charged_to_the_hosts_budget_on_unshaped_links():
    costly = replace(PROFILE, cpu_per_byte=5e-9)
    p1 = pr.predict(costly, pr.Target(2), "multiworker")
    # Each way 0.9 MB, both ways 1.8 MB at 5 ns per byte on one core, on half a core.
    assert p1.step_seconds == pytest.approx(0.032 + 2 * 4 * CNN * 5e-9 / 0.5)
    assert pr.predict(costly, pr.Target(2, cores=1.0), "multiworker").step_seconds < p1.step_seconds


def test_async_ps_is_n_cycles_until_the_ps_link_bounds():
    t = pr.Target(1, link_bits_per_sec=MBIT100)
    one = pr.predict(PROFILE, t, "ps")
    cycle = 0.032 + link_s(8 * CNN)
    assert one.step_seconds == pytest.approx(cycle)
    assert one.bound == "link"
    # Eight workers: the ps host's outgoing weights each step bound it.
    eight = pr.predict(PROFILE, replace(t, workers=8), "ps")
    assert eight.step_seconds == pytest.approx(link_s(4 * CNN))
    assert eight.bound == "ps fan-in"
    # Two ps on machines of their own halve that bound.
    own = pr.predict(PROFILE, replace(t, workers=8, ps=2, ps_own_hosts=True), "ps")
    assert own.step_seconds == pytest.approx(max(cycle / 8, link_s(2 * CNN)))


def test_async_ps_unshaped_is_bound_by_compute_or_the_chief():
    t = pr.Target(4)
    assert pr.predict(PROFILE, t, "ps").examples_per_sec == pytest.approx(4 * 64 / 0.032)
    chief = replace(PROFILE, dispatch_seconds=0.005)  # 10 ms a step on half a core
    p = pr.predict(chief, replace(t, workers=8), "ps")
    assert p.step_seconds == pytest.approx(0.010)
    assert p.bound == "ps fan-in"


def test_ps_sync_is_a_chain_of_reads_compute_pushes_and_the_sync():
    rate = []
    for n in (1, 2, 4):
        p = pr.predict(PROFILE, pr.Target(n, link_bits_per_sec=MBIT100), "ps-sync")
        # Every worker waits for the same token: the n reads share the ps host's link
        # out, the n pushes its link in, and the compute sits between them.
        assert p.step_seconds == pytest.approx(0.032 + link_s(n * 8 * CNN), rel=1e-5)
        rate.append(p.examples_per_sec)
    # Each update carries n batches and moves n weights and n gradients: the rate
    # levels off at one batch per weights-and-gradients transfer.
    assert rate[0] < rate[1] < rate[2] <= 64 / link_s(8 * CNN) * 1.0001
    assert p.bound == "ps fan-in"
    assert p.byteps_seconds < link_s(4 * 8 * CNN)
    # The reads hide under the forward pass as far as the overlap goes; ps:0's
    # aggregation waits out in full, on its host's budget.
    hiding = replace(PROFILE, hidden=0.5, sync_seconds=0.002)
    p = pr.predict(hiding, pr.Target(2, link_bits_per_sec=MBIT100), "ps-sync")
    assert p.step_seconds == pytest.approx(
        0.032 + link_s(2 * 8 * CNN) - 0.5 * 0.032 + 0.002 / 0.5, rel=1e-5)
    # Unshaped, the chain bounds until the ps host's CPU (its bytes) exceeds it.
    costly = replace(PROFILE, cpu_per_byte=5e-9)
    few = pr.predict(costly, pr.Target(2), "ps-sync")
    assert few.bound == "compute"
    assert few.step_seconds == pytest.approx(0.032 + 5e-9 * 8 * CNN / 0.5)
    many = pr.predict(costly, pr.Target(16), "ps-sync")
    assert many.bound == "ps fan-in"
    assert many.step_seconds == pytest.approx(5e-9 * 16 * 8 * CNN / 0.5)


def test_byteps_optimum_matches_its_closed_forms():
    # k = 0: the ring all-reduce's 2(n-1)/n M / B; k = n: M / B... times 2n(n-1)/(2n^2-2n).
    assert pr.byteps_seconds(4, 0, 1.0, 1.0) == pytest.approx(2 * 3 / 4)
    assert pr.byteps_seconds(4, 4, 1.0, 1.0) == pytest.approx(1.0)
    assert pr.byteps_seconds(1, 1, 1.0, 1.0) == 0.0


def test_sharded_state_moves_gradients_and_weights_once_each():
    t = pr.Target(4, link_bits_per_sec=MBIT100, shard_state="optimizer", gradient_dtype="bfloat16")
    p = pr.predict(PROFILE, t, "multiworker")
    assert p.terms["link"] == pytest.approx(link_s(3 / 4 * (2 + 4) * CNN), rel=1e-5)
    assert [q.strategy for q in pr.predict_all(PROFILE, t)] == ["multiworker"]


@pytest.mark.parametrize("target, strategy, words", [
    (pr.Target(4, shard_state="weights"), "multiworker", "weights: its re-gathers are not modelled"),
    (pr.Target(4, shard_state="optimizer"), "ps", "multiworker's only"),
    (pr.Target(0), "ps", "at least 1"),
    (pr.Target(2, gradient_dtype="int8"), "multiworker", "allowed: float32"),
    (pr.Target(2), "pipeline", "no model for strategy"),
])
def test_what_the_model_cannot_answer_is_one_line(target, strategy, words):
    with pytest.raises(pr.PredictError, match=words) as err:
        pr.predict(PROFILE, target, strategy)
    assert "\n" not in str(err.value)


def write_run(tmp_path, results, outcome=None):
    (tmp_path / "launch").mkdir()
    (tmp_path / "results.json").write_text(json.dumps(results))
    if outcome is not None:
        (tmp_path / "launch" / "outcome.json").write_text(json.dumps(outcome))
    return str(tmp_path)


def test_a_profile_solved_from_a_run_predicts_that_run(tmp_path):
    results = {"strategy": "multiworker", "num_workers": 2, "num_ps": 0, "global_batch_size": 128,
               "examples_per_sec": 1300.0, "trainable_params": CNN, "task": "mnist-cnn",
               "gradient_dtype": "float32", "gradient_accumulation_steps": 1, "shard_state": "off"}
    outcome = {"link": {"set_bits_per_sec": MBIT100},
               "host_cpus": {"host0": {"cores": 0.5}, "host1": {"cores": 0.5}}}
    run = pr.read_run(write_run(tmp_path, results, outcome))
    assert (run.strategy, run.target.workers, run.target.per_worker_batch) == ("multiworker", 2, 64)
    assert run.target.cores == 0.5 and run.target.link_bits_per_sec == MBIT100
    prof = pr.profile_of(run)
    # 128 / 1300 s a step, less the ring's 0.94 MB at 100 Mbit/s.
    assert prof.compute_seconds == pytest.approx(128 / 1300 - link_s(4 * CNN), rel=1e-6)
    assert pr.predict(prof, run.target, "multiworker").examples_per_sec == pytest.approx(1300)


def test_a_run_faster_than_its_link_allows_is_refused(tmp_path):
    results = {"strategy": "multiworker", "num_workers": 2, "global_batch_size": 128,
               "examples_per_sec": 9000.0, "trainable_params": CNN, "task": "mnist-cnn"}
    run = pr.read_run(write_run(tmp_path, results, {"link": {"set_bits_per_sec": MBIT100}}))
    with pytest.raises(pr.PredictError, match="faster than its communication"):
        pr.profile_of(run)


def test_a_directory_without_results_is_one_line(tmp_path):
    with pytest.raises(pr.PredictError, match="no results.json"):
        pr.read_run(str(tmp_path))


def test_median_and_error():
    assert pr.median([3.0, 1.0, 2.0]) == 2.0
    assert pr.median([1.0, 2.0, 3.0, 4.0]) == 2.5
    assert pr.error(110, 100) == pytest.approx(0.10)


def test_a_shared_machine_with_no_core_free_stretches_the_step():
    kernel = replace(PROFILE, kernel_per_byte=2e-9)
    base = pr.predict(kernel, pr.Target(4), "multiworker")
    # Four hosts of half a core fill a 2-core machine: the kernel's byte work
    # (3 x 0.9 MB... each host's 2(N-1)/N G, 4 hosts) comes on top, over 2 cores.
    full = pr.predict(kernel, pr.Target(4, machine_cores=2.0), "multiworker")
    moved = 4 * 2 * 3 / 4 * 4 * CNN
    assert full.step_seconds == pytest.approx(base.step_seconds + 2e-9 * moved / 2)
    assert full.bound == "shared machine"
    # Two such hosts leave a core free: the kernel's work fits beside them.
    two = pr.predict(kernel, pr.Target(2, machine_cores=2.0), "multiworker")
    assert two.step_seconds == pr.predict(kernel, pr.Target(2), "multiworker").step_seconds
    assert two.bound == "compute"


def test_colliding_ps_reads_use_only_part_of_the_ps_link():
    t = pr.Target(8, link_bits_per_sec=MBIT100)
    full = pr.predict(PROFILE, t, "ps")
    part = pr.predict(replace(PROFILE, ps_link_use=0.7), t, "ps")
    assert part.step_seconds == pytest.approx(full.step_seconds / 0.7)
    assert part.bound == full.bound == "ps fan-in"
