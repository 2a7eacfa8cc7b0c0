"""The launch directory's files: one TF_CONFIG per member, ``commands.sh``, ``hosts.json``,
the members' event files; never written through a symbolic link."""

from __future__ import annotations

import json
import os

from tfdist import protocol
from tfdist.launcher import plan as plans
from tfdist.launcher.plan import LaunchError


def check_launch_dir(launch_dir: str) -> None:
    """Refuse a ``launch/`` (or its ``events/``) that is a symlink: we never write through one."""
    for path in (launch_dir, os.path.join(launch_dir, "events")):
        if os.path.islink(path):
            raise LaunchError(
                f"{path} is a symbolic link; the launcher writes its files there and does not "
                "follow links: remove it, or pass another --model-dir")


def write_file(path: str, text: str) -> None:
    # Written beside and renamed over: a symlink planted at ``path`` is
    # replaced, never followed.
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        os.unlink(tmp)
    except FileNotFoundError:
        pass
    with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644), "w") as f:
        f.write(text)
    os.replace(tmp, path)


def save_launch_files(launch_dir: str, plan, command: list[str]) -> None:
    """One TF_CONFIG file per task, ``commands.sh`` replaying each task (and
    naming its host), ``hosts.json`` under simulated hosts, and an empty
    progress-event file per task (this launch's events only)."""
    if not isinstance(plan, plans.ClusterPlan):
        plan = plans.ClusterPlan(plan)
    check_launch_dir(launch_dir)
    os.makedirs(os.path.join(launch_dir, "events"), exist_ok=True)
    for name in plan.tf_configs:
        write_file(protocol.events_path(launch_dir, name), "")
    for name, tf_config in plan.tf_configs.items():
        if tf_config is None:
            continue
        write_file(os.path.join(launch_dir, plans.tf_config_file(name)),
                    json.dumps(tf_config) + "\n")
    if plan.hosts:
        hosts = {f"host{i}": {"address": plans.host_address(i),
                              "tasks": [n for n, h in plan.host_of.items() if h == i]}
                 for i in range(plan.hosts)}
        protocol.write_json_atomic(os.path.join(launch_dir, "hosts.json"), hosts)
    write_file(os.path.join(launch_dir, "commands.sh"),
                plans.commands_script(plan, command, launch_dir))
