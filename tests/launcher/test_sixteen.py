"""Jobs of 16 workers on one machine (long tier, each ~15-20 GB: run them alone): `ps` with
16 workers and 4 ps, `ps-sync` with 8 workers and 2 ps, `multiworker` with 16 workers, each
host a small CPU budget, one worker killed (under `ps` restarted; under `ps-sync` K = 7 of 8
goes on without it; under `multiworker` the job relaunched from its checkpoint); every step
trained and nothing left behind: no process, cgroup, network namespace or temporary file."""

import glob
import json
import os

import pytest

from tfdist.launcher.machine import cgroups, hostcpus, network

HOSTS_PROBLEM = network.hosts_problem()
CGROUP_PROBLEM = hostcpus.cgroups_problem()
STEPS = 200


# A ps job's hosts: the chief and the ps tasks on one, the workers spread over four.
# A host per worker would leave the chief and every ps a seventeenth of the machine:
# their start-up alone (TensorFlow's import, ~10 CPU-seconds each) would take
# minutes. Four workers share a host here, each host 0.4 cores.
HOSTS = 5


def _budget(hosts: int) -> str:
    """The machine's cores shared out over ``hosts``, rounded down to a hundredth."""
    return str(int((os.cpu_count() or 1) / hosts * 100) / 100)


def _check_outcome(model_dir: str, members: int, hosts: int, restarts: int,
                   relaunches: int) -> dict:
    with open(os.path.join(model_dir, "launch", "outcome.json")) as f:
        outcome = json.load(f)
    assert outcome["exit_code"] == 0 and outcome["task_restarts"] == restarts
    assert outcome["job_relaunches"] == relaunches
    assert len(outcome["host_cpus"]) == hosts
    assert all(h["cpu_seconds"] > 0 for h in outcome["host_cpus"].values())
    assert len(outcome["peak_rss_bytes"]) == members
    assert outcome["first_step_seconds"] > 0 and outcome["launcher_cpu_seconds"] > 0
    assert outcome["job_seconds"] > outcome["first_step_seconds"]
    for root in (cgroups.cpu_cgroup_root(), cgroups.cgroup_root("cpuacct")):
        assert glob.glob(os.path.join(root, f"{cgroups.CGROUP_PREFIX}*-host*")) == []
    return outcome


def _left_behind(scratch: str) -> list[str]:
    """What the job left: any live process started under ``scratch`` (the job's
    TMPDIR, in every descendant's environment: members, and the sleepers that hold
    the simulated hosts' network namespaces, so a namespace outlives its job only
    through one of these), and any file in it (checkpoint scratch, TensorFlow's)."""
    from tfdist.linux import live_processes

    marker = scratch.encode()
    alive = [f"{pid}: {cmd}" for pid, cmd, env in live_processes(environ=True)
             if env and any(marker in entry for entry in env)]
    return alive + [os.path.join(scratch, n) for n in os.listdir(scratch)]


# How the killed worker is recovered: the launcher flags (train.py's after "--").
RECOVERY = {
    # --restart-tasks: the same worker restarted, its peers training on.
    "task": (["--restart-tasks", "--restart-delay", "1"], []),
    # --max-restarts: every member stopped, the job relaunched from the chief's
    # checkpoint (all-reduce cannot go on without a member).
    "job": (["--max-restarts", "1", "--restart-delay", "1"], ["--checkpoint-every", "50"]),
    # Neither: the others go on without it (ps-sync's K of N).
    None: ([], []),
}


def _run(tmp_path, spawn, strategy: str, workers: int, ps: int, hosts: int,
         recovery: str | None, extra=()) -> tuple[dict, dict]:
    from conftest import child_env, descendants_alive, launch_cmd, read_results

    model_dir = str(tmp_path / strategy)
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    launch_flags, train_flags = RECOVERY[recovery]
    p = spawn(launch_cmd(strategy, "--workers", str(workers), "--ps", str(ps), "--hosts",
                         str(hosts), "--host-cpus", _budget(hosts), "--timeout", "780",
                         "--grace", "3", "--kill", "worker:5@step=60", *launch_flags,
                         train_args=["--model", "logreg", "--steps", str(STEPS), "--log-every",
                                     "50", "--startup-timeout", "600", *train_flags, *extra,
                                     "--model-dir", model_dir]),
              env=child_env(TMPDIR=str(scratch)))
    assert p.wait(820) == 0, p.output
    assert any(l.startswith("[launch] fault --kill worker:5@step=60") for l in p.lines), p.output
    restarted = any(l.startswith("[launch] restarted worker:5 (pid ") for l in p.lines)
    relaunched = any(l.startswith("[launch] relaunching the job") for l in p.lines)
    assert (restarted, relaunched) == (recovery == "task", recovery == "job"), p.output
    r = read_results(model_dir)
    assert r["completed_steps"] == STEPS and r["num_workers"] == workers and r["num_ps"] == ps
    members = workers + ps + (1 if ps else 0)  # a ps job's chief is a member of its own
    outcome = _check_outcome(model_dir, members, hosts, int(recovery == "task"),
                             int(recovery == "job"))
    assert descendants_alive(model_dir) == []
    assert _left_behind(str(scratch)) == []
    return r, outcome


def _big_job(test):
    """The marks every job of this file carries: long tier, real processes, simulated hosts
    with CPU budgets (skipped, with the reason, where the machine has neither)."""
    for mark in (pytest.mark.timeout(870),
                 pytest.mark.skipif(CGROUP_PROBLEM is not None,
                                    reason=f"no CPU cgroups here: {CGROUP_PROBLEM}"),
                 pytest.mark.skipif(HOSTS_PROBLEM is not None,
                                    reason=f"no simulated hosts here: {HOSTS_PROBLEM}"),
                 pytest.mark.multiprocess, pytest.mark.long):
        test = mark(test)
    return test


@_big_job
def test_ps_with_16_workers_and_4_ps_survives_a_killed_worker(tmp_path, spawn):
    r, _ = _run(tmp_path, spawn, "ps", 16, 4, HOSTS, recovery="task")
    # The coordinator gave the restarted worker work again, and every worker some.
    assert len(r["steps_per_worker"]) == 16 and all(v > 0 for v in r["steps_per_worker"].values())


@_big_job
def test_ps_sync_with_8_workers_and_2_ps_survives_a_killed_worker(tmp_path, spawn):
    r, _ = _run(tmp_path, spawn, "ps-sync", 8, 2, HOSTS, recovery=None,
                extra=["--replicas-to-aggregate", "7"])
    # K = 7 of 8: each update took 7 gradients, the killed worker's gap covered by the rest.
    assert r["aggregated_gradients"] == 7 * STEPS


@_big_job
def test_multiworker_with_16_workers_survives_a_killed_worker(tmp_path, spawn):
    # A host per worker, each a sixteenth of the machine: every member computes.
    r, _ = _run(tmp_path, spawn, "multiworker", 16, 0, 16, recovery="job")
    # The relaunch resumed from the last checkpoint before the kill (every 50
    # steps; all-reduce holds the others within a step of the killed worker).
    assert r["replicas_in_sync"] == 16 and r["resumed_from_step"] in (50, 100)
    assert r["steps_this_run"] == STEPS - r["resumed_from_step"]
