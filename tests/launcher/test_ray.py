"""The Ray tier (``make test-ray``): jobs of ``tfdist-launch --engine ray`` on a real
multi-node Ray cluster.

The cluster (``raycluster.py``): ``ray start --head`` on 127.0.0.3 and a second
node on 127.0.0.2, each its own ``ray start`` process group with its own temp
dir. Tasks land on both nodes (each task's TF_CONFIG address is its node's);
a worker's actor killed with ``ray.kill`` is replaced at the same address (ps);
a whole node killed mid-run ends the attempt and ``--max-restarts`` relaunches
the job on the node left, from its checkpoint; a ps worker's node killed (chief and
ps on the head, ``--ray-placement spread-workers``) and the job ends exact on the
worker left. Nothing is left behind: no
raylet, GCS, actor or task process, no temp dir.
"""

from __future__ import annotations

import glob
import json
import os
import re
import shutil
import signal
import tempfile
import time

import pytest
from conftest import REPO, child_env, descendants_alive, launch_cmd, read_results

from tfdist import protocol

pytest.importorskip("ray", reason="Ray (the [ray] or [dev] extra) is not installed")
from raycluster import ENV, HEAD_IP, RayCluster  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.multiprocess]


@pytest.fixture(autouse=True)
def no_scratch_left():
    """Each job's temporary files (its tasks' TMPDIR) are gone when it ends, a killed
    actor's and a lost node's included (the nodes here share this host's /tmp)."""
    # A multiworker worker's private checkpoints and the preemption counter were
    # left in /tmp before the tasks had a TMPDIR of the job's.
    patterns = [os.path.join(tempfile.gettempdir(), p)
                for p in ("tfdist-ray-*", "ckpt-*", "preemption-*")]

    def present():
        return {path for pattern in patterns for path in glob.glob(pattern)}

    before = present()
    yield
    # /tmp is the machine's: another developer's job may hold a directory of these names
    # for a moment; one of this job's would stay.
    deadline = time.monotonic() + 15
    while (left := present() - before) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert sorted(left) == []

LOGREG = ["--model", "logreg"]  # unless the test gives its own --task
JOB_TIMEOUT = 240


@pytest.fixture(scope="module")
def cluster():
    yield from _running(RayCluster(), head_cpus=4, nodes=[("127.0.0.2", 3)])


def _running(c, head_cpus: int, nodes):
    """``c`` started (a head, then each (address, CPUs) node), yielded, then closed:
    nothing of it may be left behind."""
    try:
        c.start_head(num_cpus=head_cpus)
        for address, cpus in nodes:
            c.add_node(address, num_cpus=cpus)
        yield c
    finally:
        c.close()
    assert c.leftovers() == [], "Ray processes left behind"
    assert not os.path.exists(c.root)


def _launch(spawn, strategy, model_dir, *launch_args, train_args=(), address=None, **env):
    cmd = launch_cmd(strategy, "--engine", "ray", *(("--address", address) if address else ()),
                     *launch_args, train_args=[*([] if "--task" in train_args else LOGREG),
                                               "--log-every", "50", *train_args,
                                               "--model-dir", str(model_dir)])
    return spawn(cmd, child_env(**ENV, **env))


def _placement(model_dir) -> list[dict]:
    with open(os.path.join(model_dir, "launch", "ray.json")) as f:
        return json.load(f)["attempts"]


def _tf_config(model_dir, member) -> dict:
    with open(os.path.join(model_dir, "launch", f"{member.replace(':', '-')}.tf_config.json")) as f:
        return json.load(f)


def _node_ips(cluster) -> set[str]:
    return {n.ip for n in cluster.nodes}


def test_ps_sharded_over_two_ps_across_two_nodes(cluster, spawn, tmp_path):
    model_dir = tmp_path / "ps"
    p = _launch(spawn, "ps", model_dir, "--workers", "2", "--ps", "2",
                train_args=["--steps", "200", "--variable-partitioner", "fixed"],
                address=cluster.address)
    assert p.wait(JOB_TIMEOUT) == 0, p.output
    results = read_results(model_dir)
    assert results["global_steps"] == 200 and results["num_ps"] == 2
    assert sum(results["steps_per_worker"].values()) == 200
    assert results["test_accuracy"] > 0.85
    placed = _placement(model_dir)[0]
    assert len({t["node_id"] for t in placed.values()}) == 2, placed  # tasks on both nodes
    for member, where in placed.items():  # each TF_CONFIG names the task's own node and port
        assert where["address"].split(":")[0] in _node_ips(cluster)
        role, _, i = member.partition(":")
        assert _tf_config(model_dir, member)["cluster"][role][int(i)] == where["address"]
    assert any(line.startswith("[worker:1] ") for line in p.lines)
    assert "[launch] ray: the Ray cluster at" in p.output and "2 node(s)" in p.output
    assert descendants_alive(str(model_dir)) == []


@pytest.mark.parametrize("strategy, extra", [
    ("multiworker", ["--steps", "150"]),
    ("ps-sync", ["--task", str(REPO / "examples" / "custom_task.py"), "--steps", "150"]),
])
def test_sync_strategies_and_a_user_task(cluster, spawn, tmp_path, strategy, extra):
    model_dir = tmp_path / strategy
    p = _launch(spawn, strategy, model_dir, "--workers", "2",
                *(("--ps", "1") if strategy == "ps-sync" else ()), "--ray-placement",
                "strict-spread" if strategy == "multiworker" else "spread",
                train_args=extra, address=cluster.address)
    assert p.wait(JOB_TIMEOUT) == 0, p.output
    results = read_results(model_dir)
    assert results["global_steps"] == int(extra[-1]) and results["strategy"] == strategy
    assert results["test_accuracy"] > (0.85 if strategy == "multiworker" else 0.80)
    if strategy == "multiworker":  # strict-spread: one worker per node
        placed = _placement(model_dir)[0]
        assert len({t["node_id"] for t in placed.values()}) == 2
    assert os.path.exists(model_dir / "model.keras")
    assert descendants_alive(str(model_dir)) == []


def test_lacking_resources_is_one_line_exit_2(cluster, spawn, tmp_path):
    started = time.monotonic()
    p = _launch(spawn, "ps", tmp_path / "big", "--workers", "8", "--ps", "1",
                train_args=["--steps", "5"], address=cluster.address)
    assert p.wait(120) == 2, p.output
    errors = [line for line in p.lines if line.startswith("error:")]
    assert errors == ["error: --engine ray needs 10 CPU bundles (10 CPU, one bundle per task), "
                      "the cluster has 7; add nodes or run fewer tasks"], p.output
    p = _launch(spawn, "multiworker", tmp_path / "spread", "--workers", "3", "--ray-placement",
                "strict-spread", train_args=["--steps", "5"], address=cluster.address)
    assert p.wait(120) == 2, p.output
    assert [line for line in p.lines if line.startswith("error:")] == [
        "error: --ray-placement strict-spread needs 3 nodes (one per task), the cluster has 2; "
        "use --ray-placement spread or pack, or add nodes"], p.output
    assert time.monotonic() - started < 120


def test_ps_worker_actor_killed_is_replaced_at_its_address(cluster, spawn, tmp_path):
    model_dir = tmp_path / "kill"
    # The replacement must come while the job still runs: with 200 steps the worker left
    # finished the other 150 in under 4.4 s on an idle host, before the 2 s restart delay
    # and a new actor's start. 1,000 steps and no delay leave it about 20 s.
    steps = 1000
    p = _launch(spawn, "ps", model_dir, "--workers", "2", "--ps", "1", "--restart-tasks",
                "--restart-delay", "0", "--kill", "worker:1@step=50",
                train_args=["--steps", str(steps), "--log-every", "200"], address=cluster.address)
    assert p.wait(JOB_TIMEOUT) == 0, p.output
    assert re.search(r"\[launch\] worker:1: its Ray actor killed \(ray.kill\)", p.output), p.output
    assert re.search(r"\[launch\] worker:1: a new Ray actor on node \w+, same address", p.output), p.output
    results = read_results(model_dir)
    # The library's own accounting, exact: every requested step scheduled once; the lost
    # worker's in-flight call, run again elsewhere, shows as re-executed.
    # (the contract of tests/launcher/test_tf_fault_scenarios.py, one kill, one step a call)
    assert results["scheduled_steps"] == results["completed_steps"] == steps
    assert results["applied_steps"] == results["global_steps"] == steps + results["reexecuted_steps"]
    assert 0 <= results["reexecuted_steps"] <= 1
    assert steps <= sum(results["steps_per_worker"].values()) <= steps + 1
    with open(model_dir / "launch" / "outcome.json") as f:
        outcome = json.load(f)
    assert outcome["restarts_per_task"] == {"worker:1": 1} and outcome["job_relaunches"] == 0
    assert descendants_alive(str(model_dir)) == []


def test_node_of_a_ps_worker_lost_the_job_ends_exact(cluster, spawn, tmp_path):
    """The node hosting a ps worker (not the head, which holds chief and ps with
    ``--ray-placement spread-workers``) lost mid-run, with ``--restart-tasks``: Ray places the
    replacement's bundle on a node left, which is not the address every TF_CONFIG names for
    that worker (ps has a fixed cluster), so the launcher says so in one line and does not
    start it there; the coordinator gives the lost worker's steps to the workers left and the
    job ends with the library's exact accounting, nothing left behind."""
    extra = cluster.add_node(cluster.next_ip(), num_cpus=1)  # three nodes: the workers apart
    model_dir = tmp_path / "psnode"
    steps = 1000  # a long run: the kill (on a relayed step line) lands well before its end
    p = _launch(spawn, "ps", model_dir, "--workers", "2", "--ps", "1", "--restart-tasks",
                "--ray-placement", "spread-workers",
                train_args=["--steps", str(steps), "--log-every", "50"], address=cluster.address)
    p.wait_for_line(r"\[chief:0\] step [1-4]\d\d/", JOB_TIMEOUT)
    placed = _placement(model_dir)[0]
    ip = {t: w["address"].split(":")[0] for t, w in placed.items()}
    assert ip["chief:0"] == ip["ps:0"] == HEAD_IP, placed  # spread-workers: on the head
    lost = next(t for t in ("worker:1", "worker:0") if ip[t] != HEAD_IP)
    victim = next(n for n in cluster.nodes if n.ip == ip[lost] and n.alive)
    survivors = [t for t in ("worker:0", "worker:1") if ip[t] != victim.ip]
    assert survivors, f"both workers on {victim.ip}: {placed}"
    assert p.proc.poll() is None, p.output  # mid-run
    killed_at = time.time()
    victim.kill()
    assert p.wait(JOB_TIMEOUT) == 0, p.output
    assert re.search(rf"\[launch\] {lost}: its Ray actor is gone", p.output), p.output
    assert re.search(rf"\[launch\] {lost}: cannot replace its actor at {ip[lost]}:\d+: ",
                     p.output), p.output
    results = read_results(model_dir)
    # The library's exact accounting (tests/launcher/test_tf_fault_scenarios.py): every
    # step scheduled once; the lost worker's in-flight call, if any, re-executed elsewhere.
    assert results["scheduled_steps"] == results["completed_steps"] == steps, results
    assert results["applied_steps"] == results["global_steps"] == steps + results["reexecuted_steps"]
    assert 0 <= results["reexecuted_steps"] <= 1
    per = results["steps_per_worker"]
    assert steps <= sum(per.values()) <= steps + 1 and per[lost] < steps // 2, per
    chief = protocol.read_all_events(protocol.events_path(str(model_dir / "launch"), "chief:0"))
    after = [e.time for e in chief if e.kind == protocol.PROGRESS and e.time > killed_at]
    done = [e.time for e in chief if e.kind == protocol.DONE]
    print(f"\nnode loss (ps): {lost} on {victim.ip} lost; first progress report after the "
          f"kill {after[0] - killed_at:.1f}s after it, the job done {done[-1] - killed_at:.1f}s "
          f"after it; steps per worker {per}\n"
          + "\n".join(line for line in p.lines if line.startswith("[launch]")))
    assert descendants_alive(str(model_dir)) == []
    assert [line for line in cluster.leftovers() if victim.temp_dir in line] == []
    assert extra.alive or extra is victim


def test_node_lost_mid_run_multiworker_relaunches_from_checkpoint(cluster, spawn, tmp_path):
    """A whole node lost mid-run: the attempt ends, --max-restarts relaunches the job on the
    node left, from its last checkpoint.

    Mid-run for sure, however fast or loaded the host: worker:1 is stopped (``--hang``,
    SIGSTOP) at step 110, so the job, synchronous, cannot run on, and the node is killed
    only then. (Killing it on seeing a step line raced the job's end: 400 logreg steps
    take ~3 s, and on a loaded host the relayed line could come after the job was done,
    so no relaunch ever came.) The stopped task dies with its node, or, were it on the
    node left, the launcher continues it before stopping it (``Supervisor.lift_all``).
    """
    model_dir = tmp_path / "node"
    p = _launch(spawn, "multiworker", model_dir, "--workers", "2", "--max-restarts", "2",
                "--restart-delay", "1", "--hang", "worker:1@step=110",
                train_args=["--steps", "400", "--checkpoint-every", "100", "--log-every", "10"],
                address=cluster.address)
    fired = p.wait_for_line(r"\[launch\] fault --hang worker:1@step=110: sent SIGSTOP", JOB_TIMEOUT)
    at_step = int(re.search(r"step (\d+)", fired.split("@step=110")[1]).group(1))
    assert 110 <= at_step < 200, fired  # stopped between the checkpoints at 100 and 200
    placed = _placement(model_dir)[0]
    victim = cluster.victim()
    assert victim.ip in {w["address"].split(":")[0] for w in placed.values()}, placed
    assert p.proc.poll() is None, p.output  # the job is still on: the kill lands mid-run
    killed_at = time.time()
    victim.kill()  # raylet, agents, actors: the node is gone
    p.wait_for_line(r"relaunching the job \(1 of --max-restarts=2\)", 120)
    relaunched_at = time.time()
    assert p.wait(JOB_TIMEOUT) == 0, p.output
    # Recovery: from the kill to the relaunched job's first step (its STARTED event).
    started = [e.time for e in protocol.read_all_events(
        protocol.events_path(str(model_dir / "launch"), "worker:0"))
        if e.kind == protocol.STARTED and e.time > killed_at]
    assert started, p.output
    print(f"\nnode loss (multiworker): relaunch decided {relaunched_at - killed_at:.1f}s after "
          f"the kill, first step of the relaunched job {started[0] - killed_at:.1f}s after it\n"
          + "\n".join(line for line in p.lines if line.startswith("[launch]")))
    results = read_results(model_dir)
    assert results["global_steps"] == 400 and results["resumed_from_step"] == 100, results
    attempts = _placement(model_dir)
    assert len(attempts) >= 2
    assert {w["address"].split(":")[0] for w in attempts[-1].values()} == {HEAD_IP}
    assert descendants_alive(str(model_dir)) == []
    assert not victim.alive and [line for line in cluster.leftovers() if victim.temp_dir in line] == []


def test_local_instance_started_and_stopped(spawn, tmp_path):
    """Without --address: a local Ray instance for the job, stopped after (nothing left).

    Ray keeps each instance's session (its logs and sockets) under $RAY_TMPDIR/ray,
    /tmp/ray by default, after the instance stops: here a short directory of the
    test's own (Ray's socket paths must stay under 108 bytes), removed after."""
    model_dir = tmp_path / "local"
    ray_tmp = tempfile.mkdtemp(prefix="tfdist-raytmp-")
    try:
        p = _launch(spawn, "ps", model_dir, "--workers", "2", "--ps", "1",
                    train_args=["--steps", "60"], RAY_TMPDIR=ray_tmp)
        assert p.wait(JOB_TIMEOUT) == 0, p.output
        assert "[launch] ray: a local Ray instance (num_cpus=4)" in p.output
        assert read_results(model_dir)["global_steps"] == 60
        # The instance was this job's: its session is under the test's directory.
        assert [d for d in os.listdir(os.path.join(ray_tmp, "ray"))
                if d.startswith("session_2")] != []
        deadline = time.monotonic() + 20
        while (left := descendants_alive(ray_tmp)) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert left == []
        assert descendants_alive(str(model_dir)) == []
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)


@pytest.fixture
def one_cpu_nodes():
    """A cluster of its own, beside the module's (its own addresses and worker ports):
    a head and one node of one CPU each, so each holds one worker and a lost node is a
    lost worker's room."""
    yield from _running(RayCluster(head_ip="127.0.0.21", port_base=10000), head_cpus=1,
                        nodes=[("127.0.0.22", 1)])


def _pending_sigterm(pid: int) -> bool:
    with open(f"/proc/{pid}/status") as f:
        masks = {k: v.strip() for k, _, v in (line.partition(":") for line in f)}
    return any(int(masks.get(k, "0"), 16) & (1 << (signal.SIGTERM - 1)) for k in ("ShdPnd", "SigPnd"))


def test_elastic_node_lost_goes_on_smaller_then_grows_back_on_a_new_node(one_cpu_nodes, spawn,
                                                                           tmp_path):
    """--min-workers 1, two workers on two one-CPU nodes: the node of one is killed mid-run;
    the job goes on with one worker on the node left, from its checkpoint, without waiting
    for a replacement; a node started later is used from the next checkpoint (the launcher
    preempts the job: every worker saves at one step) and the job ends at two workers, its
    steps exact. Mid-run for sure: worker:1 is held (``--hang``) at step 110 until the node
    is killed, and worker:0, alone, at step 250 until the new node has joined; the test
    continues it once the launcher's notice (SIGTERM) is pending, so it saves and stops."""
    c, steps = one_cpu_nodes, 400
    model_dir = tmp_path / "elastic"
    p = _launch(spawn, "multiworker", model_dir, "--workers", "2", "--min-workers", "1",
                "--rejoin-timeout", "60", "--hang", "worker:1@step=110",
                "--hang", "worker:0@step=250",
                train_args=["--steps", str(steps), "--checkpoint-every", "100",
                            "--log-every", "10"], address=c.address)
    p.wait_for_line(r"\[launch\] fault --hang worker:1@step=110: sent SIGSTOP", JOB_TIMEOUT)
    placed = _placement(model_dir)[0]
    victim = c.nodes[1]
    assert {w["address"].split(":")[0] for w in placed.values()} == {c.head_ip, victim.ip}, placed
    assert p.proc.poll() is None, p.output
    killed_at = time.time()
    victim.kill()
    p.wait_for_line(r"lost \(its Ray node \w+ gone\): continuing with 1 worker from step 100",
                    JOB_TIMEOUT)
    p.wait_for_line(r"\[launch\] fault --hang worker:0@step=250: sent SIGSTOP", JOB_TIMEOUT)
    assert p.proc.poll() is None, p.output
    new = c.add_node(c.next_ip(), num_cpus=1)
    joined_at = time.time()
    p.wait_for_line(r"the live Ray nodes hold 2 workers again; SIGTERM to worker:0", 120)
    events = protocol.read_all_events(protocol.events_path(str(model_dir / "launch"), "worker:0"))
    pid = [e.data["pid"] for e in events if e.kind == protocol.STARTED][-1]
    deadline = time.monotonic() + 60
    while not _pending_sigterm(pid):
        assert time.monotonic() < deadline, "the launcher's SIGTERM never reached worker:0"
        time.sleep(0.1)
    os.killpg(pid, signal.SIGCONT)
    assert p.wait(JOB_TIMEOUT) == 0, p.output

    results = read_results(model_dir)
    assert results["global_steps"] == steps, results
    membership = results["membership"]
    assert [(m["workers"], m["step"]) for m in membership][:2] == [(2, 0), (1, 100)], membership
    assert len(membership) == 3 and membership[2]["workers"] == 2, membership
    assert 250 <= membership[2]["step"] < steps, membership
    assert "worker:1 back (a Ray node joined" in membership[2]["why"], membership
    with open(model_dir / "launch" / "outcome.json") as f:
        outcome = json.load(f)
    assert [m["workers"] for m in outcome["membership"]] == [2, 1, 2]
    assert outcome["job_relaunches"] == 0
    attempts = _placement(model_dir)
    assert [len(a) for a in attempts] == [2, 1, 2], attempts
    assert {w["address"].split(":")[0] for w in attempts[1].values()} == {c.head_ip}
    assert {w["address"].split(":")[0] for w in attempts[2].values()} == {c.head_ip, new.ip}
    events = protocol.read_all_events(protocol.events_path(str(model_dir / "launch"), "worker:0"))
    started = sorted(e.time for e in events if e.kind == protocol.STARTED)
    smaller = next(t for t in started if t > killed_at)
    full = next(t for t in started if t > joined_at)
    redone = outcome["membership"][1].get("steps_redone_at_least")
    print(f"\nelastic (ray, multiworker 2 -> 1 -> 2): first step at 1 worker "
          f"{smaller - killed_at:.1f}s after the node was killed; first step at 2 workers "
          f"{full - joined_at:.1f}s after the new node joined (the test's hold at step 250 "
          f"released as soon as the launcher's SIGTERM was pending); outcome.json: "
          f"{[m.get('first_step_after_seconds') for m in outcome['membership']]} s from each "
          f"change's decision; steps redone after the loss: {redone}; test accuracy "
          f"{results['test_accuracy']:.4f}; load {os.getloadavg()[0]:.1f}\n" + "\n".join(
              line for line in p.lines if line.startswith("[launch]")))
    assert descendants_alive(str(model_dir)) == []
    assert [line for line in c.leftovers() if victim.temp_dir in line] == []


def test_elastic_node_lost_below_min_workers_stops_in_one_line(one_cpu_nodes, spawn, tmp_path):
    """--min-workers 2 of 2: the node of one worker lost, the live nodes hold one worker:
    the job stops, exit 75, in one line, without relaunching; nothing left behind."""
    c = one_cpu_nodes
    model_dir = tmp_path / "below"
    p = _launch(spawn, "multiworker", model_dir, "--workers", "2", "--min-workers", "2",
                "--rejoin-timeout", "60", "--hang", "worker:1@step=110",
                train_args=["--steps", "400", "--checkpoint-every", "100", "--log-every", "10"],
                address=c.address)
    p.wait_for_line(r"\[launch\] fault --hang worker:1@step=110: sent SIGSTOP", JOB_TIMEOUT)
    assert p.proc.poll() is None, p.output
    c.nodes[1].kill()
    assert p.wait(JOB_TIMEOUT) == 75, p.output
    stops = [line for line in p.lines if "below --min-workers" in line]
    assert len(stops) == 1 and re.search(
        r"^\[launch\] worker:[01] lost \(its Ray node \w+ gone\): the live Ray nodes hold 1 "
        r"worker, below --min-workers=2; stopping \(exit 75\)", stops[0]), p.output
    assert len(_placement(model_dir)) == 1  # never placed again
    with open(model_dir / "launch" / "outcome.json") as f:
        assert [m["workers"] for m in json.load(f)["membership"]] == [2]
    assert descendants_alive(str(model_dir)) == []
