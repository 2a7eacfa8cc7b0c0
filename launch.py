"""Run a whole simulated cluster on this host: one ``train.py`` per task.

    python launch.py --strategy multiworker --workers 2 -- --epochs 1 --model-dir runs/mw
    python launch.py --strategy ps --workers 2 --ps 1 -- --epochs 1 --model-dir runs/ps

Each task gets its own TF_CONFIG on free loopback ports and runs the same
command a user runs on a real host. The TF_CONFIGs and commands are saved
in ``<model-dir>/launch/`` so any task can be replayed by hand. Output lines
are prefixed with their task. If a task fails the others are stopped, and
the launcher exits with that task's code; no task outlives the launcher.

TensorFlow's servers listen on every interface without authentication, so
where the OS allows it (``--netns auto``, the default) the launcher runs
the whole cluster in a private network namespace of its own: its ports
exist only there, and nothing outside can connect to them.

Stages: ``build_cluster`` (pure), ``start_tasks``, ``supervise``; around
them, ``decide_netns`` (pure) and ``run_in_netns``.

Fault injection and recovery (``--kill``, ``--preempt``, ``--restart-tasks``,
``--max-restarts``) are layered on top: ``parse_fault`` and ``plan_recovery``
(pure) check the flags, ``FaultInjector`` and ``TaskRestarter`` run inside
``supervise``'s poll loop, and ``run_with_recovery`` relaunches a failed job.
"""

from __future__ import annotations

import argparse
import ctypes
import glob
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

HERE = os.path.dirname(os.path.abspath(__file__))
TRAIN = os.path.join(HERE, "train.py")
STRATEGIES = ("mirrored", "multiworker", "ps")
EXIT_BAD_INPUT = 2
EXIT_TIMEOUT = 124
NETNS_MODES = ("auto", "on", "off")
# A user namespace makes an unprivileged network namespace possible; mapping
# our uid to root inside it lets the launcher bring the loopback device up.
UNSHARE = ("unshare", "--user", "--map-root-user", "--net")
INSIDE_FLAG = "--netns-inside"
# train.py's codes: checkpointed after a SIGTERM / lost a peer. Both mean
# "relaunch me and I resume"; kept in step with training/recovery.py.
EXIT_PREEMPTED = 42
EXIT_TASK_LOST = 75


class LaunchError(ValueError):
    pass


# --- stage 1: the cluster, as data ------------------------------------------

def build_cluster(strategy: str, workers: int, ps: int = 0, ports: list[int] | None = None,
                  host: str = "localhost", chief: bool | None = None) -> dict[str, dict | None]:
    """TF_CONFIG for every task, keyed ``role:index`` (``None``: no TF_CONFIG).

    ``ps`` always has a chief (the coordinator), which does not train;
    ``multiworker`` trains on ``workers`` tasks, worker:0 being the chief
    unless ``chief`` adds a separate chief task.
    """
    if strategy not in STRATEGIES:
        raise LaunchError(f"unknown --strategy {strategy!r}; allowed: {', '.join(STRATEGIES)}")
    if workers < 1:
        raise LaunchError(f"--workers={workers}; at least 1 worker is needed")
    if strategy == "mirrored":
        if workers != 1 or ps:
            raise LaunchError(
                f"--strategy mirrored is one process; received --workers={workers} --ps={ps}; "
                "use --workers 1 --ps 0, or --strategy multiworker|ps"
            )
        return {"local:0": None}
    if strategy == "ps" and ps < 1:
        raise LaunchError(f"--strategy ps needs --ps >= 1, received --ps={ps}")
    if strategy == "multiworker" and ps:
        raise LaunchError(
            f"--strategy multiworker takes no ps tasks, received --ps={ps}; use --ps 0"
        )
    counts = {"chief": 1 if (chief or strategy == "ps") else 0, "worker": workers, "ps": ps}
    needed = sum(counts.values())
    if ports is None or len(ports) < needed:
        raise LaunchError(f"{needed} ports are needed, received {ports!r}")
    it = iter(ports)
    cluster = {
        role: [f"{host}:{next(it)}" for _ in range(n)] for role, n in counts.items() if n
    }
    return {
        f"{role}:{i}": {"cluster": cluster, "task": {"type": role, "index": i}}
        for role, addrs in cluster.items()
        for i in range(len(addrs))
    }


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """``n`` distinct ports that were free a moment ago."""
    socks, ports = [], []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind((host, 0))
            socks.append(s)
            ports.append(s.getsockname()[1])
    finally:
        for s in socks:
            s.close()
    return ports


def task_command(strategy: str, train_args: list[str], python: str = sys.executable) -> list[str]:
    return [python, TRAIN, f"--strategy={strategy}", *train_args]


def save_launch_files(launch_dir: str, tasks: dict[str, dict | None], command: list[str]) -> None:
    """One TF_CONFIG file per task, and the line that replays each task."""
    os.makedirs(launch_dir, exist_ok=True)
    lines = ["#!/usr/bin/env bash", "# Replay any task by hand: run its line in its own terminal."]
    for name, tf_config in tasks.items():
        if tf_config is None:
            lines.append(shlex.join(command))
            continue
        path = os.path.join(launch_dir, f"{name.replace(':', '-')}.tf_config.json")
        with open(path, "w") as f:
            json.dump(tf_config, f)
            f.write("\n")
        lines.append(f"TF_CONFIG=\"$(cat {shlex.quote(path)})\" {shlex.join(command)}  # {name}")
    with open(os.path.join(launch_dir, "commands.sh"), "w") as f:
        f.write("\n".join(lines) + "\n")


# --- stage 2: processes -------------------------------------------------------

def _die_with_parent():  # runs in the child between fork and exec
    # Linux: if the launcher is killed outright, the kernel kills the task too.
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


@dataclass
class Task:
    name: str
    proc: subprocess.Popen
    pump: threading.Thread
    lines: list[str] = field(default_factory=list)


def _pump(task_name: str, stream, sink, keep: list[str], lock: threading.Lock, on_line=None):
    for raw in iter(stream.readline, b""):
        line = raw.decode(errors="replace").rstrip("\n")
        keep.append(line)
        with lock:
            sink.write(f"[{task_name}] {line}\n")
            sink.flush()
        if on_line is not None:
            on_line(task_name, line)
    stream.close()


def thread_env(strategy: str, tasks: dict[str, dict | None], cpus: int) -> dict[str, dict[str, str]]:
    """Each task's share of this host's cores: TensorFlow's thread-pool size and a CPU set.

    The simulated hosts share one machine: left alone, every task sizes its
    intra-op pool to all the cores, and N workers oversubscribe them N times
    over. Tasks that only serve or dispatch (ps, and the ps chief) get one
    thread and no fixed cores. When the busy tasks fit, each is also pinned
    (``LAUNCH_CPUS``) to cores of its own, as if on a host of its own: on 2
    cores, two unpinned multi-worker workers gave 4,200-5,600 examples/s over
    five runs, pinned 5,100-6,200 over three (ps, one run each: 5,231 vs 5,915).
    """
    busy = [n for n in tasks if n.startswith(("worker:", "chief:"))
            and not (strategy == "ps" and n.startswith("chief:"))]
    share = max(1, cpus // max(1, len(busy)))
    envs = {n: {"TF_NUM_INTRAOP_THREADS": str(share if n in busy else 1)} for n in tasks}
    if 1 < len(busy) <= cpus:
        for i, n in enumerate(busy):
            envs[n]["LAUNCH_CPUS"] = ",".join(str(c) for c in range(i * share, (i + 1) * share))
            # TensorFlow sizes its inter-op pool by the cores a process may
            # use; with one, a ps worker's function waiting on a ps read
            # holds the only thread and the job deadlocks (seen here).
            envs[n]["TF_NUM_INTEROP_THREADS"] = str(cpus)
    return envs


def _child_setup(cpus: str | None):
    """What runs in a task between fork and exec."""

    def setup():
        _die_with_parent()
        if cpus:
            try:
                os.sched_setaffinity(0, {int(c) for c in cpus.split(",")})
            except OSError:  # a container that forbids it: run unpinned
                pass

    return setup


_SINK_LOCK = threading.Lock()  # one for every pump, restarted tasks' too


def start_tasks(tasks: dict[str, dict | None], command: list[str], env: dict[str, str],
                sink=None, on_line=None,
                task_envs: dict[str, dict[str, str]] | None = None) -> list[Task]:
    """Start one process per task; ``on_line(task, line)`` sees every output line.

    ``task_envs`` adds per-task variables, under ``env`` (the caller's wins).
    """
    sink = sink or sys.stdout
    lock = _SINK_LOCK
    started: list[Task] = []
    for name, tf_config in tasks.items():
        task_env = {**(task_envs or {}).get(name, {}), **env}  # the caller's env wins
        task_env.pop("TF_CONFIG", None)
        cpus = task_env.pop("LAUNCH_CPUS", None)
        if tf_config is not None:
            task_env["TF_CONFIG"] = json.dumps(tf_config)
        proc = subprocess.Popen(
            command, env=task_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, start_new_session=True, preexec_fn=_child_setup(cpus),
        )
        keep: list[str] = []
        pump = threading.Thread(target=_pump, args=(name, proc.stdout, sink, keep, lock, on_line),
                                daemon=True)
        pump.start()
        started.append(Task(name, proc, pump, keep))
    return started


def stop_tasks(tasks: list[Task], grace: float = 5.0) -> None:
    """SIGTERM, then SIGKILL after ``grace``: TF's own SIGTERM handler may ignore the first."""
    live = [t for t in tasks if t.proc.poll() is None]
    for t in live:
        _signal_group(t.proc, signal.SIGTERM)
    _wait_all(live, grace)
    for t in tasks:
        if t.proc.poll() is None:
            _signal_group(t.proc, signal.SIGKILL)
        t.proc.wait()
        t.pump.join(timeout=5)


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


# --- stage 3: supervision -----------------------------------------------------

def decide(strategy: str, exits: dict[str, int | None]) -> int | None:
    """The job's exit code once it is known, else ``None`` (pure).

    Sync jobs need every task: the first failure decides. Under ps only the
    chief trains to the end; ps and worker servers stop when it is gone.
    """
    if strategy == "ps":
        return exits.get("chief:0")
    failed = [code for code in exits.values() if code not in (None, 0)]
    if failed:
        return failed[0]
    if all(code == 0 for code in exits.values()):
        return 0
    return None


def supervise(strategy: str, tasks: list[Task], timeout: float, poll: float = 0.1,
              grace: float = 5.0, log=print, on_poll=None) -> int:
    """Wait for the job's outcome; stop every task whatever it is.

    ``on_poll(tasks, exits)`` runs every poll: fault injection, and task
    restarts (which replace an entry of ``tasks`` and reset its ``exits``).
    """
    deadline = time.monotonic() + timeout
    exits: dict[str, int | None] = {t.name: None for t in tasks}
    try:
        while True:
            for t in tasks:
                if exits[t.name] is None and (code := t.proc.poll()) is not None:
                    exits[t.name] = code
                    log(f"[launch] {t.name} exited with code {code}")
            if on_poll is not None:
                on_poll(tasks, exits)
            code = decide(strategy, exits)
            if code is not None:
                if code == EXIT_PREEMPTED:
                    # Every worker saves at the agreed step and exits by
                    # itself; a SIGTERM now would be read as another notice.
                    log("[launch] job preempted: waiting for every task to checkpoint and exit")
                    _wait_all(tasks, grace)
                    for t in tasks:
                        if exits[t.name] is None and (late := t.proc.poll()) is not None:
                            exits[t.name] = late
                            log(f"[launch] {t.name} exited with code {late}")
                elif code != 0:
                    log(f"[launch] job failed (exit {code}); stopping the other tasks")
                elif strategy == "ps":
                    # Servers notice the chief is gone and exit on their own.
                    _wait_all(tasks, grace)
                return code
            if time.monotonic() > deadline:
                log(f"[launch] error: job still running after --timeout={timeout:g}s; stopping it")
                return EXIT_TIMEOUT
            time.sleep(poll)
    finally:
        # Serving tasks (ps) notice the chief is gone and exit on their own;
        # give them that chance before the SIGTERM/SIGKILL sequence.
        stop_tasks(tasks, grace=grace)


# --- faults and recovery ------------------------------------------------------

FAULT_ACTIONS = {"kill": signal.SIGKILL, "preempt": signal.SIGTERM}
FAULT_SPEC = "ROLE:INDEX@WHEN, WHEN being seconds (@20, @2.5s) or a step reached (@step=150)"
MAX_TASK_RESTARTS = 3  # per task: a worker that keeps dying is not a transient fault


@dataclass(frozen=True)
class Fault:
    """``--kill``/``--preempt``: signal ``task`` once ``seconds`` or ``step`` is reached."""

    action: str
    task: str
    seconds: float | None = None
    step: int | None = None

    def __str__(self) -> str:
        when = f"step={self.step}" if self.step is not None else f"{self.seconds:g}s"
        return f"--{self.action} {self.task}@{when}"


_FAULT_RX = re.compile(r"^(chief|worker|ps|local):(\d+)@(?:step=(\d+)|(\d+(?:\.\d+)?)s?)$")


def parse_fault(action: str, spec: str) -> Fault:
    """``worker:1@20`` / ``ps:0@step=150`` into a Fault, or LaunchError (pure)."""
    if action not in FAULT_ACTIONS:
        raise LaunchError(f"unknown fault action {action!r}; allowed: {', '.join(FAULT_ACTIONS)}")
    m = _FAULT_RX.match(spec.strip())
    if not m:
        raise LaunchError(
            f"--{action} {spec!r} is not a fault spec; expected {FAULT_SPEC}, "
            f"e.g. --{action} worker:1@step=150"
        )
    role, index, step, seconds = m.groups()
    task = f"{role}:{int(index)}"
    if step is not None:
        return Fault(action, task, step=int(step))
    return Fault(action, task, seconds=float(seconds))


@dataclass(frozen=True)
class RecoveryPlan:
    faults: tuple[Fault, ...] = ()
    restart_tasks: bool = False
    restart_delay: float = 2.0
    max_restarts: int = 0


def plan_recovery(args, tasks: dict[str, dict | None]) -> RecoveryPlan:
    """Check the fault and restart flags against the cluster (pure)."""
    faults = tuple(
        parse_fault(action, spec)
        for action in FAULT_ACTIONS for spec in (getattr(args, action) or [])
    )
    for fault in faults:
        if fault.task not in tasks:
            raise LaunchError(
                f"{fault} names a task this cluster does not have; tasks: {', '.join(tasks)}"
            )
    if args.max_restarts < 0:
        raise LaunchError(f"--max-restarts={args.max_restarts}; use 0 (never) or more")
    if args.restart_delay < 0:
        raise LaunchError(f"--restart-delay={args.restart_delay:g}; use 0 or more seconds")
    if args.restart_tasks and args.strategy != "ps":
        raise LaunchError(
            f"--restart-tasks restarts lost workers under --strategy ps, received "
            f"--strategy {args.strategy}, whose workers cannot rejoin a running all-reduce; "
            "use --max-restarts N to relaunch the whole job from its checkpoint"
        )
    return RecoveryPlan(faults, bool(args.restart_tasks), args.restart_delay, args.max_restarts)


def add_recovery_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--kill", action="append", metavar="ROLE:INDEX@WHEN",
                   help=f"SIGKILL a task (repeatable); {FAULT_SPEC}")
    p.add_argument("--preempt", action="append", metavar="ROLE:INDEX@WHEN",
                   help="SIGTERM a task, a polite preemption (repeatable); same WHEN")
    p.add_argument("--restart-tasks", action="store_true",
                   help=f"ps: restart a dead worker with its TF_CONFIG (at most "
                        f"{MAX_TASK_RESTARTS} times each), as a cluster manager would")
    p.add_argument("--restart-delay", type=float, default=2.0,
                   help="seconds before a task or job is restarted")
    p.add_argument("--max-restarts", type=int, default=0,
                   help="relaunch a failed or preempted job up to N times with the same "
                        "--model-dir (it resumes from its checkpoint)")


_STEP_LINE = re.compile(r"^(?:step (\d+)/\d+ |checkpoint saved at step (\d+))")


def step_in_line(line: str) -> int | None:
    """The step a progress or checkpoint line reports (pure)."""
    m = _STEP_LINE.match(line)
    if not m:
        return None
    return int(m.group(1) or m.group(2))


class FaultInjector:
    """Fires each fault once, when its time or step comes.

    Steps come from any task's progress and checkpoint lines (``on_line``,
    called from the output pumps); times count from the launcher's start.
    """

    def __init__(self, faults, log=print, clock=time.monotonic, grace: float | None = None):
        self.waiting = list(faults)
        self.fired: list[str] = []
        self.log = log
        self.clock = clock
        self.grace = grace
        self.started = clock()
        self.step = -1
        self._lock = threading.Lock()
        self._terminating: list[tuple[Task, float]] = []

    def on_line(self, task_name: str, line: str) -> None:
        step = step_in_line(line)
        if step is not None:
            with self._lock:
                self.step = max(self.step, step)

    def due(self) -> list[Fault]:
        with self._lock:
            elapsed, step = self.clock() - self.started, self.step
        ready = [
            f for f in self.waiting
            if (f.step is not None and step >= f.step)
            or (f.seconds is not None and elapsed >= f.seconds)
        ]
        self.waiting = [f for f in self.waiting if f not in ready]
        return ready

    def __call__(self, tasks: list[Task], exits: dict[str, int | None]) -> None:
        self._enforce_grace()
        for fault in self.due():
            task = next((t for t in tasks if t.name == fault.task), None)
            if task is None or task.proc.poll() is not None:
                self.log(f"[launch] fault {fault}: {fault.task} is not running; skipped")
                continue
            sig = FAULT_ACTIONS[fault.action]
            if fault.action == "kill":
                _signal_group(task.proc, sig)  # the whole task, as if its host died
            else:
                task.proc.send_signal(sig)  # the task's own process, as Kubernetes does
                if self.grace is not None:
                    self._terminating.append((task, self.clock() + self.grace))
            self.fired.append(str(fault))
            self.log(f"[launch] fault {fault}: sent {signal.Signals(sig).name} to {fault.task} "
                     f"(pid {task.proc.pid}) at {self.clock() - self.started:.1f}s, "
                     f"step {max(self.step, 0)}")


    def _enforce_grace(self) -> None:
        """A preempted task still running ``--grace`` s later is SIGKILLed, as
        a cluster manager does (TensorFlow may have swallowed the SIGTERM)."""
        now, keep = self.clock(), []
        for task, deadline in self._terminating:
            if task.proc.poll() is not None:
                continue
            if now < deadline:
                keep.append((task, deadline))
                continue
            self.log(f"[launch] {task.name} still running {self.grace:g}s (--grace) after "
                     "its SIGTERM; SIGKILL, as a cluster manager would")
            _signal_group(task.proc, signal.SIGKILL)
        self._terminating = keep


class TaskRestarter:
    """Restarts a dead ps-strategy worker with the same TF_CONFIG after a delay.

    Under ps the coordinator waits for a lost worker to come back at the same
    address, and gives it work again once it does.
    """

    def __init__(self, tf_configs: dict[str, dict | None], command, env, delay: float,
                 on_line=None, log=print, limit: int = MAX_TASK_RESTARTS, clock=time.monotonic,
                 task_envs: dict[str, dict[str, str]] | None = None):
        self.tf_configs, self.command, self.env = tf_configs, command, env
        self.task_envs = task_envs
        self.delay, self.on_line, self.log, self.limit, self.clock = delay, on_line, log, limit, clock
        self.restarts: dict[str, int] = {}
        self._due: dict[str, float] = {}

    def new_attempt(self) -> None:
        """A relaunched job starts with no restart pending (counts are kept)."""
        self._due.clear()

    @staticmethod
    def restartable(name: str) -> bool:
        return name.startswith("worker:")

    def __call__(self, tasks: list[Task], exits: dict[str, int | None]) -> None:
        now = self.clock()
        for i, t in enumerate(tasks):
            code = exits.get(t.name)
            # Exit 0 is a server that saw its chief finish: nothing to restart.
            if code in (None, 0) or not self.restartable(t.name):
                continue
            if self.restarts.get(t.name, 0) >= self.limit:
                continue
            if t.name not in self._due:
                self._due[t.name] = now + self.delay
                self.log(f"[launch] {t.name} is down (exit {code}); restarting it in {self.delay:g}s")
                continue
            if now < self._due[t.name]:
                continue
            del self._due[t.name]
            t.pump.join(timeout=5)
            (new,) = start_tasks({t.name: self.tf_configs[t.name]}, self.command, self.env,
                                 on_line=self.on_line, task_envs=self.task_envs)
            tasks[i] = new
            exits[t.name] = None
            self.restarts[t.name] = self.restarts.get(t.name, 0) + 1
            self.log(f"[launch] restarted {t.name} (pid {new.proc.pid}), same TF_CONFIG; "
                     f"restart {self.restarts[t.name]} of at most {self.limit}")


def should_relaunch(code: int, attempt: int, max_restarts: int) -> bool:
    """Relaunch after this attempt's exit ``code``? (pure)

    Failures a relaunch can cure: a lost task, a preemption, a crash. Bad
    input, a timeout and success end the job.
    """
    return code not in (0, EXIT_BAD_INPUT, EXIT_TIMEOUT, 130) and attempt < max_restarts


def run_with_recovery(args, tasks: dict[str, dict | None], command: list[str],
                      env: dict[str, str], recovery: RecoveryPlan, running: list[Task],
                      log=print) -> int:
    """Start, supervise and, under ``--max-restarts``, relaunch the job.

    ``running`` is filled with the live tasks so the caller can stop them on
    an interrupt. A relaunch reuses every TF_CONFIG (same ports, like a
    Kubernetes pod restarted under the same service names) and the same
    ``--model-dir``, so the tasks resume from the latest checkpoint.
    """
    injector = FaultInjector(recovery.faults, log=log, grace=args.grace)
    task_envs = thread_env(args.strategy, tasks, os.cpu_count() or 1)
    restarter = TaskRestarter(tasks, command, env, recovery.restart_delay,
                              on_line=injector.on_line, log=log,
                              task_envs=task_envs) if recovery.restart_tasks else None

    def on_poll(live, exits):
        injector(live, exits)
        if restarter is not None:
            restarter(live, exits)

    attempt = 0
    while True:
        if restarter is not None:
            restarter.new_attempt()
        running[:] = start_tasks(tasks, command, env, on_line=injector.on_line,
                                 task_envs=task_envs)
        code = supervise(args.strategy, running, args.timeout, grace=args.grace, log=log,
                         on_poll=on_poll)
        if not should_relaunch(code, attempt, recovery.max_restarts):
            break
        attempt += 1
        log(f"[launch] relaunching the job ({attempt} of --max-restarts={recovery.max_restarts}) "
            f"after exit {code}, in {recovery.restart_delay:g}s; it resumes from its checkpoint")
        time.sleep(recovery.restart_delay)
    restarts = sum(restarter.restarts.values()) if restarter is not None else 0
    log(f"[launch] recovery: faults injected {len(injector.fired)}, task restarts {restarts}, "
        f"job relaunches {attempt}")
    return code



def _wait_all(tasks: list[Task], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    for t in tasks:
        try:
            t.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            return


# --- around the stages: a private network namespace ---------------------------

def decide_netns(mode: str, strategy: str, probe) -> tuple[bool, str | None]:
    """Whether to run the cluster in a private network namespace (pure).

    ``probe()`` says why no namespace can be made here (``None``: it can); it
    is called only when the answer matters. Returns ``(use, warning)``.
    """
    if mode not in NETNS_MODES:
        raise LaunchError(f"unknown --netns {mode!r}; allowed: {', '.join(NETNS_MODES)}")
    if mode == "off" or strategy == "mirrored":  # one process opens no port
        return False, None
    problem = probe()
    if problem is None:
        return True, None
    if mode == "on":
        raise LaunchError(
            f"--netns on, but this host cannot make a private network namespace ({problem}); "
            f"make `{' '.join(UNSHARE)} true` work (util-linux installed; unprivileged user "
            "namespaces allowed: sysctl user.max_user_namespaces > 0, and "
            "kernel.unprivileged_userns_clone=1 or kernel.apparmor_restrict_unprivileged_userns=0 "
            "where those exist), or use --netns auto to run on the host network"
        )
    return False, (
        f"[launch] warning: no private network namespace ({problem}); the cluster's ports are "
        "open on every interface of this host. --netns off silences this, --netns on makes it an error"
    )


def netns_problem(timeout: float = 10.0) -> str | None:
    """Why ``unshare`` cannot make a user + network namespace here, or ``None``."""
    try:
        probe = subprocess.run(
            [*UNSHARE, "true"], stdin=subprocess.DEVNULL, capture_output=True, text=True,
            timeout=timeout,
        )
    except FileNotFoundError:
        return "the unshare command (util-linux) is not installed"
    except subprocess.TimeoutExpired:
        return f"unshare did not finish within {timeout:g}s"
    if probe.returncode != 0:
        lines = probe.stderr.strip().splitlines()
        return lines[-1] if lines else f"unshare exited with code {probe.returncode}"
    return None


def netns_command(launch_argv: list[str], train_args: list[str],
                  python: str = sys.executable) -> list[str]:
    """This launcher again, inside new namespaces, told that it is inside (pure)."""
    return [*UNSHARE, python, os.path.abspath(__file__), *launch_argv, INSIDE_FLAG, "--",
            *train_args]


def loopback_up() -> None:
    """Bring ``lo`` up: a new network namespace starts with it down."""
    import fcntl
    import struct

    siocgifflags, siocsifflags, iff_up = 0x8913, 0x8914, 0x1
    ifreq = "16sH22x"  # struct ifreq: name, then ifr_flags in a 24-byte union
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        flags = struct.unpack(ifreq, fcntl.ioctl(s, siocgifflags, struct.pack(ifreq, b"lo", 0)))[1]
        fcntl.ioctl(s, siocsifflags, struct.pack(ifreq, b"lo", flags | iff_up))


def run_in_netns(command: list[str], grace: float) -> int:
    """Run the inner launcher; forward SIGTERM/SIGINT to it; return its exit code.

    The inner launcher stops its tasks on SIGTERM as usual. A second signal
    kills it outright, and its tasks die with it (``PR_SET_PDEATHSIG``).
    """
    # Own session: a terminal's Ctrl-C reaches only this process, which
    # forwards it once, instead of both launchers acting on it at once.
    proc = subprocess.Popen(command, stdin=subprocess.DEVNULL, start_new_session=True,
                            preexec_fn=_die_with_parent)
    signals = []

    def forward(signum, _frame):
        signals.append(signum)
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM if len(signals) == 1 else signal.SIGKILL)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        code = proc.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    # Killed by a signal: report it the way a shell would.
    return code if code >= 0 else 128 - code


def mnist_prepared(data_dir: str) -> bool:
    return bool(glob.glob(os.path.join(os.path.expanduser(data_dir), "mnist", "*",
                                       "dataset_info.json")))


# Runs outside the namespace: the one place left that can download.
_PREPARE = """import sys
from strategies import ConfigError
from training.data import ensure_available
try:
    ensure_available(sys.argv[1] or None)
except ConfigError as err:
    print(f"error: {err}", file=sys.stderr)
    sys.exit(2)
"""


def prepare_data(train_args: list[str], env: dict[str, str]) -> int:
    """Download MNIST first if tfds would: the namespace has no network."""
    data_dir = _train_arg(train_args, "--data-dir", env.get("TFDS_DATA_DIR") or "")
    where = data_dir or os.path.join("~", "tensorflow_datasets")
    if mnist_prepared(where):
        return 0
    print(f"[launch] no MNIST in {where}; checking or downloading it before entering the "
          "network namespace, which has no network", flush=True)
    return subprocess.run([sys.executable, "-c", _PREPARE, data_dir], cwd=HERE, env=env,
                          stdin=subprocess.DEVNULL).returncode


def _train_arg(train_args: list[str], flag: str, default: str) -> str:
    # No abbreviations: "--model logreg" must not read as "--model-dir logreg".
    p = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    p.add_argument(flag, default=default)
    known, _ = p.parse_known_args(train_args)
    return getattr(known, flag.lstrip("-").replace("-", "_"))


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        usage="launch.py --strategy {mirrored,multiworker,ps} [options] -- [train.py args]",
    )
    p.add_argument("--strategy", required=True)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--ps", type=int, default=0)
    p.add_argument("--chief", action="store_true",
                   help="multiworker: add a separate chief task (it trains too)")
    p.add_argument("--host", default="localhost", help="address written into TF_CONFIG")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds before the job is stopped")
    p.add_argument("--grace", type=float, default=10.0, help="seconds between SIGTERM and SIGKILL")
    p.add_argument("--netns", default="auto", choices=NETNS_MODES,
                   help="run the cluster in a private network namespace, unreachable from "
                        "outside: auto (when the OS allows it; else a warning), on (or fail), off")
    p.add_argument(INSIDE_FLAG, action="store_true", help=argparse.SUPPRESS)
    add_recovery_args(p)
    argv = list(sys.argv[1:] if argv is None else argv)
    train_args = []
    if "--" in argv:
        i = argv.index("--")
        argv, train_args = argv[:i], argv[i + 1:]
    args = p.parse_args(argv)
    if any(a == "--strategy" or a.startswith("--strategy=") for a in train_args):
        p.error("pass --strategy to launch.py only; it forwards it to every task")
    args.launch_argv = argv
    return args, train_args


def main(argv=None) -> int:
    args, train_args = parse_args(argv)
    try:
        ntasks = args.workers + args.ps + (1 if args.chief or args.strategy == "ps" else 0)
        tasks = build_cluster(
            args.strategy, args.workers, args.ps, free_ports(ntasks), args.host, args.chief
        )
        recovery = plan_recovery(args, tasks)
        use_netns, warning = (False, None) if args.netns_inside else decide_netns(
            args.netns, args.strategy, netns_problem
        )
    except LaunchError as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT
    if warning:
        print(warning, file=sys.stderr, flush=True)
    if use_netns:
        code = prepare_data(train_args, dict(os.environ))
        if code != 0:
            return code
        print("[launch] private network namespace: only the cluster's own tasks can reach "
              "its ports", flush=True)
        return run_in_netns(netns_command(args.launch_argv, train_args), args.grace)
    if args.netns_inside:
        loopback_up()
    model_dir = _train_arg(train_args, "--model-dir", f"runs/{args.strategy}")
    if "--model-dir" not in " ".join(train_args):
        train_args = [*train_args, "--model-dir", model_dir]
    command = task_command(args.strategy, train_args)
    save_launch_files(os.path.join(model_dir, "launch"), tasks, command)
    env = dict(os.environ)
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    env.setdefault("PYTHONUNBUFFERED", "1")
    print(f"[launch] {args.strategy}: {', '.join(tasks)}; TF_CONFIGs in {model_dir}/launch/", flush=True)

    running: list[Task] = []

    def on_signal(signum, _frame):
        raise KeyboardInterrupt(signum)

    signal.signal(signal.SIGTERM, on_signal)
    try:
        code = run_with_recovery(args, tasks, command, env, recovery, running,
                                 log=lambda m: print(m, flush=True))
    except KeyboardInterrupt:
        print("[launch] interrupted; stopping every task", flush=True)
        stop_tasks(running, grace=args.grace)
        return 130
    print(f"[launch] done: exit code {code}", flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
