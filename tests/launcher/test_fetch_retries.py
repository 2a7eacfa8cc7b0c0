"""Transient RPC errors on the ps chief's fetch path are retried, then end the job
with one line and exit 75 (seen: gRPC status 13 "Unable to parse request"
while copying a finished closure's outputs). Fake remote values, no cluster."""

import collections
import types

import pytest
import tensorflow as tf

from tfdist.cli import train
from tfdist.protocol import Exit
from tfdist.training.sync import preemption
from tfdist.training.loop.survival import recovery
from tfdist.training.ps import rpc


def parse_error():
    # What the chief saw: gRPC INTERNAL (13), not a lost worker.
    return tf.errors.InternalError(None, None, "Unable to parse request\n"
                                   "\tAdditional GRPC error information: {grpc_status:13}")


class FlakyRemote:
    """A RemoteValue whose fetch() raises ``errors`` in turn, then returns ``value``."""

    def __init__(self, errors, value=None):
        self.errors, self.value, self.calls = list(errors), value, 0

    def fetch(self):
        self.calls += 1
        if self.errors:
            raise self.errors.pop(0)
        return self.value


class AlwaysFailing:
    calls = 0

    def fetch(self):
        self.calls += 1
        raise parse_error()


def _fetch(remote, **kw):
    sleeps, lines = [], []
    out = rpc.fetch(remote, deadline=float("inf"), member="chief:0", sleep=sleeps.append,
                         log=lines.append, worker_failure=lambda err: False, **kw)
    return out, sleeps, lines


def test_an_internal_error_once_is_retried_and_the_value_returned():
    remote = FlakyRemote([parse_error()], value={"loss": 0.5})
    out, sleeps, lines = _fetch(remote)
    assert out == {"loss": 0.5} and remote.calls == 2
    assert sleeps == [rpc.TRANSIENT_BACKOFF]
    assert len(lines) == 1 and lines[0].startswith("warning: chief:0: fetching")
    assert "InternalError: Unable to parse request" in lines[0] and "retry 1 of 3" in lines[0]


def test_an_unknown_error_twice_is_retried_with_a_doubling_backoff():
    remote = FlakyRemote([tf.errors.UnknownError(None, None, "x"),
                          tf.errors.UnknownError(None, None, "y")], value=7)
    out, sleeps, _ = _fetch(remote)
    assert out == 7 and sleeps == [0.5, 1.0]


def test_an_error_that_never_clears_ends_with_one_line_not_a_traceback():
    remote = AlwaysFailing()
    with pytest.raises(recovery.RpcFailed) as err:
        _fetch(remote)
    assert remote.calls == rpc.TRANSIENT_RETRIES + 1
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith("chief:0: fetching a finished step's results failed 4 times")
    assert "InternalError: Unable to parse request" in message and "relaunch" in message
    assert err.value.__suppress_context__  # no chained TensorFlow error under it


def test_the_retry_count_is_a_parameter():
    remote = AlwaysFailing()
    with pytest.raises(recovery.RpcFailed, match="failed 1 times"):
        _fetch(remote, retries=0)
    assert remote.calls == 1


@pytest.mark.parametrize("error", [ValueError("a bug"),
                                   tf.errors.InvalidArgumentError(None, None, "bad shape")])
def test_other_errors_are_not_retried(error):
    remote = FlakyRemote([error], value=1)
    with pytest.raises(type(error)):
        _fetch(remote)
    assert remote.calls == 1


def test_a_lost_worker_is_still_waited_for_until_the_deadline():
    lost = tf.errors.UnavailableError(None, None, "/job:worker/replica:0/task:1 Socket closed")
    remote = FlakyRemote([lost, lost], value="rerun")
    sleeps = []
    assert rpc.fetch(remote, deadline=float("inf"), sleep=sleeps.append,
                          worker_failure=lambda err: err is lost) == "rerun"
    assert sleeps == [0.2, 0.2]  # retry_every, no transient count used up
    with pytest.raises(tf.errors.UnavailableError):
        rpc.fetch(FlakyRemote([lost]), deadline=0.0, sleep=sleeps.append,
                       worker_failure=lambda err: err is lost)


def test_train_py_ends_an_rpc_failure_with_one_error_line_and_75(capsys):
    code = train.fault_exit(recovery.RpcFailed("chief:0: fetching ... failed 4 times"))
    assert code == Exit.TASK_LOST == 75
    err = capsys.readouterr().err
    assert err.splitlines() == ["error: chief:0: fetching ... failed 4 times"]


def test_a_peer_lost_before_training_is_one_error_line_and_75(capsys):
    lost = tf.errors.UnavailableError(None, None, "Socket closed\nAdditional GRPC error information")
    assert train.fault_exit(lost) == Exit.TASK_LOST
    assert capsys.readouterr().err.splitlines() == [
        "error: a peer task became unreachable before training (UnavailableError: Socket closed); "
        "relaunch to resume from the last checkpoint"]
    assert train.fault_exit(tf.errors.InternalError(None, None, "a bug")) is None


def test_the_ps_trainer_fetches_through_the_retrying_path(monkeypatch):
    """``PsTrainer._collect_one`` (the chief's fetch) survives one InternalError."""
    from tfdist.training.ps import ps_trainer

    monkeypatch.setattr(rpc.time, "sleep", lambda s: None)
    monkeypatch.setattr(rpc, "is_worker_failure", lambda err: False)
    remote = FlakyRemote([parse_error()], value={
        "staleness": [0, 1], "loss": 0.25, "metrics": []})
    fake = types.SimpleNamespace(
        _pending=collections.deque([(remote, 5)]), patience=10.0, _stall=None,
        cluster=types.SimpleNamespace(member_name="chief:0"), _staleness=[], metric_names=[],
        completed=0, unfetched_steps=0, _fetcher=ps_trainer.Fetcher(),
        train_metrics=types.SimpleNamespace(logs=lambda loss, values: {"loss": loss}))
    # The trainer's own waiting and fetching (on the fetcher's thread), not stand-ins.
    for name in ("_wait_or_reroute", "_fetch"):
        setattr(fake, name, types.MethodType(getattr(ps_trainer.PsTrainer, name), fake))
    ps_trainer.PsTrainer._collect_one(fake)
    assert remote.calls == 2 and fake.completed == 5 and fake._last == {"loss": 0.25}
    assert fake.unfetched_steps == 0


def _died(fn):
    """The excepthook's argument for a thread whose target ``fn`` raised."""
    import sys

    try:
        fn()
    except Exception:  # noqa: BLE001
        kind, value, tb = sys.exc_info()
    return types.SimpleNamespace(exc_type=kind, exc_value=value, exc_traceback=tb, thread=None)


def test_a_preemption_watcher_dying_on_a_lost_peer_is_one_warning_line(capsys, monkeypatch):
    import threading

    seen = []
    monkeypatch.setattr(threading, "excepthook", seen.append)  # the hook before ours
    preemption.quiet_watcher_deaths()
    preemption.quiet_watcher_deaths()  # installed once: no chain of hooks
    hook = threading.excepthook
    assert hook.quiet_watcher_deaths
    # A function compiled as if it lived in TF's failure_handling module.
    fake = "/x/tensorflow/python/distribute/failure_handling/failure_handling.py"
    scope = {"tf": tf}
    exec(compile("def _watch():\n    raise tf.errors.UnavailableError(None, None, "
                 "'sendmsg: Broken pipe (32)\\nmore')\n", fake, "exec"), scope)
    hook(_died(scope["_watch"]))
    assert capsys.readouterr().out.splitlines() == [
        "warning: TensorFlow's preemption watcher stopped: UnavailableError: "
        "sendmsg: Broken pipe (32)"]
    assert seen == []

    def bug():
        raise ValueError("a real bug")

    hook(_died(bug))  # anything else goes to the previous hook (a traceback)
    assert len(seen) == 1 and isinstance(seen[0].exc_value, ValueError)
    assert capsys.readouterr().out == ""
