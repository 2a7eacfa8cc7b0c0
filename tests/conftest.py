import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tfdist.launcher.engine.local import LocalEngine  # noqa: E402  (after the path)


class Starting(LocalEngine):
    """The local engine, each member started by ``starter`` (a stand-in command): the
    launcher tests' supervisor without real members."""

    def __init__(self, starter):
        super().__init__(config=None)
        self.starter = starter

    def start(self, name):
        return self.starter(name)


def child_env(tf_config=None, **extra):
    env = dict(os.environ)
    env.pop("TF_CONFIG", None)
    if tf_config is not None:
        env["TF_CONFIG"] = tf_config if isinstance(tf_config, str) else json.dumps(tf_config)
    env.update({k: str(v) for k, v in extra.items()})
    return env


class Proc:
    """A child process whose output is collected line by line as it comes."""

    def __init__(self, cmd, env, cwd=REPO):
        self.lines: list[str] = []
        self._cond = threading.Condition()
        self.proc = subprocess.Popen(
            cmd, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, start_new_session=True,
        )
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self):
        for raw in iter(self.proc.stdout.readline, b""):
            with self._cond:
                self.lines.append(raw.decode(errors="replace").rstrip("\n"))
                self._cond.notify_all()
        with self._cond:
            self._cond.notify_all()

    def wait_for_line(self, pattern, timeout):
        """The first output line matching ``pattern``; fails after ``timeout``."""
        rx = re.compile(pattern)
        deadline = time.monotonic() + timeout
        seen = 0
        with self._cond:
            while True:
                for line in self.lines[seen:]:
                    if rx.search(line):
                        return line
                seen = len(self.lines)
                left = deadline - time.monotonic()
                if left <= 0 or (self.proc.poll() is not None and not self._thread.is_alive()):
                    raise AssertionError(
                        f"no line matching {pattern!r} within {timeout}s; output tail:\n"
                        + "\n".join(self.lines[-40:])
                    )
                self._cond.wait(min(left, 1.0))

    def wait(self, timeout):
        try:
            code = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(
                f"process still running after {timeout}s; output tail:\n" + "\n".join(self.lines[-40:])
            )
        self._thread.join(timeout=10)
        return code

    @property
    def output(self):
        return "\n".join(self.lines)

    def kill(self):
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.proc.wait()


@pytest.fixture
def spawn():
    """Start processes; whatever a test leaves running is killed afterwards."""
    procs: list[Proc] = []

    def start(cmd, env=None):
        p = Proc(cmd, env or child_env())
        procs.append(p)
        return p

    yield start
    for p in procs:
        if p.proc.poll() is None:
            p.kill()


def running_with(marker: str) -> list[str]:
    """Live processes (zombies and this one left out) whose command line contains
    ``marker`` (e.g. a model dir), as ``"pid: command"``: what a finished job left behind.
    The soak's scan (``tfdist.linux.live_processes``), one implementation."""
    from tfdist.linux import live_processes

    return [f"{pid}: {cmd}" for pid, cmd, _ in live_processes() if marker in cmd]


def descendants_alive(marker: str) -> list[str]:
    """Processes whose command line contains ``marker`` (e.g. a model dir)."""
    return running_with(marker)


def launch_cmd(strategy, *launch_args, train_args=()):
    return [sys.executable, str(REPO / "launch.py"), "--strategy", strategy, *launch_args,
            "--", *train_args]


def read_results(model_dir):
    with open(Path(model_dir) / "results.json") as f:
        return json.load(f)


def tensorboard_tags(logdir: str) -> dict[str, set]:
    import tensorflow as tf

    scalars, plugin = set(), set()
    for name in os.listdir(logdir):
        for event in tf.compat.v1.train.summary_iterator(os.path.join(logdir, name)):
            for value in event.summary.value:
                (plugin if value.metadata.plugin_data.plugin_name == "hparams"
                 else scalars).add(value.tag)
    return {"scalars": scalars, "plugin": plugin}


def refused_line(argv, tmp_path, capsys) -> str:
    """``train.py ARGV --dry-run``'s refusal: exit 2, one line on stderr (returned for the
    caller's check of what it says), and no run directory made."""
    from tfdist.cli import train

    code = train.main([*argv, "--dry-run", "--model-dir", str(tmp_path / "run")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, (code, err)
    assert not (tmp_path / "run").exists()
    return err[0]


def recovery_plan(kind, tasks, hosts: int = 0, **flags):
    """``recovery.faults.plan_recovery`` from launch.py's flag names: the fault flags
    (lists of specs) into a ``Faults``, the restart flags into a ``Recovery``."""
    import dataclasses

    from tfdist.launcher.config import Faults, Recovery
    from tfdist.launcher.recovery.faults import plan_recovery

    fault_fields = {f.name for f in dataclasses.fields(Faults)}
    asked = Faults(**{k: tuple(v or ()) for k, v in flags.items() if k in fault_fields})
    again = Recovery(**{k: v for k, v in flags.items() if k not in fault_fields})
    return plan_recovery(kind, tasks, asked, again, hosts)
