"""Every member's own check, before anything is written or started, and ``--dry-run``.

Each member runs its own ``tfdist-train --check-only`` (``--dry-run`` under
``launch.py --dry-run``) with its TF_CONFIG: a bad flag ends the launch with
the member's own error line before ``launch/`` is written.
"""

from __future__ import annotations

import json
import subprocess
import time
from dataclasses import dataclass

import os

from tfdist.launcher import plan as plans
from tfdist.launcher.config import LaunchConfig
from tfdist.launcher.engine.api import Formation
from tfdist.launcher.engine.local import member_command
from tfdist.launcher.plan import LaunchError
from tfdist.protocol import Exit


class MemberCheckFailed(LaunchError):
    """A task's own check refused the job: its line (as the task printed it) and exit code."""

    def __init__(self, line: str, code: int):
        super().__init__(line.removeprefix("error: "))
        self.line, self.code = line, code


@dataclass(frozen=True)
class MemberCheck:
    """One task's ``train.py --dry-run``: its exit code, plan, or error line."""

    member: str
    code: int
    plan: dict | None = None
    error: str = ""


def check_members(tf_configs: dict[str, dict | None], command: list[str], env: dict[str, str],
                timeout: float = 120.0, full: bool = False) -> list[MemberCheck]:
    """Run every task's own check with its TF_CONFIG, all at once.

    ``--check-only`` checks flags, cluster and run directory without
    TensorFlow, so a bad flag ends the launch before it writes ``launch/``
    or starts anything, with the task's own error line. ``full``: the
    task's ``--dry-run``, which imports TensorFlow to list the GPUs.
    """
    procs = {}
    for name, tf_config in tf_configs.items():
        member_env = {k: v for k, v in env.items() if k != "TF_CONFIG"}
        if tf_config is not None:
            member_env["TF_CONFIG"] = json.dumps(tf_config)
        procs[name] = subprocess.Popen(
            [*command, "--dry-run" if full else "--check-only"], env=member_env, text=True,
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + timeout
    checks = []
    for name, proc in procs.items():
        try:
            out, err = proc.communicate(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            checks.append(MemberCheck(name, Exit.FAILED,
                                    error=f"error: {name}: its check did not answer in "
                                          f"{timeout:g}s"))
            continue
        lines = [line for line in err.splitlines() if line.strip()]
        errors = [line for line in lines if line.startswith("error:")]
        try:
            plan = json.loads(out) if proc.returncode == 0 else None
        except ValueError:
            plan = None  # e.g. --help: not a plan
        checks.append(MemberCheck(name, proc.returncode, plan if isinstance(plan, dict) else None,
                                (errors or lines or [""])[-1]))
    return checks


def show_plan(cluster: plans.ClusterPlan, checks: list[MemberCheck]) -> None:
    """``--dry-run``: each task's address and duty, then the job's figures."""
    width = max(len(c.member) for c in checks)
    for c in checks:
        if c.plan is None:
            print(f"{c.member:<{width}}  {c.error}")
            continue
        address = ""
        if c.plan.get("cluster"):
            role, _, index = c.member.partition(":")
            addresses = c.plan["cluster"].get(role) or []
            address = addresses[int(index)] if int(index) < len(addresses) else ""
        host = f" on {cluster.where(c.member)}" if cluster.hosts else ""
        print(f"{c.member:<{width}}  {address}{host}: {c.plan['action']}")
    chief = next((c.plan for c in checks if c.plan and c.plan.get("is_chief")), None)
    if chief is not None:
        k = chief.get("gradients_per_update", 1)
        split = (f"{chief['global_batch_size'] // k} per gradient x K={k} gradients per update"
                 if k > 1 else f"{chief['per_replica_batch_size']} per replica x "
                               f"{chief['replicas_in_sync']} in sync")
        print(f"global batch {chief['global_batch_size']} ({split}), {chief['total_steps']} "
              f"steps, model dir {chief['model_dir']}")


def preflight(config: LaunchConfig) -> int | None:
    """Every task checks its own flags and TF_CONFIG before anything is written or
    started: the exit code to end with (``--dry-run`` done), else None; a failed check
    raises MemberCheckFailed.

    One task per role is enough to check flags (the others differ only by
    index); ``--dry-run`` shows them all.
    """
    cluster = config.plan
    roles: dict[str, str] = {}
    for name in cluster.names:
        roles.setdefault(name.partition(":")[0], name)
    checked = cluster.names if config.dry_run else list(roles.values())
    checks = check_members({n: cluster.tf_configs[n] for n in checked},
                                   member_command(config, Formation(cluster.tf_configs, config.member)),
                                   dict(os.environ), full=config.dry_run)
    if config.dry_run:
        show_plan(cluster, checks)
    failed = [c for c in checks if c.code != 0]
    if failed:
        if not config.dry_run:
            same = all(c.error == failed[0].error for c in failed)
            raise MemberCheckFailed(failed[0].error if same
                                  else f"{failed[0].member}: {failed[0].error}", failed[0].code)
        return failed[0].code
    return Exit.OK if config.dry_run else None
