"""--min-workers: the checks, the members' TF_CONFIGs, the membership hook's
decisions (no TensorFlow), and a real multiworker job that loses a host for
good and finishes on the survivors (multiprocess)."""

import dataclasses
import json
import os
import re
import signal
import sys

import pytest

from tfdist import protocol
from tfdist.launcher.recovery import elastic
from tfdist.launcher.recovery import injector as injectors
from tfdist.launcher.recovery import faults
from tfdist.launcher.machine import network
from tfdist.launcher import plan as plans
from tfdist.launcher.membership import HostMembership
from tfdist.launcher.plan import LaunchError
from tfdist.launcher.state import JobState, RestartMember, SignalMember, MemberView
from tfdist.protocol import Exit
from tfdist.strategies import kinds
from tfdist.options import TrainOptions

MW = kinds.get("multiworker")
WORKERS = ["worker:0", "worker:1", "worker:2"]


@pytest.mark.parametrize("strategy,workers,m,timeout,engine,words", [
    ("multiworker", 3, 4, None, "local", ["--min-workers=4", "use 1..3"]),
    ("multiworker", 3, 0, None, "local", ["--min-workers=0", "use 1..3"]),
    ("multiworker", 1, 1, None, "local", ["--workers=1", "nobody to go on without"]),
    ("multiworker", 3, 2, 0.0, "local", ["--rejoin-timeout=0", "positive"]),
    ("multiworker", 3, 2, -3.0, "local", ["--rejoin-timeout=-3", "positive"]),
    ("multiworker", 3, 2, float("inf"), "local", ["--rejoin-timeout=inf", "finite"]),
    ("multiworker", 3, None, 5.0, "local", ["--rejoin-timeout=5", "needs --min-workers"]),
    ("none", 1, 1, None, "local", ["--strategy none", "multiworker|ps|ps-sync",
                                   "one process"]),
    ("pipeline", 3, 2, None, "local", ["--strategy pipeline", "each holds a stage"]),
    ("mirrored", 1, 1, None, "local", ["--strategy mirrored", "drop --min-workers"]),
    ("ps-sync", 3, 2, None, "ray", ["--engine ray", "--strategy multiworker only",
                                    "received --strategy ps-sync"]),
    ("ps", 3, 2, None, "ray", ["--engine ray", "--strategy multiworker only"]),
])
def test_bad_elastic_input_is_one_line(strategy, workers, m, timeout, engine, words):
    with pytest.raises(LaunchError) as err:
        elastic.plan_elastic(kinds.get(strategy), workers, m, timeout, engine)
    text = str(err.value)
    assert "\n" not in text and all(w in text for w in words), text


def test_without_simulated_hosts_no_host_can_be_lost_so_it_is_refused():
    with pytest.raises(LaunchError, match="add --hosts N"):
        elastic.plan_elastic(MW, 3, 2, None, "local", hosts=0)


@pytest.mark.parametrize("strategy,m,engine,words", [
    ("multiworker", None, "local", "needs --min-workers M"),
    ("ps", 1, "local", "--strategy multiworker|ps-sync only, received --strategy ps"),
    ("multiworker", 2, "ray", "received --strategy multiworker --engine ray"),
])
def test_shrink_at_once_is_refused_where_it_cannot_apply(strategy, m, engine, words):
    with pytest.raises(LaunchError, match=re.escape(words)):
        elastic.plan_elastic(kinds.get(strategy), 3, m, None, engine, hosts=3, at_once=True)


def test_elastic_plan_defaults_and_none_without_the_flag():
    # Ray: no simulated hosts; its nodes are what is lost.
    assert elastic.plan_elastic(MW, 2, 1, None, "ray", hosts=0) == elastic.ElasticPlan(1, 20.0)
    assert elastic.plan_elastic(MW, 3, None, None) is None
    assert elastic.plan_elastic(MW, 3, 2, None) == elastic.ElasticPlan(2, 20.0)
    assert elastic.plan_elastic(MW, 3, 3, 7.5) == elastic.ElasticPlan(3, 7.5)


@pytest.mark.parametrize("argv,words", [
    (["--min-workers", "5"], "use 1..3"),
    (["--min-workers", "2", "--rejoin-timeout", "0"], "--rejoin-timeout=0"),
    (["--rejoin-timeout", "3"], "needs --min-workers"),
    (["--min-workers", "2"], "add --hosts N"),
])
def test_the_launcher_refuses_bad_elastic_flags_before_anything_starts(argv, words, tmp_path,
                                                                      capsys):
    from tfdist.cli import launch

    model_dir = tmp_path / "run"
    code = launch.main(["--strategy", "multiworker", "--workers", "3", *argv, "--",
                        "--model-dir", str(model_dir)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == Exit.BAD_INPUT and len(err) == 1 and err[0].startswith("error: "), err
    assert words in err[0]
    assert not model_dir.exists()


def test_member_configs_name_only_the_members_in_order():
    plan = plans.build_host_cluster(MW, 3, hosts=3)
    configs = elastic.member_configs(plan.tf_configs, ["worker:0", "worker:2"])
    addresses = [plan.tf_configs[n]["cluster"]["worker"][i] for i, n in
                 [(0, "worker:0"), (2, "worker:2")]]
    assert configs["worker:0"] == {"cluster": {"worker": addresses},
                                   "task": {"type": "worker", "index": 0}}
    assert configs["worker:2"] == {"cluster": {"worker": addresses},
                                   "task": {"type": "worker", "index": 1}}


@pytest.mark.parametrize("given,n,expected,said", [
    (None, 2, None, False),
    (3, 2, 2, True),
    (2, 3, 2, False),
])
def test_ps_sync_k_is_at_most_the_workers_left(given, n, expected, said):
    options = TrainOptions(steps=9, replicas_to_aggregate=given)
    out, line = elastic.aggregate(options, n)
    assert out == TrainOptions(steps=9, replicas_to_aggregate=expected)
    assert (line is not None) == said
    if said:
        assert "K = min(K, workers)" in line


def test_global_batch_is_the_options_else_the_run_record(tmp_path):
    assert elastic.global_batch(str(tmp_path), TrainOptions()) is None
    (tmp_path / "run.json").write_text(json.dumps({"global_batch_size": 192}))
    assert elastic.global_batch(str(tmp_path), TrainOptions()) == 192
    assert elastic.global_batch(str(tmp_path), TrainOptions(global_batch_size=96)) == 96


# --- one global batch for every formation --------------------------------------------

PS_SYNC = kinds.get("ps-sync")


@pytest.mark.parametrize("kind,roles,sizes,k,expected", [
    (MW, {"worker": 3}, range(2, 4), None, {2: 2, 3: 3}),
    (MW, {"worker": 4}, range(1, 5), None, {1: 1, 2: 2, 3: 3, 4: 4}),
    # A separate chief trains too: one more replica at every size.
    (MW, {"worker": 3, "chief": 1}, range(2, 4), None, {2: 3, 3: 4}),
    # ps-sync divides the batch into K gradients, K = min(K, workers).
    (PS_SYNC, {"chief": 1, "worker": 3, "ps": 1}, range(2, 4), None, {2: 2, 3: 3}),
    (PS_SYNC, {"chief": 1, "worker": 3, "ps": 1}, range(2, 4), 2, {2: 2, 3: 2}),
    # ps: each worker's step is a whole batch.
    (kinds.get("ps"), {"chief": 1, "worker": 3, "ps": 1}, range(1, 4), None,
     {1: 1, 2: 1, 3: 1}),
])
def test_what_the_batch_divides_by_at_each_size(kind, roles, sizes, k, expected):
    assert elastic.batch_divisors(kind, roles, sizes, k) == expected


def test_a_given_batch_some_size_cannot_divide_is_refused_naming_sizes_and_fixes():
    with pytest.raises(LaunchError) as err:
        elastic.check_batch(100, {2: 2, 3: 3})
    text = str(err.value)
    assert "\n" not in text
    assert text.startswith("--global-batch-size=100 does not divide over 3 workers")
    assert "(2 to 3 workers" in text and "multiple of 6, e.g. 96 or 102" in text
    with pytest.raises(LaunchError, match="over 3 or 4 workers.*multiple of 12, e.g. 24 or 36"):
        elastic.check_batch(26, {2: 2, 3: 3, 4: 4})
    with pytest.raises(LaunchError, match="multiple of 6, e.g. 6 or 12"):
        elastic.check_batch(9, {2: 2, 3: 3})
    for fine in (96, 102, 6):
        elastic.check_batch(fine, {2: 2, 3: 3})  # no error


@pytest.mark.parametrize("default,divisors,chosen", [
    (192, {2: 2, 3: 3}, 192),  # the full cluster's own choice divides every size
    (256, {2: 2, 3: 3, 4: 4}, 252),  # nearest multiple of 12
    (128, {2: 2, 3: 3, 4: 4}, 132),
    (9, {2: 2, 3: 3}, 12),  # a tie: the larger
    (4, {2: 2, 3: 3}, 6),  # never below one example per replica
    (320, {2: 3, 3: 4}, 324),
])
def test_the_chosen_batch_divides_every_size_and_is_nearest_the_default(default, divisors,
                                                                        chosen):
    batch = elastic.choose_batch(default, divisors)
    assert batch == chosen and all(batch % d == 0 for d in divisors.values())


def test_the_chosen_batch_is_stated_in_one_line():
    line = elastic.batch_line(192, {2: 2, 3: 3})
    assert line == ("[launch] elastic: global batch 192 for every formation, 2 to 3 workers "
                    "(each replica's share: 64 at 3, 96 at 2); --global-batch-size sets another")


def test_the_launcher_refuses_a_batch_a_size_cannot_divide_before_anything(tmp_path, capsys):
    from tfdist.cli import launch

    model_dir = tmp_path / "run"
    code = launch.main(["--strategy", "multiworker", "--workers", "3", "--hosts", "3",
                        "--min-workers", "2", "--", "--global-batch-size", "100",
                        "--model-dir", str(model_dir)])
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    assert code == Exit.BAD_INPUT and len(err) == 1 and not captured.out, captured
    assert err[0].startswith("error: --global-batch-size=100 does not divide over 3 workers")
    assert not model_dir.exists()


def _config(*argv):
    from tfdist.cli import launch
    from tfdist.launcher import job

    args, train_args = launch.parse_args(list(argv))
    return job.build_config(launch.request_from_args(args, train_args))


def test_the_launcher_pins_the_chosen_batch_into_every_formations_flags(monkeypatch, capsys):
    from tfdist.launcher import checks, job

    asked = []

    def check_members(tf_configs, command, env, **kw):
        asked.append((list(tf_configs), command))
        return [checks.MemberCheck(n, 0, {"global_batch_size": 256}) for n in tf_configs]

    monkeypatch.setattr(job, "check_members", check_members)
    config = _config("--strategy", "multiworker", "--workers", "4", "--hosts", "4",
                     "--min-workers", "2", "--", "--steps", "5", "--model-dir", "/tmp/x")
    pinned = job.pin_elastic_batch(config)
    assert [names for names, _ in asked] == [["worker:0"]]  # one check: the chief's plan
    assert pinned.options == dataclasses.replace(config.options, global_batch_size=252)
    assert "--global-batch-size 252" in " ".join(pinned.member.argv())
    assert capsys.readouterr().out.startswith("[launch] elastic: global batch 252 for every "
                                              "formation, 2 to 4 workers")
    # Given (and dividing every size), or not elastic: the flags as they are, no check.
    for argv in (["--min-workers", "2", "--", "--global-batch-size", "96"], ["--"]):
        config = _config("--strategy", "multiworker", "--workers", "3", "--hosts", "3", *argv)
        assert job.pin_elastic_batch(config) is config
    assert len(asked) == 1


def _state(*exits, pids=(11, 12, 13), names=WORKERS):
    exits = exits or (None,) * len(names)
    return JobState(tuple(MemberView(n, p, e) for n, p, e in zip(names, pids, exits)))


def _membership(tmp_path, m=2, timeout=5.0):
    now, lines, down = [0.0], [], set()
    paths = {n: str(tmp_path / f"{n}.events") for n in WORKERS}
    mem = HostMembership(elastic.ElasticPlan(m, timeout), WORKERS,
                             {n: i for i, n in enumerate(WORKERS)},
                             list(paths.values()), log=lines.append, clock=lambda: now[0],
                             record_path=str(tmp_path / "membership.json"))
    mem.new_attempt(lambda: down)
    return mem, now, lines, down, paths


def _emit(path, kind, step):
    with open(path, "a") as f:
        f.write(protocol.Event(kind, "worker:0", step, 1000.0 + step).to_json() + "\n")


def test_a_host_down_past_the_rejoin_timeout_ends_the_attempt_and_shrinks(tmp_path):
    mem, now, lines, down, paths = _membership(tmp_path)
    _emit(paths["worker:0"], protocol.STARTED, 0)
    _emit(paths["worker:0"], protocol.CHECKPOINT, 100)
    _emit(paths["worker:0"], protocol.PROGRESS, 150)
    assert mem(_state()) == []
    down.add(2)
    now[0] = 1.0
    assert mem(_state()) == []  # not yet: it may come back
    now[0] = 6.0
    assert mem(_state()) == [SignalMember(n, signal.SIGKILL, pid=p)
                             for n, p in zip(WORKERS, (11, 12, 13))]
    code = mem.after_attempt(Exit.TASK_LOST, wait_links=lambda s: pytest.fail("waited"))
    assert code is None and mem.members == ["worker:0", "worker:1"]
    assert mem.names == ["worker:0", "worker:1"]
    assert mem.record() == [
        {"step": 0, "workers": 3, "why": "start"},
        {"step": 100, "workers": 2, "why": "worker:2 lost for good (host2 unreachable for 5 s)"}]
    assert mem.history[-1]["steps_redone_at_least"] == 50
    assert lines[-1] == ("[launch] worker:2 lost for good (host2 unreachable for 5 s): "
                         "continuing with 2 workers from step 100 (steps 100-150 redone)")
    with open(mem.env()[protocol.MEMBERSHIP_ENV]) as f:
        assert json.load(f) == mem.record()
    assert set(mem.configs(plans.build_host_cluster(MW, 3, hosts=3).tf_configs)) == {
        "worker:0", "worker:1"}


def test_the_step_recorded_is_the_one_the_new_formation_resumed_from(tmp_path):
    mem, now, lines, down, paths = _membership(tmp_path)
    _emit(paths["worker:1"], protocol.CHECKPOINT, 200)  # a private save; the chief's was cut
    _emit(paths["worker:0"], protocol.PROGRESS, 230)
    down.add(2)
    mem(_state())
    now[0] = 5.0
    mem(_state())
    assert mem.after_attempt(Exit.TASK_LOST, lambda s: None) is None
    assert mem.history[-1]["step"] == 200
    mem.new_attempt(lambda: down)
    with open(paths["worker:0"], "a") as f:
        f.write(protocol.Event(protocol.STARTED, "worker:0", 101, 2000.0,
                               {"resumed_from": 100}).to_json() + "\n")
    mem(_state(names=WORKERS[:2]))
    assert mem.record()[-1]["step"] == 100
    assert mem.history[-1]["steps_redone_at_least"] == 130
    with open(tmp_path / "membership.json") as f:
        assert json.load(f)[-1]["step"] == 100


def test_survivors_failing_first_end_the_attempt_at_once_and_the_wait_lets_a_host_back(tmp_path):
    mem, now, lines, down, paths = _membership(tmp_path, timeout=20.0)
    down.add(1)
    assert mem(_state()) == []
    now[0] = 2.0
    # The survivors' all-reduce failed before the rejoin timeout: kill the rest now.
    actions = mem(_state(Exit.TASK_LOST, None, None))
    assert [a.member for a in actions] == ["worker:1", "worker:2"]
    waited = []

    def wait_links(seconds):
        waited.append(seconds)
        down.clear()  # back within the timeout

    assert mem.after_attempt(Exit.TASK_LOST, wait_links) == Exit.TASK_LOST
    assert waited == [18.0] and mem.members == WORKERS and len(mem.history) == 1


def test_below_min_workers_stops_with_one_line(tmp_path):
    mem, now, lines, down, paths = _membership(tmp_path, m=3)
    down.add(0)
    mem(_state())
    now[0] = 5.0
    assert mem(_state())  # ended
    assert mem.after_attempt(Exit.TASK_LOST, lambda s: None) == Exit.TASK_LOST
    assert "below --min-workers=3" in lines[-1] and "exit 75" in lines[-1]
    assert mem.members == WORKERS


def test_a_lost_host_back_preempts_the_job_and_it_grows_back(tmp_path):
    mem, now, lines, down, paths = _membership(tmp_path)
    down.add(2)
    mem(_state())
    now[0] = 5.0
    mem(_state())
    assert mem.after_attempt(Exit.TASK_LOST, lambda s: None) is None
    two = WORKERS[:2]
    mem.new_attempt(lambda: down)
    assert mem(_state(names=two, pids=(21, 22))) == []  # still down
    down.clear()
    assert mem(_state(names=two, pids=(21, 22))) == []  # not started yet: no handler to save
    _emit(paths["worker:0"], protocol.STARTED, 100)
    assert mem(_state(names=two, pids=(21, 22))) == [
        SignalMember("worker:0", signal.SIGTERM, group=False, pid=21)]
    assert mem(_state(names=two, pids=(21, 22))) == []  # once
    _emit(paths["worker:0"], protocol.PREEMPTED, 240)
    assert mem.after_attempt(Exit.PREEMPTED, lambda s: None) is None
    assert mem.members == WORKERS
    assert [h["workers"] for h in mem.history] == [3, 2, 3]
    assert mem.history[-1]["step"] == 240 and mem.history[-1]["steps_redone_at_least"] == 0
    assert "worker:2 back (host2 reachable again): growing back to 3 workers from step 240" \
        in lines[-1]


def test_under_ps_sync_the_chief_is_told_to_save_when_a_worker_is_back(tmp_path):
    names = ["chief:0", "worker:0", "worker:1", "worker:2", "ps:0"]
    tf_configs = plans.build_host_cluster(kinds.get("ps-sync"), 3, 1, hosts=4).tf_configs
    down, paths = {3}, [str(tmp_path / "chief.events")]
    mem = HostMembership(elastic.ElasticPlan(2, 1.0), names,
                             {"chief:0": 0, "ps:0": 0, "worker:0": 1, "worker:1": 2,
                              "worker:2": 3}, paths, log=lambda m: None,
                             clock=lambda: 0.0)
    mem.members = ["worker:0", "worker:1"]  # worker:2 left
    assert mem.names == ["chief:0", "worker:0", "worker:1", "ps:0"]
    assert mem.configs(tf_configs)["ps:0"]["cluster"]["worker"] == tf_configs["worker:0"]["cluster"][
        "worker"][:2]
    mem.new_attempt(lambda: down)
    _emit(paths[0], protocol.STARTED, 0)
    running = _state(names=mem.names, pids=(1, 2, 3, 4))
    assert mem(running) == []
    down.clear()
    assert mem(running) == [SignalMember("chief:0", signal.SIGTERM, group=False, pid=1)]


def test_under_ps_a_worker_whose_host_is_gone_leaves_and_rejoins_when_it_is_back(tmp_path):
    names = ["chief:0", "worker:0", "worker:1", "ps:0"]
    now, lines, down = [0.0], [], set()
    mem = HostMembership(elastic.ElasticPlan(1, 5.0), names,
                             {"chief:0": 0, "ps:0": 0, "worker:0": 1, "worker:1": 2},
                             [], log=lines.append, clock=lambda: now[0],
                             record_path=str(tmp_path / "m.json"), live=True)
    mem.new_attempt(lambda: down)
    pids = (1, 2, 3, 4)
    assert mem(_state(names=names, pids=pids)) == []
    down.add(2)
    assert mem(_state(names=names, pids=pids)) == []  # may come back
    # The cut-off worker found its chief gone and stopped: it leaves at once.
    assert mem(_state(None, None, 0, None, names=names, pids=pids)) == []
    assert mem.members == ["worker:0"] and "worker:1 left (host2 unreachable" in lines[-1]
    now[0] = 60.0
    assert mem(_state(None, None, 0, None, names=names, pids=pids)) == []  # 1 >= M: goes on
    down.clear()
    assert mem(_state(None, None, 0, None, names=names, pids=pids)) == [
        RestartMember("worker:1", note="its host is reachable again")]
    assert mem.members == ["worker:0", "worker:1"]
    assert [h["workers"] for h in mem.record()] == [2, 1, 2]
    assert mem.after_attempt(Exit.OK, lambda s: None) == Exit.OK
    with open(tmp_path / "m.json") as f:
        assert json.load(f) == mem.record()


def test_under_ps_below_min_workers_for_the_rejoin_timeout_stops_the_job(tmp_path):
    names = ["chief:0", "worker:0", "worker:1", "ps:0"]
    now, lines, down = [0.0], [], {2}
    mem = HostMembership(elastic.ElasticPlan(2, 5.0), names,
                             {"chief:0": 0, "ps:0": 0, "worker:0": 1, "worker:1": 2},
                             [], log=lines.append, clock=lambda: now[0], live=True)
    mem.new_attempt(lambda: down)
    gone = _state(None, None, 0, None, names=names, pids=(1, 2, 3, 4))
    assert mem(gone) == []
    now[0] = 4.0
    assert mem(gone) == []
    now[0] = 5.0
    assert [a.member for a in mem(gone)] == ["chief:0", "worker:0", "ps:0"]
    assert "below --min-workers=2" in lines[-1]
    assert mem.after_attempt(Exit.TASK_LOST, lambda s: None) == Exit.TASK_LOST


def _failing(tmp_path, max_restarts=0, at_once=False, m=2):
    mem, now, lines, down, paths = _membership(tmp_path, m=m)
    mem.plan = elastic.ElasticPlan(m, 5.0, max_restarts, at_once)
    return mem, lines


def _fail_worker_1(mem):
    """worker:1's process dies (host reachable); the others then report the lost peer."""
    assert mem(_state(None, -9, None)) == []  # the supervisor ends the attempt, not the hook
    mem(_state(Exit.TASK_LOST, -9, Exit.TASK_LOST))
    return mem.after_attempt(Exit.TASK_LOST, lambda s: pytest.fail("no host to wait for"))


def test_a_worker_failing_with_its_host_up_is_relaunched_then_left_behind(tmp_path):
    mem, lines = _failing(tmp_path, max_restarts=1)
    assert _fail_worker_1(mem) == Exit.TASK_LOST  # relaunched with it (--max-restarts)
    assert mem.members == WORKERS and len(mem.history) == 1
    mem.new_attempt(lambda: set())
    assert _fail_worker_1(mem) is None  # its second failure: re-formed without it
    assert mem.members == ["worker:0", "worker:2"]
    why = "worker:1 failed 2 time(s) with its host reachable (last exit -9, --max-restarts=1)"
    assert mem.record()[-1] == {"step": 0, "workers": 2, "why": why}
    assert lines[-1] == f"[launch] {why}: continuing with 2 workers from step 0"
    # Its host is reachable, but it is not grown back: it would fail again.
    mem.new_attempt(lambda: set())
    _emit(str(tmp_path / "worker:0.events"), protocol.STARTED, 0)
    assert mem(_state(names=["worker:0", "worker:2"], pids=(21, 23))) == []


def test_with_shrink_at_once_the_first_failure_leaves_the_worker_behind(tmp_path):
    mem, lines = _failing(tmp_path, max_restarts=3, at_once=True)
    assert _fail_worker_1(mem) is None and mem.members == ["worker:0", "worker:2"]
    assert "worker:1 failed 1 time(s) with its host reachable (last exit -9, " \
        "--shrink-at-once)" in lines[-1]


def test_a_failure_below_min_workers_ends_the_job_with_its_code(tmp_path):
    mem, lines = _failing(tmp_path, m=3)
    assert _fail_worker_1(mem) == Exit.TASK_LOST and mem.members == WORKERS
    assert "2 worker(s) left without it, below --min-workers=3: the job cannot go on " \
        "without it (exit 75)" in lines[-1]


def test_a_preemption_not_ours_and_success_go_on_as_before(tmp_path):
    mem, now, lines, down, paths = _membership(tmp_path)
    assert mem.after_attempt(Exit.PREEMPTED, lambda s: None) == Exit.PREEMPTED
    assert mem.after_attempt(Exit.OK, lambda s: None) == Exit.OK
    assert len(mem.history) == 1


def test_partitions_stay_scheduled_across_elastic_attempts():
    now = [0.0]
    inj = injectors.FaultInjector([faults.Fault("partition", "host2", seconds=1.0,
                                                lift_after=10.0)],
                                  log=lambda m: None, clock=lambda: now[0])
    now[0] = 1.0
    inj(_state())
    inj.end_attempt(keep_partitions=True)
    now[0] = 11.0
    from tfdist.launcher.state import SetLink
    assert inj(_state()) == [SetLink(2, up=True)]
    assert inj.records[0]["lifted_by"] == "schedule"


# --- a real job -----------------------------------------------------------------------

HOSTS_PROBLEM = network.hosts_problem()


def _events(model_dir, name):
    return protocol.read_all_events(protocol.events_path(os.path.join(model_dir, "launch"), name))


def _outcome(model_dir):
    with open(os.path.join(model_dir, "launch", "outcome.json")) as f:
        return json.load(f)


def _elastic_job(spawn, model_dir, strategy, workers, hosts, partition, *extra, steps=600,
                 ps=()):
    from conftest import launch_cmd

    return spawn(launch_cmd(strategy, "--workers", str(workers), *ps, "--hosts", str(hosts),
                            "--rejoin-timeout", "5", "--timeout", "500",
                            *(("--partition", partition) if partition else ()), *extra,
                            train_args=["--model", "logreg", "--steps", str(steps),
                                        "--log-every", "50", "--checkpoint-every", "100",
                                        "--model-dir", model_dir]))


@pytest.mark.multiprocess
@pytest.mark.skipif(HOSTS_PROBLEM is not None, reason=f"no simulated hosts here: {HOSTS_PROBLEM}")
@pytest.mark.timeout(300)
def test_multiworker_loses_a_host_for_good_and_finishes_on_the_survivor(tmp_path, spawn):
    from conftest import descendants_alive, read_results

    model_dir = str(tmp_path / "shrink")
    p = _elastic_job(spawn, model_dir, "multiworker", 2, 2, "host1@step=100",
                     "--min-workers", "1", steps=300)
    assert p.wait(280) == 0, p.output
    lost = [l for l in p.lines if "lost for good" in l]
    assert len(lost) == 1 and lost[0].startswith(
        "[launch] worker:1 lost for good (host1 unreachable for 5 s): continuing with 1 "
        "worker from step 100"), p.output
    r = read_results(model_dir)
    assert r["global_steps"] == r["completed_steps"] == 300
    # The global batch stayed 128 (64 x 2): the one survivor takes all of it.
    assert r["global_batch_size"] == 128 and r["replicas_in_sync"] == 1
    assert r["membership"] == [
        {"step": 0, "workers": 2, "why": "start"},
        {"step": 100, "workers": 1, "why": "worker:1 lost for good (host1 unreachable for 5 s)"}]
    outcome = _outcome(model_dir)
    assert outcome["exit_code"] == 0 and outcome["membership"][1]["members"] == ["worker:0"]
    # The lost worker was not started again.
    assert [e.kind for e in _events(model_dir, "worker:1")].count(protocol.STARTED) == 1
    assert descendants_alive(model_dir) == []


@pytest.mark.long
@pytest.mark.multiprocess
@pytest.mark.skipif(HOSTS_PROBLEM is not None, reason=f"no simulated hosts here: {HOSTS_PROBLEM}")
@pytest.mark.timeout(900)
def test_multiworker_3_to_2_for_good_matches_an_uninterrupted_run(tmp_path, spawn):
    from conftest import descendants_alive, read_results

    whole, shrunk = str(tmp_path / "whole"), str(tmp_path / "shrunk")
    assert _elastic_job(spawn, whole, "multiworker", 3, 3, None, "--min-workers", "2"
                        ).wait(400) == 0
    p = _elastic_job(spawn, shrunk, "multiworker", 3, 3, "host2@step=150", "--min-workers", "2")
    assert p.wait(450) == 0, p.output
    a, b = read_results(whole), read_results(shrunk)
    assert b["global_steps"] == 600 and b["global_batch_size"] == a["global_batch_size"]
    assert [m["workers"] for m in b["membership"]] == [3, 2]
    assert a["membership"] == [{"step": 0, "workers": 3, "why": "start"}]
    assert abs(a["test_accuracy"] - b["test_accuracy"]) <= 0.005, (a["test_accuracy"],
                                                                   b["test_accuracy"])
    assert descendants_alive(shrunk) == []


@pytest.mark.long
@pytest.mark.multiprocess
@pytest.mark.skipif(HOSTS_PROBLEM is not None, reason=f"no simulated hosts here: {HOSTS_PROBLEM}")
@pytest.mark.timeout(600)
def test_multiworker_shrinks_then_grows_back_when_the_host_returns(tmp_path, spawn):
    from conftest import descendants_alive, read_results

    model_dir = str(tmp_path / "grow")
    # Long enough that the shrunk job is still running when the host returns
    # (at 600 steps the two survivors finished first).
    p = _elastic_job(spawn, model_dir, "multiworker", 3, 3, "host2@step=150+25",
                     "--min-workers", "2", steps=1800)
    assert p.wait(550) == 0, p.output
    r = read_results(model_dir)
    assert r["global_steps"] == 1800 and r["replicas_in_sync"] == 3
    assert [m["workers"] for m in r["membership"]] == [3, 2, 3], r["membership"]
    assert r["membership"][2]["why"] == "worker:2 back (host2 reachable again)"
    # The grow-back is a preemption: every worker saved at one agreed step, none redone.
    back = _outcome(model_dir)["membership"][2]
    assert back["steps_redone_at_least"] == 0 and back["members"] == WORKERS
    assert any(re.match(r"^\[launch\] worker:2 back \(host2 reachable again\): growing back "
                        r"to 3 workers from step \d+$", l) for l in p.lines), p.output
    assert descendants_alive(model_dir) == []


@pytest.mark.long
@pytest.mark.multiprocess
@pytest.mark.skipif(HOSTS_PROBLEM is not None, reason=f"no simulated hosts here: {HOSTS_PROBLEM}")
@pytest.mark.timeout(600)
def test_a_host_lost_before_any_checkpoint_grows_back_with_the_batch_chosen_at_launch(
        tmp_path, spawn):
    from conftest import descendants_alive, read_results

    model_dir = str(tmp_path / "early")
    # Lost at step 10, before the first checkpoint (every 100) recorded anything:
    # the re-formed cluster must not choose its own batch (128 = 64 x 2), which
    # would not divide over 3 workers when the host is back.
    p = _elastic_job(spawn, model_dir, "multiworker", 3, 3, "host2@step=10+25",
                     "--min-workers", "2", "--max-restarts", "2", steps=1800)
    assert p.wait(550) == 0, p.output
    chosen = [l for l in p.lines if l.startswith("[launch] elastic: global batch")]
    assert chosen == ["[launch] elastic: global batch 192 for every formation, 2 to 3 workers "
                      "(each replica's share: 64 at 3, 96 at 2); --global-batch-size sets "
                      "another"], p.output
    assert any(l.startswith("[launch] worker:2 lost for good (host2 unreachable for 5 s): "
                            "continuing with 2 workers from step 0") for l in p.lines), p.output
    assert not any("does not divide" in l or "relaunching" in l for l in p.lines), p.output
    r = read_results(model_dir)
    assert r["global_steps"] == 1800 and r["global_batch_size"] == 192
    assert r["replicas_in_sync"] == 3
    assert [m["workers"] for m in r["membership"]] == [3, 2, 3], r["membership"]
    assert r["membership"][1]["step"] == 0
    outcome = _outcome(model_dir)
    assert outcome["exit_code"] == 0 and outcome["job_relaunches"] == 0
    assert descendants_alive(model_dir) == []


@pytest.mark.long
@pytest.mark.multiprocess
@pytest.mark.skipif(HOSTS_PROBLEM is not None, reason=f"no simulated hosts here: {HOSTS_PROBLEM}")
@pytest.mark.timeout(600)
def test_multiworker_goes_on_without_a_worker_killed_with_its_host_up(tmp_path, spawn):
    from conftest import descendants_alive, read_results

    model_dir = str(tmp_path / "killed")
    p = _elastic_job(spawn, model_dir, "multiworker", 3, 3, None, "--min-workers", "2",
                     "--kill", "worker:2@step=150", steps=600)
    assert p.wait(550) == 0, p.output
    assert any(l.startswith("[launch] worker:2 failed 1 time(s) with its host reachable "
                            "(last exit -9, --max-restarts=0): continuing with 2 workers "
                            "from step 100") for l in p.lines), p.output
    r = read_results(model_dir)
    assert r["global_steps"] == 600 and r["global_batch_size"] == 192
    assert [m["workers"] for m in r["membership"]] == [3, 2], r["membership"]
    assert [e.kind for e in _events(model_dir, "worker:2")].count(protocol.STARTED) == 1
    assert descendants_alive(model_dir) == []


@pytest.mark.long
@pytest.mark.multiprocess
@pytest.mark.skipif(HOSTS_PROBLEM is not None, reason=f"no simulated hosts here: {HOSTS_PROBLEM}")
@pytest.mark.timeout(600)
def test_ps_sync_3_to_2_with_k_adapted(tmp_path, spawn):
    from conftest import descendants_alive, read_results

    model_dir = str(tmp_path / "pssync")
    p = _elastic_job(spawn, model_dir, "ps-sync", 3, 4, "host3@step=150", "--min-workers", "2",
                     ps=("--ps", "1"))
    assert p.wait(550) == 0, p.output
    r = read_results(model_dir)
    assert r["global_steps"] == 600 and r["global_batch_size"] == 192
    assert [m["workers"] for m in r["membership"]] == [3, 2]
    # K = min(K, workers): every update of the smaller cluster averages 2 gradients.
    assert r["num_workers"] == 2 and r["replicas_to_aggregate"] == 2
    assert r["aggregated_gradients"] == 2 * r["applied_steps"]
    assert descendants_alive(model_dir) == []


@pytest.mark.long
@pytest.mark.multiprocess
@pytest.mark.skipif(HOSTS_PROBLEM is not None, reason=f"no simulated hosts here: {HOSTS_PROBLEM}")
@pytest.mark.timeout(600)
def test_ps_worker_whose_host_is_gone_leaves_and_rejoins_when_it_is_back(tmp_path, spawn):
    from conftest import descendants_alive, read_results

    model_dir = str(tmp_path / "ps")
    p = _elastic_job(spawn, model_dir, "ps", 2, 3, "host2@step=300+15", "--min-workers", "1",
                     ps=("--ps", "1"), steps=1500)
    assert p.wait(550) == 0, p.output
    r = read_results(model_dir)
    assert r["completed_steps"] == r["scheduled_steps"] == 1500
    assert [m["workers"] for m in r["membership"]] == [2, 1, 2], r["membership"]
    assert any(l.startswith("[launch] restarted worker:1 (pid ") for l in p.lines), p.output
    # The rejoined worker ran steps again.
    assert r["steps_per_worker"]["worker:1"] > 0
    assert descendants_alive(model_dir) == []


@pytest.mark.long
@pytest.mark.multiprocess
@pytest.mark.skipif(HOSTS_PROBLEM is not None, reason=f"no simulated hosts here: {HOSTS_PROBLEM}")
@pytest.mark.timeout(400)
def test_below_min_workers_the_job_stops_with_one_line_exit_75(tmp_path, spawn):
    from conftest import descendants_alive

    model_dir = str(tmp_path / "below")
    p = _elastic_job(spawn, model_dir, "multiworker", 2, 2, "host1@step=100",
                     "--min-workers", "2", steps=400)
    assert p.wait(350) == Exit.TASK_LOST, p.output
    said = [l for l in p.lines if "below --min-workers" in l]
    assert said == ["[launch] worker:1 lost for good (host1 unreachable for 5 s): 1 worker(s) "
                    "left, below --min-workers=2; stopping (exit 75): run the same command "
                    "when capacity is back to resume from the newest checkpoint"], p.output
    assert not any("continuing with" in l for l in p.lines)
    assert [m["workers"] for m in _outcome(model_dir)["membership"]] == [2]
    assert descendants_alive(model_dir) == []


@pytest.mark.long
@pytest.mark.multiprocess
@pytest.mark.skipif(HOSTS_PROBLEM is not None, reason=f"no simulated hosts here: {HOSTS_PROBLEM}")
@pytest.mark.timeout(600)
def test_ps_sync_grows_back_and_k_follows_the_size(tmp_path, spawn):
    from conftest import descendants_alive, read_results

    model_dir = str(tmp_path / "pssyncgrow")
    p = _elastic_job(spawn, model_dir, "ps-sync", 3, 4, "host3@step=150+25",
                     "--min-workers", "2", ps=("--ps", "1"), steps=900)
    assert p.wait(550) == 0, p.output
    r = read_results(model_dir)
    assert r["global_steps"] == 900 and [m["workers"] for m in r["membership"]] == [3, 2, 3]
    # The last cluster has every worker again, and K is every worker's.
    assert r["num_workers"] == 3 and r["replicas_to_aggregate"] == 3
    assert r["aggregated_gradients"] == 3 * r["applied_steps"]
    assert any(l.startswith("[launch] worker:2: host reachable again; SIGTERM to chief:0")
               for l in p.lines), p.output
    assert descendants_alive(model_dir) == []
