"""The supervisor's own bookkeeping, with stand-in processes (no cluster)."""

import threading

from tfdist.launcher import supervisor
from tfdist.launcher.engine.api import MemberProcess
from conftest import Starting
from tfdist.launcher.state import RestartMember
from tfdist.strategies import kinds


class FakeProc:
    def __init__(self, pid, returncode=None):
        self.pid, self.returncode = pid, returncode

    def poll(self):
        return self.returncode


def _task(name, proc):
    pump = threading.Thread(target=lambda: None)
    pump.start()
    return MemberProcess(name, proc, pump)


def _supervisor(procs, logs):
    """Each start of worker:1 takes the next of ``procs``."""
    queue = list(procs)
    return supervisor.Supervisor(kinds.get("ps"), Starting(lambda name: _task(name, queue.pop(0))),
                                 log=logs.append)


def test_a_restart_is_logged_with_the_new_process():
    logs = []
    sup = _supervisor([FakeProc(11, returncode=-9), FakeProc(12)], logs)
    sup.start(["worker:1"])
    sup.apply(RestartMember("worker:1", "restart 1 of at most 1"))
    assert logs == ["[launch] restarted worker:1 (pid 12), same TF_CONFIG; restart 1 of at most 1"]
    assert sup.starts["worker:1"] == 2


def test_a_restart_the_engine_could_not_make_is_not_logged_as_one():
    """A Ray task whose node is gone ends at once: no process, no pid to name."""
    logs = []
    sup = _supervisor([FakeProc(11, returncode=-9), FakeProc(-3004, returncode=1)], logs)
    sup.start(["worker:1"])
    sup.apply(RestartMember("worker:1", "restart 1 of at most 1"))
    assert logs == ["[launch] could not restart worker:1: it ended at once (code 1)"]
