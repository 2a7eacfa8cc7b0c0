"""Simulated hosts, links and slow workers: the pure parts, and the OS mechanisms on trivial processes.

No TensorFlow here: the plan and the flags are pure; the network, cgroup and
duty-cycle tests (marked ``multiprocess``) start a busy Python loop or the
link probe, never a cluster.
"""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import Starting, recovery_plan

from tfdist import protocol
from tfdist.launcher import attempts, files, outcome, supervisor
from tfdist.launcher.machine import cgroups
from tfdist.launcher.recovery import faults
from tfdist.launcher.machine import network
from tfdist.launcher.engine.api import Placement
from tfdist.launcher.engine.local import LocalEngine, child_setup, start_member
from tfdist.launcher.recovery import injector as injectors
from tfdist.launcher.recovery import restarter as restarters
from tfdist.launcher.machine import slowdown as slowdowns
from tfdist.launcher import plan as plans
from tfdist.launcher.config import LaunchConfig, Limits, MemberArgs
from tfdist.options import TrainOptions
from tfdist.launcher.state import JobState, RestartMember, SignalMember, SlowMember, MemberView
from tfdist.strategies import kinds, parse_tf_config


# --- the host plan (pure) ------------------------------------------------------------------

def test_ps_on_three_hosts_coordinators_on_host0_one_worker_per_other_host():
    plan = plans.build_host_cluster(kinds.get("ps"), workers=2, ps=1, hosts=3)
    assert plan.host_of == {"chief:0": 0, "worker:0": 1, "worker:1": 2, "ps:0": 0}
    assert plan.tf_configs["ps:0"]["cluster"] == {
        "chief": ["10.77.0.11:2222"], "worker": ["10.77.0.12:2222", "10.77.0.13:2222"],
        "ps": ["10.77.0.11:2223"],  # the second task on host0 takes the next port
    }
    assert plan.where("worker:1") == "host2 (10.77.0.13)"


def test_multiworker_on_two_hosts_same_port_distinct_addresses():
    plan = plans.build_host_cluster(kinds.get("multiworker"), workers=2, hosts=2)
    assert plan.host_of == {"worker:0": 0, "worker:1": 1}
    addresses = plan.tf_configs["worker:0"]["cluster"]["worker"]
    assert addresses == ["10.77.0.11:2222", "10.77.0.12:2222"]
    for name, tf_config in plan.tf_configs.items():
        cluster = parse_tf_config(json.dumps(tf_config))  # our own reader accepts it
        assert cluster.member_name == name


@pytest.mark.parametrize("strategy,workers,ps,chief,hosts,expected", [
    # Round-robin when every task computes.
    ("multiworker", 3, 0, False, 2, {"worker:0": 0, "worker:1": 1, "worker:2": 0}),
    ("multiworker", 2, 0, True, 3, {"chief:0": 0, "worker:0": 1, "worker:1": 2}),
    ("multiworker", 2, 0, False, 1, {"worker:0": 0, "worker:1": 0}),
    # Coordinators share host 0 when the workers need every other host...
    ("ps", 3, 1, False, 2, {"chief:0": 0, "worker:0": 1, "worker:1": 1, "worker:2": 1, "ps:0": 0}),
    # ...and spread over the hosts the workers leave free.
    ("ps", 2, 1, False, 4, {"chief:0": 0, "worker:0": 2, "worker:1": 3, "ps:0": 1}),
    ("ps", 1, 2, False, 4, {"chief:0": 0, "worker:0": 3, "ps:0": 1, "ps:1": 2}),
    ("ps", 2, 1, False, 1, {"chief:0": 0, "worker:0": 0, "worker:1": 0, "ps:0": 0}),
])
def test_task_placement(strategy, workers, ps, chief, hosts, expected):
    plan = plans.build_host_cluster(kinds.get(strategy), workers, ps, chief, hosts)
    assert plan.host_of == expected
    # No two tasks on one host share a port; tasks on different hosts may.
    addresses = [tc["cluster"][tc["task"]["type"]][tc["task"]["index"]]
                 for tc in plan.tf_configs.values()]
    assert len(set(addresses)) == len(addresses)
    for name, h in plan.host_of.items():
        tc = plan.tf_configs[name]
        assert tc["cluster"][tc["task"]["type"]][tc["task"]["index"]].startswith(
            plans.host_address(h) + ":")


@pytest.mark.parametrize("args,words", [
    (("ps", 2, 1, False, 5), "--hosts=5, but this cluster has 4 task(s)"),
    (("multiworker", 2, 0, False, 0), "--hosts=0"),
    (("mirrored", 1, 0, False, 1), "is one process: drop --hosts"),
    (("ps", 2, 0, False, 2), "--ps >= 1"),
])
def test_bad_host_plans(args, words):
    strategy, *rest = args
    with pytest.raises(plans.LaunchError) as err:
        plans.build_host_cluster(kinds.get(strategy), *rest)
    assert words in str(err.value) and "\n" not in str(err.value)


def test_saved_files_say_which_host_each_task_is_on(tmp_path):
    plan = plans.build_host_cluster(kinds.get("ps"), workers=2, ps=1, hosts=3)
    files.save_launch_files(str(tmp_path), plan, ["python", "train.py", "--strategy=ps"])
    script = (tmp_path / "commands.sh").read_text()
    assert "# worker:1 on host2 (10.77.0.13)" in script
    assert "# chief:0 on host0 (10.77.0.11)" in script
    hosts = json.loads((tmp_path / "hosts.json").read_text())
    assert hosts["host0"] == {"address": "10.77.0.11", "tasks": ["chief:0", "ps:0"]}
    saved = json.loads((tmp_path / "worker-1.tf_config.json").read_text())
    assert saved == plan.tf_configs["worker:1"]


# --- links (pure) -------------------------------------------------------------------------

@pytest.mark.parametrize("text,bits", [("100mbit", 10**8), ("1gbit", 10**9), ("1.5Gbit", 15 * 10**8),
                                       ("5000kbit", 5 * 10**6)])
def test_parse_rate(text, bits):
    assert network.parse_rate(text) == bits


@pytest.mark.parametrize("text", ["100", "100mbps", "fast", "500kbit", "20gbit", ""])
def test_parse_rate_rejects(text):
    with pytest.raises(plans.LaunchError, match="--link-rate"):
        network.parse_rate(text)


def test_token_bucket_holds_a_full_segment_and_5ms():
    assert network.tbf_args(10**8)[:5] == ["tbf", "rate", "100000000bit", "burst", "62500"]
    assert int(network.tbf_args(10**6)[4]) == 32 * 1024


@pytest.mark.parametrize("rate,size", [(10**8, 7_500_000), (10**6, 8 * 32 * 1024),
                                       (10**10, 64 << 20)])
def test_link_probe_size(rate, size):
    assert network.probe_bytes(rate) == size


@pytest.mark.parametrize("hosts,netns,rate,words", [
    (0, "auto", "100mbit", "add --hosts N with N >= 2"),
    (1, "auto", "100mbit", "add --hosts N with N >= 2"),
    (2, "off", None, "cannot be combined with --netns off"),
])
def test_hosts_mode_needs_namespaces_and_two_hosts_for_a_link(hosts, netns, rate, words):
    with pytest.raises(plans.LaunchError, match=words):
        network.check_hosts_mode(hosts, netns, rate, lambda: None)


def test_hosts_mode_names_why_namespaces_are_missing():
    with pytest.raises(plans.LaunchError, match=r"needs network namespaces.*\(denied\)"):
        network.check_hosts_mode(2, "auto", None, lambda: "denied")
    network.check_hosts_mode(0, "off", None, lambda: pytest.fail("probed without --hosts"))


# --- slow workers (pure) ----------------------------------------------------------------------

@pytest.mark.parametrize("spec,expected", [
    ("worker:1=0.25", faults.Slow("worker:1", 0.25)),
    ("worker:0=.5@step=200", faults.Slow("worker:0", 0.5, step=200)),
    ("chief:0=0.1@30s", faults.Slow("chief:0", 0.1, seconds=30.0)),
])
def test_parse_slow(spec, expected):
    assert faults.parse_slow(spec) == expected


@pytest.mark.parametrize("spec,words", [
    ("worker:1", "ROLE:INDEX=FRACTION"), ("worker:1=1", "below 1"), ("worker:1=0", "above 0"),
    ("worker:1=0.5@", "ROLE:INDEX=FRACTION"), ("worker1=0.5", "ROLE:INDEX=FRACTION"),
])
def test_parse_slow_rejects(spec, words):
    with pytest.raises(plans.LaunchError, match=words):
        faults.parse_slow(spec)


def _recovery(tasks, strategy="ps", **flags):
    """plan_recovery with the launcher's defaults, as launch.py calls it."""
    return recovery_plan(kinds.get(strategy), tasks, **flags)


def test_plan_recovery_checks_slow_tasks():
    tasks = plans.build_cluster(kinds.get("ps"), 2, ps=1, ports=[1, 2, 3, 4])
    plan = _recovery(tasks, slow=["worker:1=0.25"], kill=["worker:1@step=5"],
                     restart_tasks=True)
    assert plan.slow == (faults.Slow("worker:1", 0.25),) and plan.restart_tasks
    with pytest.raises(plans.LaunchError, match="worker:3.*does not have"):
        _recovery(tasks, slow=["worker:3=0.5"])
    with pytest.raises(plans.LaunchError, match="twice"):
        _recovery(tasks, slow=["worker:1=0.5", "worker:1=0.2@step=3"])


def test_quota_is_the_fraction_of_the_cores_the_task_would_use():
    assert cgroups.quota_us(0.25, 1) == 25_000
    assert cgroups.quota_us(0.5, 2) == 100_000
    assert cgroups.quota_us(0.001, 1) == 1000  # the kernel's minimum
    assert plans.CoreShare({}, (2, 3)).cores(8) == 2
    assert plans.CoreShare({"TF_NUM_INTRAOP_THREADS": "1"}).cores(8) == 8


def test_injector_returns_a_slow_action_when_its_step_comes(tmp_path):
    events = str(tmp_path / "chief-0.jsonl")
    logs = []
    injector = injectors.FaultInjector([faults.Slow("worker:1", 0.5, step=10)], log=logs.append,
                                    event_paths=[events])
    state = JobState((MemberView("chief:0", 11), MemberView("worker:1", 12)))
    assert injector(state) == []
    protocol.EventLog("chief:0", events).emit(protocol.PROGRESS, 10)
    assert injector(state) == [SlowMember("worker:1", 0.5)]
    assert injector(state) == [] and "runs at 50% of its speed" in logs[-1]


def test_restarter_asks_for_a_restart_after_the_delay_and_at_most_limit_times():
    now = [0.0]
    restarter = restarters.MemberRestarter(1.0, log=lambda m: None, limit=1, clock=lambda: now[0])
    dead = JobState((MemberView("worker:0", 5, exit_code=-9), MemberView("ps:0", 6)))
    assert restarter(dead) == []  # the delay starts
    now[0] = 1.5
    assert restarter(dead) == [RestartMember("worker:0", "restart 1 of at most 1")]
    now[0] = 5.0
    assert restarter(dead) == [] and restarter(dead) == []  # limit reached


def test_restarter_kills_a_worker_the_chief_reports_stuck_once_then_restarts_it(tmp_path):
    events = str(tmp_path / "chief-0.jsonl")
    logs = []
    now = [0.0]
    restarter = restarters.MemberRestarter(1.0, log=logs.append, limit=3, clock=lambda: now[0],
                                     event_paths=[events])
    running = JobState((MemberView("chief:0", 11), MemberView("worker:1", 12), MemberView("ps:0", 13)))
    assert restarter(running) == []
    log = protocol.EventLog("chief:0", events)
    log.emit(protocol.STUCK, 370, peer="worker:1")
    log.emit(protocol.STUCK, 370, peer="ps:0")  # not a role it restarts: left to the chief
    assert restarter(running) == [SignalMember("worker:1", signal.SIGKILL, group=True, pid=12)]
    assert "worker:1 (pid 12) is stuck (chief:0 found it" in logs[-1]
    log.emit(protocol.STUCK, 375, peer="worker:1")  # the same process again: killed once
    assert restarter(running) == []
    dead = JobState((MemberView("chief:0", 11), MemberView("worker:1", 12, exit_code=-9),
                     MemberView("ps:0", 13)))
    assert restarter(dead) == []  # the delay starts, as for any dead worker
    now[0] = 1.5
    assert restarter(dead) == [RestartMember("worker:1", "restart 1 of at most 3")]


def test_preempt_grace_kills_only_the_same_process():
    now = [0.0]
    injector = injectors.FaultInjector([faults.Fault("preempt", "worker:0", seconds=0)],
                                    log=lambda m: None, clock=lambda: now[0], grace=2.0)
    state = JobState((MemberView("worker:0", 40),))
    assert injector(state) == [SignalMember("worker:0", signal.SIGTERM, group=False, pid=40)]
    now[0] = 3.0
    assert injector(JobState((MemberView("worker:0", 41),))) == []  # restarted meanwhile
    injector._terminating = [("worker:0", 40, 2.0)]
    assert injector(state) == [SignalMember("worker:0", signal.SIGKILL, group=True, pid=40)]


def test_worker_rates_from_ps_chief_events(tmp_path):
    path = str(tmp_path / "chief-0.jsonl")
    log = protocol.EventLog("chief:0", path)
    for i, (a, b) in enumerate([(10, 2), (60, 12), (110, 22)]):
        event = protocol.Event(protocol.PROGRESS, "chief:0", a + b, 100.0 + 10 * i,
                               {"steps_per_worker": {"worker:0": a, "worker:1": b}})
        with open(log.path, "a") as f:
            f.write(event.to_json() + "\n")
    rates = outcome.worker_rates(kinds.get("ps"), outcome.job_events(
        {"chief:0": path, "worker:0": str(tmp_path / "none")}))
    assert rates == {"worker:0": {"steps": 110, "share": 0.8333, "steps_per_sec": 5.0},
                     "worker:1": {"steps": 22, "share": 0.1667, "steps_per_sec": 1.0}}
    assert "worker:1 22 local steps (17%), 1.0 steps/s" in outcome.describe_rates(rates)


def test_worker_rates_from_one_report_say_why_there_is_no_rate(tmp_path):
    path = str(tmp_path / "chief-0.jsonl")
    with open(path, "w") as f:
        f.write(protocol.Event(protocol.PROGRESS, "chief:0", 200, 100.0,
                               {"steps_per_worker": {"worker:0": 98, "worker:1": 102}}
                               ).to_json() + "\n")
    rates = outcome.worker_rates(kinds.get("ps"), outcome.job_events({"chief:0": path}))
    assert rates["worker:0"] == {"steps": 98, "share": 0.49, "steps_per_sec": None}
    line = outcome.describe_rates(rates)
    assert line.startswith("worker:0 98 local steps (49%); worker:1 102 local steps (51%) (steps/s needs")
    assert "?" not in line and "--log-every" in line


def test_worker_rates_from_sync_workers_own_events(tmp_path):
    paths = {}
    for name, per_sec in (("worker:0", 20.0), ("worker:1", 20.0)):
        paths[name] = str(tmp_path / f"{name}.jsonl")
        with open(paths[name], "w") as f:
            for step in (100, 200, 300):
                f.write(protocol.Event(protocol.PROGRESS, name, step, step / per_sec,
                                       {"steps_per_sec": 1.0}).to_json() + "\n")
    rates = outcome.worker_rates(kinds.get("multiworker"), outcome.job_events(paths))
    assert rates["worker:1"] == {"steps": 300, "share": None, "steps_per_sec": 20.0}


def test_launch_outcome_reads_files_without_the_new_fields(tmp_path):
    path = tmp_path / "outcome.json"
    path.write_text(json.dumps({"exit_code": 0, "faults_fired": [], "task_restarts": 0,
                                "job_relaunches": 0, "schema_version": 1}))
    outcome = protocol.LaunchOutcome.load(str(path))
    assert outcome.per_task is None and outcome.schema_version == protocol.SCHEMA_VERSION


# --- the mechanisms, on trivial processes --------------------------------------------------

CGROUP_PROBLEM = cgroups.cgroup_problem()
needs_cgroup = pytest.mark.skipif(CGROUP_PROBLEM is not None,
                                  reason=f"no CPU-quota cgroup here: {CGROUP_PROBLEM}")
_BURN = "import time\nt = time.process_time()\nwhile time.process_time() - t < 1e9: pass\n"


def _cpu_seconds(pid):
    # schedstat counts CPU time in ns; /proc/<pid>/stat counts 10 ms ticks,
    # which read 10 ms runs of the duty cycle as up to twice as long.
    with open(f"/proc/{pid}/schedstat") as f:
        return int(f.read().split()[0]) / 1e9


def _burn_rate(member, seconds=2.0):
    """CPU seconds per second the busy loop got, over ``seconds``."""
    c0, t0 = _cpu_seconds(member.proc.pid), time.monotonic()
    time.sleep(seconds)
    return (_cpu_seconds(member.proc.pid) - c0) / (time.monotonic() - t0)


@pytest.mark.multiprocess
@pytest.mark.parametrize("method", [
    pytest.param("cgroup", marks=needs_cgroup), pytest.param("signals", marks=pytest.mark.long)])
@pytest.mark.timeout(60)
def test_slowdown_caps_a_busy_process_and_a_restart_is_slowed_again(method):
    # A cap is a ceiling whatever else runs on the machine (other jobs share
    # these cores), so the slowed rate is checked against it from above; the
    # unslowed control only needs to beat it clearly.
    fraction = 0.05
    # The quota is exact; the duty cycle's stop comes as late as this
    # launcher thread wakes on a busy machine.
    ceiling = fraction * (1.5 if method == "cgroup" else 2.0)
    slow = slowdowns.Slowdown({"worker:1": 1}, log=lambda m: None, method=method)
    started = []

    def starter(name):
        place = Placement(cgroup=slow.cgroup_for(name))
        member = start_member(name, None, [sys.executable, "-c", _BURN], {},
                                    sink=open(os.devnull, "w"), place=place)
        started.append(member)
        return member

    sup = supervisor.Supervisor(kinds.get("ps"), Starting(starter), log=lambda m: None, grace=2,
                                slowdown=slow)
    try:
        sup.start(["worker:1"])
        full = _burn_rate(started[-1])
        if full < 1.5 * ceiling:
            pytest.skip(f"this machine is too busy to see a cap: a busy loop got {full:.2f} core")
        sup.apply(SlowMember("worker:1", fraction))
        rate = _burn_rate(started[-1])
        assert 0.01 < rate < ceiling, rate
        sup.apply(SignalMember("worker:1", signal.SIGKILL))
        started[-1].proc.wait(10)
        sup.reap()
        sup.apply(RestartMember("worker:1"))
        assert started[-1].proc.pid != started[0].proc.pid
        if method == "cgroup":
            # The restarted process joined the cgroup before exec.
            with open(f"/proc/{started[-1].proc.pid}/cgroup") as f:
                cpu = [l for l in f if "cpu" in l.split(":")[1].split(",")]
            assert cpu and cpu[0].strip().endswith(os.path.basename(slow.cgroups["worker:1"]))
        rate = _burn_rate(started[-1])
        assert 0.01 < rate < ceiling, rate
    finally:
        sup.stop()
        cgroups = list(slow.cgroups.values())
        slow.close()
    assert all(not os.path.exists(p) for p in cgroups)


HOSTS_PROBLEM = network.hosts_problem()
needs_hosts = pytest.mark.skipif(HOSTS_PROBLEM is not None,
                                 reason=f"no simulated hosts here: {HOSTS_PROBLEM}")


@pytest.mark.multiprocess
@needs_hosts
@pytest.mark.timeout(60)
def test_shaped_link_measures_within_a_quarter_of_the_set_rate():
    proc = subprocess.run([sys.executable, "-m", "tfdist.cli.tools.hosts", "--hosts", "2",
                           "--link-rate", "50mbit"], capture_output=True,
                          text=True, timeout=50)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["set_bits_per_sec"] == 50 * 10**6
    assert 0.75 <= result["measured_bits_per_sec"] / result["set_bits_per_sec"] <= 1.25, result
    # The control: unshaped, the same transfer runs far faster than the set rate.
    proc = subprocess.run([sys.executable, "-m", "tfdist.cli.tools.hosts", "--hosts", "2"],
                          capture_output=True, text=True, timeout=50)
    assert json.loads(proc.stdout.strip().splitlines()[-1])["measured_bits_per_sec"] > 4 * 50 * 10**6


_RELAUNCHED = """import os, sys
marker = sys.argv[-1]
cpu = [l.strip() for l in open("/proc/self/cgroup") if "cpu" in l.split(":")[1].split(",")]
print("cgroup", cpu[0].rsplit("/", 1)[1] if cpu else "none", flush=True)
if not os.path.exists(marker):
    open(marker, "w").close()
    sys.exit(75)  # a lost peer: relaunch me
"""


@pytest.mark.multiprocess
@needs_cgroup
@pytest.mark.timeout(60)
def test_a_relaunched_job_starts_its_slowed_task_in_the_cgroup_again(tmp_path, capsys):
    plan = plans.loopback_plan(kinds.get("mirrored"), 1, 0, False, None)
    recovery = _recovery(plan.tf_configs, strategy="mirrored", slow=["local:0=0.5"],
                         max_restarts=1, restart_delay=0)
    program = tmp_path / "relaunched.py"
    program.write_text(_RELAUNCHED)
    config = LaunchConfig(kind=kinds.get("mirrored"), plan=plan, recovery=recovery,
                          limits=Limits(grace=2.0, timeout=30.0), program=str(program),
                          member=MemberArgs(options=TrainOptions(model_dir=str(tmp_path)),
                                            extra=(str(tmp_path / "marker"),)))
    launch_dir = tmp_path / "launch"
    logs = []
    engine = LocalEngine(config)
    try:
        assert engine.open(logs.append) is None
        code = attempts.run_job(attempts.RunContext(config, engine, logs.append))
    finally:
        engine.close()
    assert code == 0, logs
    out = [l for l in capsys.readouterr().out.splitlines() if "cgroup" in l]
    expected = f"[local:0] cgroup {cgroups.CGROUP_PREFIX}{os.getpid()}-local-0"
    assert out == [expected, expected], out  # both attempts, each from its first instruction
    assert any(l.startswith("[launch] relaunching the job (1 of") for l in logs)
    outcome = protocol.LaunchOutcome.load(str(launch_dir / "outcome.json"))
    assert outcome.slowed == ["--slow local:0=0.5"] and outcome.job_relaunches == 1
    assert not os.path.exists(os.path.join(cgroups.cpu_cgroup_root(),
                                           f"{cgroups.CGROUP_PREFIX}{os.getpid()}-local-0"))


@needs_cgroup
@pytest.mark.timeout(60)
def test_closing_a_slowdown_ends_a_straggler_left_in_its_cgroup():
    # A task's child (its watchdog) can outlive the reaped task inside the
    # slowed cgroup; the cgroup must still go, and the child with it.
    slow = slowdowns.Slowdown({"worker:1": 1}, log=lambda m: None, method="cgroup")
    slow.activate("worker:1", 0.05)
    path = slow.cgroups["worker:1"]
    straggler = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"],
                                 preexec_fn=child_setup(Placement(cgroup=path)))
    try:
        with open(os.path.join(path, "cgroup.procs")) as f:
            assert str(straggler.pid) in f.read().split()
        slow.close()
        assert straggler.wait(10) == -signal.SIGKILL
        assert not os.path.exists(path)
    finally:
        straggler.kill()
        straggler.wait()
