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
"""

from __future__ import annotations

import argparse
import ctypes
import glob
import json
import os
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


def _pump(task_name: str, stream, sink, keep: list[str], lock: threading.Lock):
    for raw in iter(stream.readline, b""):
        line = raw.decode(errors="replace").rstrip("\n")
        keep.append(line)
        with lock:
            sink.write(f"[{task_name}] {line}\n")
            sink.flush()
    stream.close()


def thread_env(strategy: str, tasks: dict[str, dict | None], cpus: int) -> dict[str, dict[str, str]]:
    """Each task's share of this host's cores, as TensorFlow's thread-pool variables.

    The simulated hosts share one machine: left alone, every task sizes its
    intra-op pool to all the cores, and N workers oversubscribe them N times
    over. Tasks that only serve or dispatch (ps, and the ps chief) get one.
    """
    busy = [n for n in tasks if n.startswith(("worker:", "chief:"))
            and not (strategy == "ps" and n.startswith("chief:"))]
    share = max(1, cpus // max(1, len(busy)))
    return {n: {"TF_NUM_INTRAOP_THREADS": str(share if n in busy else 1)} for n in tasks}


def start_tasks(tasks: dict[str, dict | None], command: list[str], env: dict[str, str],
                sink=None, task_envs: dict[str, dict[str, str]] | None = None) -> list[Task]:
    sink = sink or sys.stdout
    lock = threading.Lock()
    started: list[Task] = []
    for name, tf_config in tasks.items():
        task_env = {**(task_envs or {}).get(name, {}), **env}  # the caller's env wins
        task_env.pop("TF_CONFIG", None)
        if tf_config is not None:
            task_env["TF_CONFIG"] = json.dumps(tf_config)
        proc = subprocess.Popen(
            command, env=task_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, start_new_session=True, preexec_fn=_die_with_parent,
        )
        keep: list[str] = []
        pump = threading.Thread(target=_pump, args=(name, proc.stdout, sink, keep, lock), daemon=True)
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
              grace: float = 5.0, log=print) -> int:
    deadline = time.monotonic() + timeout
    exits: dict[str, int | None] = {t.name: None for t in tasks}
    try:
        while True:
            for t in tasks:
                if exits[t.name] is None and (code := t.proc.poll()) is not None:
                    exits[t.name] = code
                    log(f"[launch] {t.name} exited with code {code}")
            code = decide(strategy, exits)
            if code is not None:
                if code != 0:
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
    p = argparse.ArgumentParser(add_help=False)
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
        running = start_tasks(tasks, command, env,
                              task_envs=thread_env(args.strategy, tasks, os.cpu_count() or 1))
        code = supervise(args.strategy, running, args.timeout, grace=args.grace,
                         log=lambda m: print(m, flush=True))
    except KeyboardInterrupt:
        print("[launch] interrupted; stopping every task", flush=True)
        stop_tasks(running, grace=args.grace)
        return 130
    print(f"[launch] done: exit code {code}", flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
