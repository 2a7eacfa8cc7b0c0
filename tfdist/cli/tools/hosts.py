"""``python -m tfdist.cli.tools.hosts --hosts N [--link-rate RATE]``: build N simulated hosts in a
private network namespace, measure one link, tear them down (``launcher/machine/network.py``);
also the launcher's own probe of whether this machine can build them."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

from tfdist.launcher import plan as plans
from tfdist.launcher.machine.network import (INSIDE_FLAG, PROBE_COMMAND, UNSHARE, SimulatedHosts,
                                             netns_problem, parse_rate)
from tfdist.launcher.plan import LaunchError


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="Build N simulated hosts, measure a link, tear down.")
    p.add_argument("--hosts", type=int, default=2, help="simulated hosts to build")
    p.add_argument("--link-rate", default=None, help="shape every host's link to RATE (e.g. 100mbit)")
    p.add_argument("--probe", action="store_true", help=argparse.SUPPRESS)
    p.add_argument(INSIDE_FLAG, action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    try:
        rate = parse_rate(args.link_rate) if args.link_rate else None
        if args.hosts < 2 or args.hosts > plans.MAX_HOSTS:
            raise LaunchError(f"--hosts={args.hosts}; use 2 to {plans.MAX_HOSTS}")
    except LaunchError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if args.probe:  # run by network.hosts_problem(), already inside a namespace
        hosts = SimulatedHosts(args.hosts)
        try:
            hosts.up()
        finally:
            hosts.close()
        return 0
    if not args.netns_inside:
        problem = netns_problem()
        if problem is not None:
            print(f"error: no network namespace here ({problem})", file=sys.stderr)
            return 2
        cmd = [*UNSHARE, sys.executable, *PROBE_COMMAND, *(argv or sys.argv[1:]), INSIDE_FLAG]
        return subprocess.run(cmd, stdin=subprocess.DEVNULL).returncode
    hosts = SimulatedHosts(args.hosts, rate)
    try:
        hosts.up()
        check = hosts.measure()
    finally:
        hosts.close()
    print(json.dumps({"hosts": args.hosts, "link_rate": args.link_rate, **check.to_dict()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
