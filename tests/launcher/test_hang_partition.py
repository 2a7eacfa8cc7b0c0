"""--hang and --partition: parsing, the plan, the injector's timing and the
supervisor's cleanup (no TensorFlow; one test holds a stopped `sleep`)."""

import os
import signal
import subprocess
import sys

import pytest

from conftest import Starting, recovery_plan

from tfdist import protocol
from tfdist.launcher.recovery import faults
from tfdist.launcher.engine.local import start_member
from tfdist.launcher.recovery import injector as injectors
from tfdist.launcher import plan as plans
from tfdist.launcher.state import JobState, SetLink, SignalMember, MemberView
from tfdist.launcher.supervisor import Supervisor
from tfdist.strategies import kinds


PS_TASKS = ["chief:0", "worker:0", "worker:1", "ps:0"]


@pytest.mark.parametrize("action,spec,expected", [
    ("hang", "worker:1@20", faults.Fault("hang", "worker:1", seconds=20.0)),
    ("hang", "worker:1@step=150+20", faults.Fault("hang", "worker:1", step=150, lift_after=20.0)),
    ("hang", " ps:0@2.5s+0.5s ", faults.Fault("hang", "ps:0", seconds=2.5, lift_after=0.5)),
    ("partition", "host1@30", faults.Fault("partition", "host1", seconds=30.0)),
    ("partition", "host2@step=100+10", faults.Fault("partition", "host2", step=100,
                                                    lift_after=10.0)),
])
def test_parse_lasting_faults(action, spec, expected):
    fault = faults.parse_fault(action, spec)
    assert fault == expected
    assert faults.parse_fault(action, str(fault).split(" ", 1)[1]) == fault  # str round-trips


@pytest.mark.parametrize("action,spec,words", [
    ("hang", "worker:1", ["'worker:1'", "ROLE:INDEX@WHEN[+SECONDS]"]),
    ("hang", "worker:1@20+", ["'worker:1@20+'", "+SECONDS"]),
    ("hang", "worker:1@20+x", ["ROLE:INDEX@WHEN[+SECONDS]"]),
    ("hang", "worker:1@20+-5", ["ROLE:INDEX@WHEN[+SECONDS]"]),
    ("hang", "worker:1@20+0", ["+SECONDS must be above 0", "received 0"]),
    ("hang", "host1@20", ["'host1@20'", "ROLE:INDEX"]),
    ("partition", "worker:1@20", ["'worker:1@20'", "hostN@WHEN[+SECONDS]"]),
    ("partition", "host@20", ["hostN@WHEN"]),
    ("partition", "host1@step=+5", ["hostN@WHEN"]),
    ("partition", "host1@5+0.0", ["+SECONDS must be above 0"]),
])
def test_bad_lasting_fault_specs_say_the_expected_form(action, spec, words):
    with pytest.raises(plans.LaunchError) as err:
        faults.parse_fault(action, spec)
    for word in words:
        assert word in str(err.value)


def test_kill_takes_no_duration():
    with pytest.raises(plans.LaunchError, match="ROLE:INDEX@WHEN"):
        faults.parse_fault("kill", "worker:1@20+5")


def test_plan_recovery_puts_hangs_and_partitions_in_the_plan():
    plan = recovery_plan(kinds.get("ps"), PS_TASKS, hang=["worker:1@step=10+5"],
                                partition=["host2@30"], hosts=3, kill=["worker:0@50"])
    assert plan.faults == (faults.Fault("kill", "worker:0", seconds=50.0),
                           faults.Fault("hang", "worker:1", step=10, lift_after=5.0),
                           faults.Fault("partition", "host2", seconds=30.0))


@pytest.mark.parametrize("kwargs,words", [
    (dict(hang=["worker:5@3"]), ["--hang worker:5@3s", "does not have", "chief:0, worker:0"]),
    (dict(partition=["host1@3"]), ["--partition host1@3s", "needs --hosts N"]),
    (dict(partition=["host3@3"], hosts=3), ["host3", "does not have", "host0, host1, host2"]),
])
def test_plan_recovery_rejects_hangs_and_partitions(kwargs, words):
    with pytest.raises(plans.LaunchError) as err:
        recovery_plan(kinds.get("ps"), PS_TASKS, **kwargs)
    for word in words:
        assert word in str(err.value)


def _state(pid=101, exit_code=None):
    return JobState(tuple(MemberView(n, pid if n == "worker:1" else 1, exit_code
                                   if n == "worker:1" else None) for n in PS_TASKS))


def test_injector_hangs_then_continues_after_its_seconds_and_records_both():
    now, lines = [0.0], []
    injector = injectors.FaultInjector(
        [faults.Fault("hang", "worker:1", seconds=10.0, lift_after=5.0),
         faults.Fault("partition", "host1", seconds=12.0, lift_after=2.0)],
        log=lines.append, clock=lambda: now[0])
    assert injector(_state()) == []
    now[0] = 10.0
    assert injector(_state()) == [SignalMember("worker:1", signal.SIGSTOP, group=True, pid=101)]
    assert "sent SIGSTOP to worker:1 (pid 101)" in lines[-1] and "SIGCONT in 5s" in lines[-1]
    now[0] = 12.0
    assert injector(_state()) == [SetLink(1, up=False)]
    now[0] = 14.9
    assert injector(_state()) == [SetLink(1, up=True)]  # 12 + 2
    now[0] = 15.0
    assert injector(_state()) == [SignalMember("worker:1", signal.SIGCONT, group=True, pid=101)]
    assert injector(_state()) == []
    assert injector.fired == ["--hang worker:1@10s+5s", "--partition host1@12s+2s"]
    hang, partition = injector.records
    assert hang == {"kind": "hang", "target": "worker:1", "at_seconds": 10.0, "at_step": 0,
                    "lift_after": 5.0, "lifted_at_seconds": 15.0, "lifted_by": "schedule"}
    assert partition["lifted_at_seconds"] == 14.9 and partition["kind"] == "partition"


def test_a_hang_without_seconds_is_recorded_as_lifted_by_the_cleanup():
    now = [0.0]
    injector = injectors.FaultInjector([faults.Fault("hang", "worker:1", seconds=1.0),
                                     faults.Fault("kill", "worker:0", seconds=1.0)],
                                    log=lambda m: None, clock=lambda: now[0])
    now[0] = 1.0
    actions = injector(_state())
    assert SignalMember("worker:1", signal.SIGSTOP, group=True, pid=101) in actions
    now[0] = 1000.0
    assert [a for a in injector(_state()) if a.sig == signal.SIGCONT] == []  # never by itself
    injector.end_attempt()
    hang = next(r for r in injector.records if r["kind"] == "hang")
    assert hang["lifted_by"] == "launcher cleanup" and hang["lifted_at_seconds"] == 1000.0
    kill = next(r for r in injector.records if r["kind"] == "kill")
    assert "lifted_by" not in kill


def test_a_hung_task_that_is_gone_is_not_continued():
    now = [0.0]
    injector = injectors.FaultInjector([faults.Fault("hang", "worker:1", seconds=0.0,
                                                  lift_after=1.0)],
                                    log=lambda m: None, clock=lambda: now[0])
    assert injector(_state(pid=101))
    now[0] = 2.0
    assert injector(_state(pid=202)) == []  # restarted meanwhile: another process
    assert injector.records[0]["lifted_by"] == "task gone"


def test_a_task_hung_for_good_that_is_replaced_ends_the_hang_with_its_process():
    now = [0.0]
    injector = injectors.FaultInjector([faults.Fault("hang", "worker:1", seconds=0.0)],
                                    log=lambda m: None, clock=lambda: now[0])
    assert injector(_state(pid=101))
    now[0] = 5.0
    assert injector(_state(pid=101)) == []  # still the hung process: nothing to do
    assert injector.records[0]["lifted_by"] is None
    now[0] = 9.0
    assert injector(_state(pid=202)) == []  # killed as stuck and restarted
    assert injector.records[0]["lifted_by"] == "task gone"
    assert injector.records[0]["lifted_at_seconds"] == 9.0
    injector.end_attempt()  # the cleanup leaves the record as it is
    assert injector.records[0]["lifted_by"] == "task gone"


def _stopped(pid: int) -> bool:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] == "T"


def test_supervisor_stop_continues_a_hung_task_before_killing_it():
    """A SIGSTOPped task cannot act on SIGTERM: the cleanup must SIGCONT it."""
    lines = []

    def starter(name):
        # Ignores nothing: a continued task ends at the SIGTERM.
        return start_member(name, None, [sys.executable, "-c",
                                                 "import time; time.sleep(120)"], {},
                                    sink=open(os.devnull, "w"))

    sup = Supervisor(kinds.get("ps"), Starting(starter), log=lines.append, grace=30)
    sup.start(["worker:1"])
    pid = sup.members["worker:1"].proc.pid
    sup.apply(SignalMember("worker:1", signal.SIGSTOP, group=True, pid=pid))
    for _ in range(100):
        if _stopped(pid):
            break
        subprocess.run(["sleep", "0.05"])
    assert _stopped(pid) and sup.hung == {"worker:1": pid}
    sup.stop()
    # Ended by the SIGTERM (well before --grace 30 s's SIGKILL): it was continued first.
    assert sup.members["worker:1"].proc.returncode == -signal.SIGTERM
    assert any("still hung: SIGCONT before stopping it" in l for l in lines)
    assert sup.hung == {}


class FakeHosts:
    def __init__(self):
        self.calls = []

    def set_link(self, host, up):
        self.calls.append((host, up))


def test_supervisor_brings_a_downed_link_up_when_it_stops():
    net = FakeHosts()
    sup = Supervisor(kinds.get("ps"), Starting(None), log=lambda m: None, network=net)
    sup.apply(SetLink(2, up=False))
    assert sup.links_down == {2}
    sup.stop()
    assert net.calls == [(2, False), (2, True)] and sup.links_down == set()
    sup.apply(SetLink(1, up=False))
    sup.apply(SetLink(1, up=True))
    sup.stop()
    assert net.calls[-2:] == [(1, False), (1, True)]  # lifted once, not again


def test_outcome_keeps_the_fault_records(tmp_path):
    record = {"kind": "hang", "target": "worker:1", "at_seconds": 3.0, "at_step": 10,
              "lift_after": None, "lifted_at_seconds": 9.0, "lifted_by": "launcher cleanup"}
    path = str(tmp_path / "outcome.json")
    protocol.LaunchOutcome(0, ["--hang worker:1@3s"], 0, 0, faults=[record]).write(path)
    assert protocol.LaunchOutcome.load(path).faults == [record]
