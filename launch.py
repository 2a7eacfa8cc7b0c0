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
``launcher`` package (plan, network, processes, faults, supervisor); this
file only reads the flags into one ``LaunchConfig`` and runs it.
"""

from __future__ import annotations

import argparse
import math
import os
import signal
import subprocess
import sys

import protocol
from launcher import memory, network, processes, supervisor
from launcher import plan as plans
from launcher.config import LaunchConfig
from launcher.faults import FAULT_SPEC, MAX_TASK_RESTARTS, plan_recovery
from launcher.network import INSIDE_FLAG, NETNS_MODES
from launcher.plan import LaunchError
from protocol import Exit
from strategies import kinds
from strategies.kinds import StrategyKind


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
    if args.program is not None:
        args.program = os.path.abspath(args.program)
    if any(a == "--strategy" or a.startswith("--strategy=") for a in train_args):
        raise protocol.UsageError("pass --strategy to launch.py only; it forwards it to every task")
    if any(a == "--dry-run" for a in train_args):
        raise protocol.UsageError(
            "pass --dry-run to launch.py, before --: it asks every task for its plan")
    args.launch_argv = argv
    return args, train_args


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


def check_times(args) -> None:
    """--timeout and --grace: finite seconds (nan compares false and would never fire)."""
    if not 0 < args.timeout < math.inf:
        raise LaunchError(f"--timeout={args.timeout:g} is not allowed; use a positive, finite "
                          "number of seconds")
    if not 0 <= args.grace < math.inf:
        raise LaunchError(f"--grace={args.grace:g} is not allowed; use 0 or more (finite) "
                          "seconds")


def plan_cluster(args, kind: StrategyKind) -> plans.ClusterPlan:
    if args.hosts and args.host != "localhost":
        raise LaunchError(f"--host {args.host} names the one address of a loopback cluster; "
                          "--hosts gives each simulated host its own: use one of the two")
    if args.hosts:
        return plans.build_host_cluster(kind, args.workers, args.ps, args.chief, args.hosts)
    n = plans.task_count(kind, args.workers, args.ps, args.chief)
    return plans.loopback_plan(kind, args.workers, args.ps, args.chief,
                               processes.free_ports(n), args.host)


def with_model_dir(kind: StrategyKind, train_args: list[str]) -> tuple[list[str], str]:
    """``train_args`` with ``--model-dir`` (default ``runs/<strategy>``), and that directory."""
    model_dir = processes.train_arg(train_args, "--model-dir", f"runs/{kind.name}")
    if not processes.has_flag(train_args, "--model-dir"):
        train_args = [*train_args, "--model-dir", model_dir]
    return train_args, model_dir


def with_task_path(train_args: list[str]) -> list[str]:
    """``--task path/to/task.py[:NAME]`` made absolute from here: every task
    starts in the project's directory, and the user's relative path means
    the file beside them, the same one on every task."""
    out = list(train_args)
    for i, arg in enumerate(out):
        if arg == "--task" and i + 1 < len(out):
            at, prefix, value = i + 1, "", out[i + 1]
        elif arg.startswith("--task="):
            at, prefix, value = i, "--task=", arg[len("--task="):]
        else:
            continue
        path, colon, name = value.partition(":")
        if path.endswith(".py") or os.sep in path:
            out[at] = prefix + os.path.abspath(path) + colon + name
    return out


def build_config(args, train_args: list[str]) -> LaunchConfig:
    """The flags, checked, as one frozen config (LaunchError: one line, nothing written)."""
    kind = kinds.get(args.strategy)  # argparse's choices: always known
    train_args, model_dir = with_model_dir(kind, with_task_path(train_args))
    check_times(args)
    if args.program is not None and args.dry_run:
        raise LaunchError("--dry-run shows train.py's own plan for each task; it does not "
                          "apply with --program: drop one of the two")
    if args.program is not None and not os.path.isfile(args.program):
        raise LaunchError(f"--program {args.program!r} is not a file; pass the path of "
                          "a Python program that takes train.py's arguments")
    cluster = plan_cluster(args, kind)
    recovery = plan_recovery(kind, cluster.tf_configs, kill=args.kill, preempt=args.preempt,
                             hang=args.hang, partition=args.partition, hosts=args.hosts,
                             slow=args.slow, restart_tasks=args.restart_tasks,
                             restart_delay=args.restart_delay, max_restarts=args.max_restarts)
    rate = network.parse_rate(args.link_rate) if args.link_rate is not None else None
    roles: dict[str, list[str]] = {}
    for name in cluster.names:
        roles.setdefault(name.partition(":")[0], []).append(name)
    try:
        limits = memory.parse_limits(args.memory_limit, roles)
    except memory.MemoryLimitError as err:
        raise LaunchError(str(err)) from None
    problem = memory.limits_problem() if limits else None
    if problem is not None:
        raise LaunchError(f"--memory-limit needs a memory cgroup: {problem}; run as root on "
                          "Linux with cgroup v1, or drop the flag")
    return LaunchConfig(
        kind=kind, cluster=cluster, recovery=recovery,
        cores=processes.share_cores(kind, cluster.names, os.cpu_count() or 1),
        train_args=tuple(train_args), model_dir=model_dir, program=args.program,
        timeout=args.timeout, grace=args.grace, dry_run=args.dry_run, netns=args.netns,
        netns_inside=args.netns_inside, link_rate=args.link_rate, rate_bits=rate,
        launch_argv=tuple(args.launch_argv), memory_limits=limits)


def decide_network(config: LaunchConfig) -> tuple[bool, str | None]:
    """Whether the cluster runs in a private namespace, and the warning if it cannot."""
    if config.netns_inside:
        return False, None
    network.check_hosts_mode(config.cluster.hosts, config.netns, config.link_rate,
                             network.hosts_problem)
    use_netns, warning = (True, None) if config.cluster.hosts else network.decide_netns(
        config.netns, config.kind, network.netns_problem)
    processes.check_launch_dir(config.launch_dir)
    return use_netns, warning


def show_plan(cluster: plans.ClusterPlan, checks: list[processes.TaskCheck]) -> None:
    """``--dry-run``: each task's address and duty, then the job's figures."""
    width = max(len(c.task) for c in checks)
    for c in checks:
        if c.plan is None:
            print(f"{c.task:<{width}}  {c.error}")
            continue
        address = ""
        if c.plan.get("cluster"):
            role, _, index = c.task.partition(":")
            address = c.plan["cluster"][role][int(index)]
        host = f" on {cluster.where(c.task)}" if cluster.hosts else ""
        print(f"{c.task:<{width}}  {address}{host}: {c.plan['action']}")
    chief = next((c.plan for c in checks if c.plan and c.plan.get("is_chief")), None)
    if chief is not None:
        k = chief.get("gradients_per_update", 1)
        split = (f"{chief['global_batch_size'] // k} per gradient x K={k} gradients per update"
                 if k > 1 else f"{chief['per_replica_batch_size']} per replica x "
                               f"{chief['replicas_in_sync']} in sync")
        print(f"global batch {chief['global_batch_size']} ({split}), {chief['total_steps']} "
              f"steps, model dir {chief['model_dir']}")


def main(argv=None) -> int:
    try:
        args, train_args = parse_args(argv)
    except protocol.UsageError as err:
        print(f"error: {err}", file=sys.stderr)
        return Exit.BAD_INPUT
    try:
        config = build_config(args, train_args)
        use_netns, warning = decide_network(config)
    except LaunchError as err:
        print(f"error: {err}", file=sys.stderr)
        return Exit.BAD_INPUT
    if not config.netns_inside and config.program is None:
        # The inner launcher in the namespace was checked by the outer one.
        code = preflight(config)
        if code is not None:
            return code
    if warning:
        print(warning, file=sys.stderr, flush=True)
    if use_netns:
        code = processes.prepare_data(list(config.train_args), dict(os.environ))
        if code != 0:
            return code
        print("[launch] private network namespace: only the cluster's own tasks can reach "
              "its ports", flush=True)
        return network.run_in_netns(
            network.netns_command(list(config.launch_argv), list(config.train_args)),
            config.grace)
    return run_inside(config)


def preflight(config: LaunchConfig) -> int | None:
    """Every task checks its own flags and TF_CONFIG before anything is written or
    started: the exit code to end with (a failed check, or ``--dry-run`` done), else None.

    One task per role is enough to check flags (the others differ only by
    index); ``--dry-run`` shows them all.
    """
    cluster = config.cluster
    roles: dict[str, str] = {}
    for name in cluster.names:
        roles.setdefault(name.partition(":")[0], name)
    checked = cluster.names if config.dry_run else list(roles.values())
    checks = processes.check_tasks({n: cluster.tf_configs[n] for n in checked},
                                   processes.task_command(config.kind, list(config.train_args)),
                                   dict(os.environ), full=config.dry_run)
    if config.dry_run:
        show_plan(cluster, checks)
    failed = [c for c in checks if c.code != 0]
    if failed:
        if not config.dry_run:
            same = all(c.error == failed[0].error for c in failed)
            print(failed[0].error if same else f"{failed[0].task}: {failed[0].error}",
                  file=sys.stderr)
        return failed[0].code
    return Exit.OK if config.dry_run else None


def run_inside(config: LaunchConfig) -> int:
    """The launcher in its namespace (or on the host network): build, run, tear down."""
    log = lambda m: print(m, flush=True)  # noqa: E731
    if config.netns_inside:
        network.loopback_up()
    cluster, launch_dir = config.cluster, config.launch_dir
    command = processes.task_command(config.kind, list(config.train_args), program=config.program)

    received: list[int] = []
    holder: list = []

    def on_signal(signum, _frame):
        received.append(signum)
        raise KeyboardInterrupt(signum)

    signal.signal(signal.SIGTERM, on_signal)
    hosts = None
    try:
        link = None
        if cluster.hosts:
            hosts = network.SimulatedHosts(cluster.hosts, config.rate_bits)
            link = build_hosts(config, hosts, log)
            if link is False:
                return Exit.FAILED
        try:
            processes.save_launch_files(launch_dir, cluster, command)
        except OSError as err:
            log(f"[launch] error: could not write the launch files into {launch_dir!r} "
                f"({err.strerror or err}: {err.filename}); nothing was started. Free space or "
                "make the directory writable, then run the same command again")
            return Exit.STORAGE
        log(f"[launch] {config.kind.name}: {', '.join(cluster.names)}; TF_CONFIGs in {launch_dir}/")
        env = dict(os.environ)
        env.setdefault("PYTHONUNBUFFERED", "1")
        code = supervisor.run_job(config, command, env, holder, log=log,
                                  launch_dir=launch_dir, network=hosts, link=link)
    except KeyboardInterrupt:
        log("[launch] interrupted; stopping every task")
        return supervisor.interrupted(holder, received)
    finally:
        if hosts is not None:
            hosts.close()
    log(f"[launch] done: exit code {code}")
    return code


def build_hosts(config: LaunchConfig, hosts, log):
    """Bring the simulated hosts up and measure a shaped link: the link record
    (``None`` unshaped), or ``False`` if the machine cannot (exit 1, not 2:
    the outer launcher's probe passed, so it is the machine, not the flags)."""
    cluster = config.cluster
    try:
        hosts.up()
        check = hosts.measure() if config.rate_bits else None
    except (OSError, RuntimeError, ValueError, subprocess.SubprocessError) as err:
        log(f"[launch] error: could not build or measure {cluster.hosts} simulated "
            f"hosts: {err}")
        return False
    log("[launch] hosts: " + ", ".join(
        f"host{i} {plans.host_address(i)} ("
        f"{', '.join(n for n, h in cluster.host_of.items() if h == i)})"
        for i in range(cluster.hosts)) + f" on bridge {network.BRIDGE} "
        f"({plans.BRIDGE_ADDRESS}/{plans.PREFIX}), private to this launcher")
    if check is None:
        return None
    log(f"[launch] links: {check.describe(config.link_rate)}")
    return {"rate": config.link_rate, **check.to_dict()}


if __name__ == "__main__":
    sys.exit(main())
