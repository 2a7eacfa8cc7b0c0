"""Run a whole simulated cluster on this machine: one ``train.py`` per task.

    python launch.py --strategy multiworker --workers 2 -- --epochs 1 --model-dir runs/mw
    python launch.py --strategy ps --workers 2 --ps 1 --hosts 3 --slow worker:1=0.25 -- --epochs 1

Each task gets its own TF_CONFIG and runs the same command a user runs on a
real host. The TF_CONFIGs and commands are saved in ``<model-dir>/launch/``
so any task can be replayed by hand. Every task checks its own flags first
(``--dry-run`` prints each task's plan), so bad input ends the launch before
anything is written. Output lines are prefixed with their task. If a task
fails the others are stopped, and the launcher exits with that task's code
(a task ended by a signal counts as lost: 75); no task outlives the launcher.

By default every task listens on loopback in one private network namespace
(``--netns``). ``--hosts N`` places the tasks on N simulated hosts, each with
its own address on a private bridge; ``--link-rate`` shapes their links;
``--slow`` runs a task at a fraction of its speed. The work is done by the
``tfdist.launcher`` package (``job``: plan, network, processes, faults,
supervisor); this file only reads the flags into one ``LaunchRequest`` and runs it.
"""

from __future__ import annotations

import argparse
import sys

from tfdist import protocol
from tfdist.launcher import plan as plans
from tfdist.launcher.config import LaunchRequest
from tfdist.launcher.elastic import DEFAULT_REJOIN_TIMEOUT
from tfdist.launcher.faults import FAULT_SPEC, MAX_TASK_RESTARTS
from tfdist.launcher.job import TaskCheckFailed, run_request
from tfdist.launcher.network import INSIDE_FLAG, NETNS_MODES
from tfdist.launcher.plan import LaunchError
from tfdist.protocol import Exit
from tfdist.strategies import kinds


def parse_args(argv=None):
    names = kinds.names(include_auto=False)
    p = protocol.OneLineParser(
        description=__doc__.split("\n\n")[0],
        usage="launch.py --strategy {%s} [options] -- [train.py args]" % ",".join(names),
        formatter_class=protocol.HelpFormatter,
        epilog="Everything after -- goes to every task's train.py (see train.py --help). "
               + protocol.exit_epilog(),
    )
    cluster = p.add_argument_group("cluster")
    cluster.add_argument("--strategy", required=True, choices=names)
    cluster.add_argument("--workers", type=int, default=2)
    cluster.add_argument("--ps", type=int, default=0)
    cluster.add_argument("--chief", action="store_true",
                         help="multiworker: add a separate chief task (it trains too)")
    cluster.add_argument("--dry-run", action="store_true",
                         help="print every task's plan (its own train.py --dry-run) and exit; "
                              "nothing is started or written")
    net = p.add_argument_group("simulated hosts and network")
    net.add_argument("--host", default="localhost",
                     help="address written into TF_CONFIG (without --hosts)")
    net.add_argument("--hosts", type=int, default=0, metavar="N",
                     help="place the tasks on N simulated hosts, each a network namespace with "
                          f"its own address ({plans.host_address(0)}, {plans.host_address(1)}, "
                          "...) on a private bridge; coordinating tasks (ps chief, ps) on host "
                          "0, workers spread over the others")
    net.add_argument("--link-rate", default=None, metavar="RATE",
                     help="with --hosts: shape every host's link to RATE each way (tc tbf; "
                          "e.g. 1gbit, 100mbit; no latency emulation), measured once at start")
    net.add_argument("--netns", default="auto", choices=NETNS_MODES,
                     help="run the cluster in a private network namespace, unreachable from "
                          "outside: auto (when the OS allows it; else a warning), on (or "
                          "fail), off")
    net.add_argument(INSIDE_FLAG, action="store_true", help=argparse.SUPPRESS)
    engine = p.add_argument_group("engine")
    engine.add_argument("--engine", default="local", choices=("local", "ray"),
                        help="local: the tasks as processes of this host (default); ray: each "
                             "task a Ray actor on a Ray cluster (pip install "
                             "'tf-distribute-showcase[ray]')")
    engine.add_argument("--address", default=None, metavar="auto|HOST:PORT",
                        help="with --engine ray: the running Ray cluster to join (auto: the "
                             "one on this node); without it a local Ray instance is started "
                             "for the job and stopped after")
    engine.add_argument("--ray-placement", default="spread",
                        choices=("spread", "strict-spread", "pack", "spread-workers"),
                        help="with --engine ray: how the placement group (one bundle per "
                             "task) spreads the tasks over the nodes (spread-workers: spread, "
                             "with ps and a coordinating chief on the head node)")
    job = p.add_argument_group("job control")
    job.add_argument("--timeout", type=float, default=3600.0,
                     help="seconds before the job is stopped")
    job.add_argument("--grace", type=float, default=10.0,
                     help="seconds between SIGTERM and SIGKILL")
    job.add_argument("--program", default=None, metavar="FILE.py",
                     help="run this Python program on every task instead of train.py, with the "
                          "same arguments (--strategy=... and everything after --) and "
                          "TF_CONFIG; it must honour --model-dir (e.g. the benchmark's "
                          "bench/peers/); the tasks' own pre-flight check is skipped")
    add_recovery_args(p.add_argument_group("faults and recovery"))
    argv = list(sys.argv[1:] if argv is None else argv)
    train_args = []
    if "--" in argv:
        i = argv.index("--")
        argv, train_args = argv[:i], argv[i + 1:]
    args = p.parse_args(argv)
    if any(a == "--strategy" or a.startswith("--strategy=") for a in train_args):
        raise protocol.UsageError("pass --strategy to launch.py only; it forwards it to every task")
    if any(a == "--dry-run" for a in train_args):
        raise protocol.UsageError(
            "pass --dry-run to launch.py, before --: it asks every task for its plan")
    return args, train_args


def request_from_args(args: argparse.Namespace, train_args: list[str]) -> LaunchRequest:
    """Flags -> the typed request (the only place the launcher's Namespace is read)."""
    options = {k: tuple(v or ()) if k in LaunchRequest.REPEATED else v
               for k, v in vars(args).items()}
    return LaunchRequest(**options, train_args=tuple(train_args))


def add_recovery_args(p) -> None:
    p.add_argument("--kill", action="append", metavar="ROLE:INDEX@WHEN",
                   help=f"SIGKILL a task (repeatable; several of one task fire in order, "
                        f"one per process of it, e.g. after each restart); {FAULT_SPEC}")
    p.add_argument("--preempt", action="append", metavar="ROLE:INDEX@WHEN",
                   help="SIGTERM a task, a polite preemption (repeatable); same WHEN")
    p.add_argument("--hang", action="append", metavar="ROLE:INDEX@WHEN[+SECONDS]",
                   help="SIGSTOP a task's process group, alive but stuck (a frozen host or VM); "
                        "SIGCONT after SECONDS if given, always before the launcher stops it; "
                        "repeatable; same WHEN")
    p.add_argument("--partition", action="append", metavar="hostN@WHEN[+SECONDS]",
                   help="with --hosts: take a simulated host's link down (ip link set ... "
                        "down), up again after SECONDS if given, always when the launcher "
                        "ends; repeatable; same WHEN")
    p.add_argument("--slow", action="append", metavar="ROLE:INDEX=FRACTION[@WHEN]",
                   help="run a task at FRACTION of its speed, from outside the process (a CFS "
                        "CPU quota, else a SIGSTOP/SIGCONT duty cycle); repeatable, restarts "
                        "included; without @WHEN from its start")
    p.add_argument("--memory-limit", action="append", metavar="ROLE=SIZE",
                   help="run each task of ROLE in a memory cgroup of SIZE (e.g. ps=1200M, "
                        "1.5G): past it the kernel ends the task, as a container's limit "
                        "would; repeatable; root on Linux (cgroup v1)")
    p.add_argument("--restart-tasks", action="store_true",
                   help=f"ps, ps-sync: restart a dead worker with its TF_CONFIG (at most "
                        f"{MAX_TASK_RESTARTS} times each), and kill and restart one the chief "
                        "reports stuck, as a cluster manager's liveness check would")
    p.add_argument("--restart-delay", type=float, default=2.0,
                   help="seconds before a task or job is restarted")
    p.add_argument("--max-restarts", type=int, default=0,
                   help="relaunch a failed or preempted job up to N times with the same "
                        "--model-dir (it resumes from its checkpoint)")
    p.add_argument("--min-workers", type=int, default=None, metavar="M",
                   help="multiworker: when a worker's host stays unreachable for "
                        "--rejoin-timeout, re-form the job with the survivors (at least M; "
                        "same global batch, from the newest checkpoint), and with the lost "
                        "worker again when its host is back; below M, exit 75")
    p.add_argument("--rejoin-timeout", type=float, default=None, metavar="SECONDS",
                   help=f"with --min-workers: how long a lost worker's host may stay "
                        f"unreachable before the job goes on without it (default "
                        f"{DEFAULT_REJOIN_TIMEOUT:g})")


def main(argv=None) -> int:
    try:
        args, train_args = parse_args(argv)
    except protocol.UsageError as err:
        print(f"error: {err}", file=sys.stderr)
        return Exit.BAD_INPUT
    try:
        return run_request(request_from_args(args, train_args))
    except TaskCheckFailed as err:
        print(err.line, file=sys.stderr)
        return err.code
    except LaunchError as err:
        print(f"error: {err}", file=sys.stderr)
        return Exit.BAD_INPUT


if __name__ == "__main__":
    sys.exit(main())
