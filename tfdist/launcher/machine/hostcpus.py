"""``--host-cpus C``: every simulated host a CPU budget of its own.

The simulated hosts share one machine's cores, so without a budget a
worker added to a job adds no compute. With ``--host-cpus C`` every host
gets one cgroup v1 CFS quota of C cores per period, which every member
placed on it joins before exec (``engine.local.child_setup``), relaunches and
re-formations included: N hosts of C cores then compute like N small
machines, as long as the machine has N x C cores to give. A second cgroup
per host in the ``cpuacct`` hierarchy counts the CPU time its members used
(``outcome.json``'s ``host_cpus``).

``plan_host_cpus`` checks the request (pure); ``HostCpus`` makes, records
and removes the cgroups (``launcher/machine/cgroups.py`` does the writing).
"""

from __future__ import annotations

import math
import os
import time

from tfdist.launcher.machine import cgroups
from tfdist.launcher.plan import LaunchError


def plan_host_cpus(cores: float | None, hosts: int, machine_cores: int,
                   slowed: bool = False, problem: str | None = None) -> float | None:
    """``--host-cpus`` checked against the job and the machine (pure; LaunchError).

    ``problem``: why this machine cannot make the cgroups (``cgroups_problem``),
    or ``None``; ``slowed``: whether ``--slow`` is asked for too.
    """
    if cores is None:
        return None
    if not hosts:
        raise LaunchError(f"--host-cpus={cores:g} is each simulated host's CPU budget; add "
                          "--hosts N (each host its own budget), or drop --host-cpus")
    if not 0 < cores < math.inf:
        raise LaunchError(f"--host-cpus={cores:g} is not allowed; use a positive number of "
                          "cores, e.g. 0.5")
    if hosts * cores > machine_cores + 1e-9:
        most = machine_cores / hosts
        raise LaunchError(f"--host-cpus={cores:g} for {hosts} hosts is {hosts * cores:g} "
                          f"cores, more than this machine's {machine_cores}; use at most "
                          f"{math.floor(most * 100) / 100:g} per host, or fewer --hosts")
    if slowed:
        raise LaunchError("--slow puts a member in a CPU-quota cgroup of its own, and "
                          "--host-cpus every member in its host's: a process joins one; "
                          "drop one of the two")
    if problem is not None:
        raise LaunchError(f"--host-cpus needs CPU cgroups: {problem}; run as root on Linux "
                          "with cgroup v1, or drop the flag")
    return float(cores)


def cgroups_problem() -> str | None:
    """Why host budgets cannot be made here (a quota, and an account of the time
    used), or ``None``."""
    problem = cgroups.cgroup_problem()
    if problem is None and cgroups.cgroup_root("cpuacct") is None:
        problem = "no cgroup v1 cpuacct controller is mounted"
    return problem


class HostCpus:
    """One quota cgroup and one accounting cgroup per host for the launcher's
    life; ``close`` removes them."""

    def __init__(self, cores: float, host_of: dict[str, int], log=print,
                 roots: tuple[str, str] | None = None):
        self.cores, self.host_of, self.log = cores, dict(host_of), log
        # launch.py checked that both can be made (cgroups_problem) before anything started.
        cpu, acct = roots or (cgroups.cpu_cgroup_root(), cgroups.cgroup_root("cpuacct"))
        self.paths: dict[int, tuple[str, str]] = {}
        self.created = time.monotonic()  # the budgets' life: the job's, relaunches included
        for host in sorted(set(self.host_of.values())):
            name = f"{cgroups.CGROUP_PREFIX}{os.getpid()}-host{host}"
            self.paths[host] = (os.path.join(cpu, name), os.path.join(acct, name))
            cgroups.create(self.paths[host][0], cgroups.quota_us(cores, 1))
            os.makedirs(self.paths[host][1], exist_ok=True)
        self.log(f"[launch] host CPUs: {len(self.paths)} host(s) of {cores:g} core(s) each "
                 f"(CFS quota {cgroups.quota_us(cores, 1)} us per {cgroups.CFS_PERIOD_US} us)")

    def cgroups_for(self, member: str) -> tuple[str, ...]:
        return self.paths[self.host_of[member]]

    def record(self) -> dict:
        """Each host's budget, members, CPU time used so far, and how long its quota
        held them back (a host using less than its budget while never held back
        was waiting: on its peers, or for a core the machine's other work had)."""
        out = {}
        for host, (quota, acct) in self.paths.items():
            used, held = cgroups.cpu_usage_seconds(acct), cgroups.throttled_seconds(quota)
            out[f"host{host}"] = {
                "cores": self.cores,
                "members": [n for n, h in self.host_of.items() if h == host],
                "cpu_seconds": round(used, 2) if used is not None else None,
                "throttled_seconds": round(held, 2) if held is not None else None}
        return out

    def describe(self, wall_seconds: float) -> str:
        parts = []
        for host, r in self.record().items():
            used, held = r["cpu_seconds"], r["throttled_seconds"]
            said = []
            if used is not None and wall_seconds > 0:
                said.append(f"{used / (wall_seconds * self.cores):.0%} of its budget over "
                            f"{wall_seconds:.0f} s")
            if held is not None:
                said.append(f"held back {held:g} s")
            parts.append(f"{host} {used if used is not None else '?'} s"
                         + (f" ({', '.join(said)})" if said else ""))
        return "[launch] CPU time used per host: " + "; ".join(parts)

    def finish(self) -> dict:
        """The record at the job's end, and the launcher's line on it."""
        self.log(self.describe(time.monotonic() - self.created))
        return self.record()

    def close(self) -> None:
        for quota, acct in self.paths.values():
            cgroups.remove(quota, log=self.log)
            cgroups.remove(acct, log=self.log)
