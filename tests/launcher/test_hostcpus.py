"""--host-cpus: the plan and its refusals (pure), each host's cgroups and their record,
and a real job whose hosts each get half a core (multiprocess)."""

import glob
import json
import os
import time

import pytest

from tfdist.launcher.machine import cgroups
from tfdist.launcher.machine import hostcpus
from tfdist.launcher.machine import network
from tfdist.launcher import plan as plans
from tfdist.launcher.plan import LaunchError
from tfdist.protocol import Exit
from tfdist.strategies import kinds


def test_a_budget_for_every_host_within_the_machine_is_planned():
    assert hostcpus.plan_host_cpus(None, 4, 2) is None
    assert hostcpus.plan_host_cpus(0.5, 4, 2) == 0.5
    assert hostcpus.plan_host_cpus(1, 2, 2) == 1.0


@pytest.mark.parametrize("cores,hosts,machine,kw,words", [
    (0.5, 0, 2, {}, "add --hosts N"),
    (0.0, 2, 2, {}, "--host-cpus=0 is not allowed"),
    (-1.0, 2, 2, {}, "positive number of cores"),
    (float("inf"), 2, 2, {}, "--host-cpus=inf is not allowed"),
    (0.6, 4, 2, {}, "--host-cpus=0.6 for 4 hosts is 2.4 cores, more than this machine's 2; "
                    "use at most 0.5 per host, or fewer --hosts"),
    (1.0, 3, 2, {}, "use at most 0.66 per host"),
    (0.5, 2, 2, {"slowed": True}, "drop one of the two"),
    (0.5, 2, 2, {"problem": "no cgroup v1 cpu controller is mounted"},
     "--host-cpus needs CPU cgroups: no cgroup v1 cpu controller is mounted"),
])
def test_a_budget_the_machine_cannot_give_is_one_line(cores, hosts, machine, kw, words):
    with pytest.raises(LaunchError) as err:
        hostcpus.plan_host_cpus(cores, hosts, machine, **kw)
    assert "\n" not in str(err.value) and words in str(err.value), str(err.value)


def test_the_launcher_refuses_a_budget_above_the_machine_before_anything(tmp_path, capsys):
    from tfdist.cli import launch

    model_dir = tmp_path / "run"
    hosts = (os.cpu_count() or 1) + 1
    code = launch.main(["--strategy", "multiworker", "--workers", str(hosts), "--hosts",
                        str(hosts), "--host-cpus", "1", "--", "--model-dir", str(model_dir)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == Exit.BAD_INPUT and len(err) == 1, err
    assert err[0].startswith(f"error: --host-cpus=1 for {hosts} hosts is {hosts} cores")
    assert not model_dir.exists()


def test_under_a_budget_busy_members_size_their_pools_to_it_and_are_not_pinned():
    mw, ps = kinds.get("multiworker"), kinds.get("ps")
    shares = plans.share_cores(mw, ["worker:0", "worker:1"], 2, host_cpus=0.5)
    assert {n: (dict(s.env), s.cpus) for n, s in shares.items()} == {
        "worker:0": ({"TF_NUM_INTRAOP_THREADS": "1"}, ()),
        "worker:1": ({"TF_NUM_INTRAOP_THREADS": "1"}, ())}
    shares = plans.share_cores(ps, ["chief:0", "worker:0", "ps:0"], 8, host_cpus=2.5)
    assert [s.env["TF_NUM_INTRAOP_THREADS"] for s in shares.values()] == ["1", "3", "1"]
    # Without a budget, the cores are shared out and pinned as before.
    assert plans.share_cores(mw, ["worker:0", "worker:1"], 2)["worker:1"].cpus == (1,)


def test_each_host_gets_one_quota_and_one_account_and_they_are_recorded(tmp_path):
    cpu, acct = tmp_path / "cpu", tmp_path / "cpuacct"
    lines = []
    budgets = hostcpus.HostCpus(0.5, {"chief:0": 0, "ps:0": 0, "worker:0": 1}, log=lines.append,
                                roots=(str(cpu), str(acct)))
    assert budgets.cgroups_for("ps:0") == budgets.cgroups_for("chief:0") != \
        budgets.cgroups_for("worker:0")
    quota_dir, acct_dir = budgets.cgroups_for("worker:0")
    assert open(os.path.join(quota_dir, "cpu.cfs_quota_us")).read() == "50000"
    assert open(os.path.join(quota_dir, "cpu.cfs_period_us")).read() == \
        str(cgroups.CFS_PERIOD_US)
    with open(os.path.join(acct_dir, "cpuacct.usage"), "w") as f:
        f.write(str(3_500_000_000))
    with open(os.path.join(quota_dir, "cpu.stat"), "w") as f:
        f.write("nr_periods 100\nnr_throttled 40\nthrottled_time 1250000000\n")
    assert budgets.record() == {
        "host0": {"cores": 0.5, "members": ["chief:0", "ps:0"], "cpu_seconds": None,
                  "throttled_seconds": None},
        "host1": {"cores": 0.5, "members": ["worker:0"], "cpu_seconds": 3.5,
                  "throttled_seconds": 1.25}}
    assert budgets.describe(10.0) == ("[launch] CPU time used per host: host0 ? s; host1 3.5 s "
                                      "(70% of its budget over 10 s, held back 1.25 s)")
    assert lines == ["[launch] host CPUs: 2 host(s) of 0.5 core(s) each (CFS quota 50000 us "
                     "per 100000 us)"]


HOSTS_PROBLEM = network.hosts_problem()
CGROUP_PROBLEM = hostcpus.cgroups_problem()


@pytest.mark.multiprocess
@pytest.mark.skipif(HOSTS_PROBLEM is not None, reason=f"no simulated hosts here: {HOSTS_PROBLEM}")
@pytest.mark.skipif(CGROUP_PROBLEM is not None, reason=f"no CPU cgroups here: {CGROUP_PROBLEM}")
@pytest.mark.timeout(240)
def test_two_hosts_of_half_a_core_each_train_within_their_budgets(tmp_path, spawn):
    from conftest import descendants_alive, launch_cmd, read_results

    model_dir = str(tmp_path / "budget")
    started = time.monotonic()
    p = spawn(launch_cmd("multiworker", "--workers", "2", "--hosts", "2", "--host-cpus", "0.5",
                         "--timeout", "200",
                         train_args=["--model", "logreg", "--steps", "40", "--log-every", "20",
                                     "--model-dir", model_dir]))
    assert p.wait(220) == 0, p.output
    wall = time.monotonic() - started
    assert read_results(model_dir)["global_steps"] == 40
    with open(os.path.join(model_dir, "launch", "outcome.json")) as f:
        outcome = json.load(f)
    budget = outcome["host_cpus"]
    assert set(budget) == {"host0", "host1"}
    for host, member in (("host0", "worker:0"), ("host1", "worker:1")):
        record = budget[host]
        assert record["cores"] == 0.5 and record["members"] == [member]
        # Each member used CPU, never more than its host's half core allows.
        assert 0 < record["cpu_seconds"] <= 0.5 * wall * 1.05 + 0.5, (record, wall)
    assert outcome["first_step_seconds"] > 0 and outcome["launcher_cpu_seconds"] > 0
    assert any(l.startswith("[launch] CPU time used per host: host0 ") for l in p.lines)
    for root in (cgroups.cpu_cgroup_root(), cgroups.cgroup_root("cpuacct")):
        assert glob.glob(os.path.join(root, f"{cgroups.CGROUP_PREFIX}*-host*")) == []
    assert descendants_alive(model_dir) == []


@pytest.mark.long
@pytest.mark.multiprocess
@pytest.mark.skipif(HOSTS_PROBLEM is not None, reason=f"no simulated hosts here: {HOSTS_PROBLEM}")
@pytest.mark.skipif(CGROUP_PROBLEM is not None, reason=f"no CPU cgroups here: {CGROUP_PROBLEM}")
@pytest.mark.timeout(900)
def test_sixteen_workers_on_sixteen_small_hosts_train_and_leave_nothing(tmp_path, spawn):
    from conftest import descendants_alive, launch_cmd, read_results

    model_dir = str(tmp_path / "w16")
    cores = round(int((os.cpu_count() or 1) / 16 * 100) / 100, 2)  # the machine, shared out
    p = spawn(launch_cmd("multiworker", "--workers", "16", "--hosts", "16", "--host-cpus",
                         str(cores), "--timeout", "800",
                         train_args=["--model", "logreg", "--steps", "200", "--log-every", "50",
                                     "--model-dir", model_dir]))
    assert p.wait(850) == 0, p.output
    r = read_results(model_dir)
    assert r["global_steps"] == 200 and r["num_workers"] == 16 and r["replicas_in_sync"] == 16
    with open(os.path.join(model_dir, "launch", "outcome.json")) as f:
        outcome = json.load(f)
    assert outcome["exit_code"] == 0 and len(outcome["host_cpus"]) == 16
    assert all(h["cpu_seconds"] > 0 for h in outcome["host_cpus"].values())
    assert len(outcome["peak_rss_bytes"]) == 16
    assert outcome["first_step_seconds"] > 0 and outcome["launcher_cpu_seconds"] > 0
    for root in (cgroups.cpu_cgroup_root(), cgroups.cgroup_root("cpuacct")):
        assert glob.glob(os.path.join(root, f"{cgroups.CGROUP_PREFIX}*-host*")) == []
    assert descendants_alive(model_dir) == []
