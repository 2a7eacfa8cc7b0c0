"""Run a whole simulated cluster on this machine: one ``train.py`` per task.

    python launch.py --strategy multiworker --workers 2 -- --epochs 1 --model-dir runs/mw
    python launch.py --strategy ps --workers 2 --ps 1 --hosts 3 --slow worker:1=0.25 -- --epochs 1

Each task gets its own TF_CONFIG and runs the same command a user runs on a
real host. The TF_CONFIGs and commands are saved in ``<model-dir>/launch/``
so any task can be replayed by hand. Output lines are prefixed with their
task. If a task fails the others are stopped, and the launcher exits with
that task's code; no task outlives the launcher.

By default every task listens on loopback in one private network namespace
(``--netns``). ``--hosts N`` places the tasks on N simulated hosts, each with
its own address on a private bridge; ``--link-rate`` shapes their links;
``--slow`` runs a task at a fraction of its speed. The work is done by the
``launcher`` package (plan, network, processes, faults, supervisor); this
file only reads the flags.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys

from launcher import network, processes, supervisor
from launcher import plan as plans
from launcher.faults import add_recovery_args, plan_recovery
from launcher.network import INSIDE_FLAG, NETNS_MODES
from launcher.plan import LaunchError
from protocol import Exit


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
    p.add_argument("--host", default="localhost",
                   help="address written into TF_CONFIG (without --hosts)")
    p.add_argument("--hosts", type=int, default=0, metavar="N",
                   help="place the tasks on N simulated hosts, each a network namespace with "
                        f"its own address ({plans.host_address(0)}, {plans.host_address(1)}, ...) "
                        "on a private bridge; coordinating tasks (ps chief, ps) on host 0, "
                        "workers spread over the others")
    p.add_argument("--link-rate", default=None, metavar="RATE",
                   help="with --hosts: shape every host's link to RATE each way (tc tbf; e.g. "
                        "1gbit, 100mbit; no latency emulation), measured once at start")
    p.add_argument("--program", default=None, metavar="FILE.py",
                   help="run this Python program on every task instead of train.py, with the "
                        "same arguments (--strategy=... and everything after --) and TF_CONFIG; "
                        "it must honour --model-dir (e.g. the benchmark's bench/peers/)")
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
    if args.program is not None:
        args.program = os.path.abspath(args.program)
    if any(a == "--strategy" or a.startswith("--strategy=") for a in train_args):
        p.error("pass --strategy to launch.py only; it forwards it to every task")
    args.launch_argv = argv
    return args, train_args


def plan_cluster(args) -> plans.ClusterPlan:
    if args.hosts and args.host != "localhost":
        raise LaunchError(f"--host {args.host} names the one address of a loopback cluster; "
                          "--hosts gives each simulated host its own: use one of the two")
    if args.hosts:
        return plans.build_host_cluster(args.strategy, args.workers, args.ps, args.chief,
                                        args.hosts)
    n = plans.task_count(args.strategy, args.workers, args.ps, args.chief)
    return plans.loopback_plan(args.strategy, args.workers, args.ps, args.chief,
                               processes.free_ports(n), args.host)


def main(argv=None) -> int:
    args, train_args = parse_args(argv)
    try:
        if args.program is not None and not os.path.isfile(args.program):
            raise LaunchError(f"--program {args.program!r} is not a file; pass the path of "
                              "a Python program that takes train.py's arguments")
        cluster = plan_cluster(args)
        recovery = plan_recovery(args, cluster.tf_configs)
        rate = network.parse_rate(args.link_rate) if args.link_rate is not None else None
        if args.netns_inside:
            use_netns, warning = False, None
        else:
            network.check_hosts_mode(args.hosts, args.netns, args.link_rate, network.hosts_problem)
            use_netns, warning = (True, None) if args.hosts else network.decide_netns(
                args.netns, args.strategy, network.netns_problem)
    except LaunchError as err:
        print(f"error: {err}", file=sys.stderr)
        return Exit.BAD_INPUT
    if warning:
        print(warning, file=sys.stderr, flush=True)
    if use_netns:
        code = processes.prepare_data(train_args, dict(os.environ))
        if code != 0:
            return code
        print("[launch] private network namespace: only the cluster's own tasks can reach "
              "its ports", flush=True)
        return network.run_in_netns(network.netns_command(args.launch_argv, train_args), args.grace)
    return run_inside(args, train_args, cluster, recovery, rate)


def run_inside(args, train_args, cluster, recovery, rate) -> int:
    """The launcher in its namespace (or on the host network): build, run, tear down."""
    log = lambda m: print(m, flush=True)  # noqa: E731
    if args.netns_inside:
        network.loopback_up()
    model_dir = processes.train_arg(train_args, "--model-dir", f"runs/{args.strategy}")
    if not processes.has_flag(train_args, "--model-dir"):
        train_args = [*train_args, "--model-dir", model_dir]
    launch_dir = os.path.join(model_dir, "launch")
    command = processes.task_command(args.strategy, train_args, program=args.program)

    received: list[int] = []
    holder: list = []

    def on_signal(signum, _frame):
        received.append(signum)
        raise KeyboardInterrupt(signum)

    signal.signal(signal.SIGTERM, on_signal)
    hosts = link = None
    try:
        if cluster.hosts:
            hosts = network.SimulatedHosts(cluster.hosts, rate)
            try:
                hosts.up()
                check = hosts.measure() if rate else None
            except (OSError, RuntimeError, ValueError, subprocess.SubprocessError) as err:
                # The outer launcher's probe passed, so this is the machine
                # (no tc, no tbf, ...), not the flags: exit 1, not 2.
                log(f"[launch] error: could not build or measure {cluster.hosts} simulated "
                    f"hosts: {err}")
                return Exit.FAILED
            log("[launch] hosts: " + ", ".join(
                f"host{i} {plans.host_address(i)} ("
                f"{', '.join(n for n, h in cluster.host_of.items() if h == i)})"
                for i in range(cluster.hosts)) + f" on bridge {network.BRIDGE} "
                f"({plans.BRIDGE_ADDRESS}/{plans.PREFIX}), private to this launcher")
            if check is not None:
                link = {"rate": args.link_rate, **check.to_dict()}
                log(f"[launch] links: {check.describe(args.link_rate)}")
        processes.save_launch_files(launch_dir, cluster, command)
        log(f"[launch] {args.strategy}: {', '.join(cluster.names)}; TF_CONFIGs in {launch_dir}/")
        env = dict(os.environ)
        env.setdefault("PYTHONUNBUFFERED", "1")
        code = supervisor.run_job(args, cluster, command, env, recovery, holder, log=log,
                                  launch_dir=launch_dir, network=hosts, link=link)
    except KeyboardInterrupt:
        log("[launch] interrupted; stopping every task")
        return supervisor.interrupted(holder, received)
    finally:
        if hosts is not None:
            hosts.close()
    log(f"[launch] done: exit code {code}")
    return code


if __name__ == "__main__":
    sys.exit(main())
