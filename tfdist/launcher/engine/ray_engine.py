"""``--engine ray``: the job's tasks as Ray actors, on a running Ray cluster or a local instance.

Each TF task (chief, workers, ps) is one actor, placed through one placement
group (one bundle per task, ``--ray-placement``). Each actor binds its own
gRPC port (held with ``SO_REUSEPORT``, which TensorFlow's gRPC server also
sets, so the task's server binds the same port while nobody else can) and
reports its node's address; the driver then builds every task's TF_CONFIG
exactly as the local launcher writes them (``plan.tf_configs_at``). Each
actor runs the same ``tfdist.cli.train`` command as a child process and
streams its output lines back (printed with ``[worker:1]`` prefixes) and
then its exit code. ``RayEngine`` implements the engine contract
(``launcher.engine.api.Engine``), so supervision, fault injection, member
restarts and ``--max-restarts`` relaunches are the attempt loop's, as for the
local engine (``launcher.attempts``): a member here is a :class:`RayProc`, a
Popen-like handle on the actor's child. A relaunch places every task anew (a lost
node's tasks land on the nodes left); a restarted task (``--restart-tasks``)
is a new actor in the same bundle, on the same node and port, so its
TF_CONFIG is unchanged.

Ray is imported here only, and only when ``--engine ray`` runs.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

from tfdist import protocol
from tfdist.launcher import files
from tfdist.launcher import plan as plans
from tfdist.launcher.config import ENGINES, LaunchConfig, LaunchRequest
from tfdist.launcher.engine.api import SINK_LOCK, Engine, Formation, MemberProcess, Placement
from tfdist.launcher.engine.local import child_setup, member_command, stop_members, wait_all
from tfdist.launcher.membership import ElasticPlan, Membership, workers_text
from tfdist.launcher.plan import LaunchError
from tfdist.launcher.state import JobState, SignalMember
from tfdist.protocol import Exit

INSTALL_HINT = "pip install 'tf-distribute-showcase[ray]'"
# --ray-placement -> Ray's placement-group strategy.
# spread-workers: SPREAD, with the tasks the job cannot lose without a relaunch (ps, a
# coordinating chief: the roles that compute nothing) pinned to the head node, which the
# cluster cannot lose anyway; only workers then sit on the nodes that may go.
PLACEMENTS = {"spread": "SPREAD", "strict-spread": "STRICT_SPREAD", "pack": "PACK",
              "spread-workers": "SPREAD"}
HEAD_PINNED = ("spread-workers",)
# Ray's own marker resource of the head node (1 on it, absent elsewhere): a bundle asking
# for a sliver of it can only be placed there.
HEAD_RESOURCE = "node:__internal_head__"
CPUS_PER_MEMBER = 1  # each task's bundle; a worker also asks for one GPU when the cluster has GPUs
# How long the job may wait for its placement group and actors before it is refused.
STARTUP_TIMEOUT = 60.0
LOST = -signal.SIGKILL  # an actor that died: to the supervisor, a task killed outright


def check_request(request: LaunchRequest) -> None:
    """The engine flags, and what the Ray engine cannot honour, refused in one line (pure)."""
    cluster, faults = request.cluster, request.faults
    if cluster.engine not in ENGINES:
        raise LaunchError(f"--engine {cluster.engine!r} is not known; use one of "
                          f"{', '.join(ENGINES)}")
    if cluster.ray_placement not in PLACEMENTS:
        raise LaunchError(f"--ray-placement {cluster.ray_placement!r} is not known; use one of "
                          f"{', '.join(PLACEMENTS)}")
    if cluster.engine != "ray":
        if cluster.address is not None:
            raise LaunchError(f"--address {cluster.address} names a Ray cluster; add --engine ray, "
                              "or drop --address")
        if cluster.ray_placement != "spread":
            raise LaunchError(f"--ray-placement {cluster.ray_placement} places Ray actors; add "
                              "--engine ray, or drop it")
        return
    refused = [
        ("--hosts", cluster.hosts, "Ray places the tasks on its own nodes"),
        ("--link-rate", cluster.link_rate, "the links are the cluster's own"),
        ("--link-trace", cluster.link_trace or None, "the links are the cluster's own"),
        ("--host", cluster.host if cluster.host != "localhost" else None,
         "each task's address is its Ray node's"),
        ("--slow", faults.slow, "slow-downs use this host's cgroups"),
        ("--partition", faults.partition, "partitions cut simulated hosts' links"),
        ("--memory-limit", faults.memory_limit, "memory cgroups are this host's"),
        ("--host-cpus", cluster.host_cpus, "CPU cgroups are this host's"),
        ("--netns on", cluster.netns == "on" or None, "Ray's nodes must reach each other"),
        ("--dry-run", request.dry_run or None, "addresses are known once the actors are placed"),
        ("--evaluator", cluster.evaluator or None,
         "each actor's TF_CONFIG is made from the placed addresses, with no member outside "
         "the training cluster"),
    ]
    for flag, value, why in refused:
        if value:
            raise LaunchError(f"{flag} does not apply with --engine ray ({why}); drop it, or use "
                              "--engine local")


def import_ray():
    try:
        import ray
    except ImportError:
        raise LaunchError(f"--engine ray needs Ray, which is not installed here; install it: "
                          f"{INSTALL_HINT}") from None
    return ray


def bundles_for(kind, names: list[str], gpus: float, pin_head: bool = False
                ) -> list[dict[str, float]]:
    """One bundle per task (pure): a CPU each; each computing task a GPU when the cluster
    has any (ps tasks and a coordinating chief stay CPU-only); with ``pin_head`` the tasks
    that compute nothing on the head node."""
    out = []
    for name in names:
        bundle = {"CPU": float(CPUS_PER_MEMBER)}
        computes = name.partition(":")[0] in kind.computing_roles
        if gpus >= 1 and computes:
            bundle["GPU"] = 1.0
        if pin_head and not computes:
            bundle[HEAD_RESOURCE] = 0.001
        out.append(bundle)
    return out


def shortage(bundles: list[dict[str, float]], resources: dict, nodes: int, placement: str,
             what: str = "the cluster has") -> str | None:
    """What the cluster lacks for these bundles, in one line, or ``None`` (pure).

    ``resources``: Ray's total (or available) resources; ``nodes``: alive nodes.
    """
    for key, unit in (("CPU", "CPU"), ("GPU", "GPU")):
        need = [b[key] for b in bundles if key in b]
        have = float(resources.get(key, 0.0))
        if need and sum(need) > have:
            return (f"--engine ray needs {len(need)} {unit} bundles ({sum(need):g} {unit}, "
                    f"one bundle per task), {what} {have:g}; add nodes or run fewer tasks")
    if placement == "strict-spread" and len(bundles) > nodes:
        return (f"--ray-placement strict-spread needs {len(bundles)} nodes (one per task), the "
                f"cluster has {nodes}; use --ray-placement spread or pack, or add nodes")
    return None


def node_shares(kind, node_of: dict[str, str], cpus_of: dict[str, int]
                ) -> dict[str, plans.CoreShare]:
    """Each task's thread pools and cores (pure): every Ray node is a host of its own, its
    tasks sharing its cores exactly as the local launcher shares one machine's
    (``plans.share_cores``: pools sized to a task's share, busy tasks pinned apart)."""
    out: dict[str, plans.CoreShare] = {}
    for node in sorted(set(node_of.values())):
        here = [n for n in node_of if node_of[n] == node]
        out.update(plans.share_cores(kind, here, max(1, cpus_of.get(node, 1))))
    return out


class MemberHost:
    """The Ray actor of one TF task: holds its port, runs its ``train.py``, relays its lines.

    Runs in a Ray worker process on some node (``ray.remote(MemberHost)`` in the
    driver); a threaded actor, so ``signal`` reaches a running ``run``.
    """

    def __init__(self, name: str):
        self.name = name
        self.sock: socket.socket | None = None
        self.proc: subprocess.Popen | None = None

    def reserve(self, port: int = 0) -> dict:
        """Bind the task's gRPC port (0: any free one) and keep it: the node's address and port."""
        import ray

        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        # TensorFlow's gRPC server binds with SO_REUSEPORT too: it can take the
        # port while this socket (bound, not listening) keeps everyone else off it.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        s.bind(("", port))
        self.sock = s
        # The node's address is the driver's to look up (ray.nodes()): the one the
        # node was started with, not whatever this process would guess.
        return {"port": s.getsockname()[1], "node_id": ray.get_runtime_context().get_node_id(),
                "pid": os.getpid(), "cpus": len(os.sched_getaffinity(0))}

    def run(self, argv: list[str], env: dict[str, str], cwd: str, cpus: tuple[int, ...] = ()):
        """Start the task (this node's Python; pinned to ``cpus`` of this node when given),
        then yield ``{"pid": N}``, each output line, and its exit code last."""
        full = {**os.environ, **env}
        if "OMP_NUM_THREADS" not in env:
            full.pop("OMP_NUM_THREADS", None)  # Ray sets it to the actor's CPUs (1)
        scratch = env.get("TMPDIR")
        if scratch:
            os.makedirs(scratch, exist_ok=True)
        self.proc = subprocess.Popen(
            [sys.executable, *argv], env=full, cwd=cwd if os.path.isdir(cwd) else None,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            # Dies with this actor (ray.kill, a lost node): no orphan on the node.
            start_new_session=True,
            preexec_fn=child_setup(Placement(cpus=tuple(cpus))))
        yield {"pid": self.proc.pid}
        for raw in iter(self.proc.stdout.readline, b""):
            yield raw.decode(errors="replace").rstrip("\n")
        self.proc.stdout.close()
        code = self.proc.wait()
        if scratch:
            shutil.rmtree(scratch, ignore_errors=True)
        yield code

    def signal(self, sig: int, group: bool = True) -> None:
        proc = self.proc
        if proc is None or proc.poll() is not None:
            return
        try:
            if group:
                os.killpg(proc.pid, sig)
            else:
                proc.send_signal(sig)
        except (ProcessLookupError, PermissionError):
            pass


class RayProc:
    """A task running in an actor, as the supervisor's ``Popen``: ``pid`` (the child's on its
    node), ``poll``, ``wait``, ``send_signal``, ``signal_group``. SIGKILL is ``ray.kill``:
    the actor is lost, and its child with it."""

    def __init__(self, ray, actor, name: str, log=print):
        self.ray, self.actor, self.name, self.log = ray, actor, name, log
        self.pid: int | None = None
        self.returncode: int | None = None
        self.actor_lost = False
        self.killed = False  # by the launcher (ray.kill): its loss is no news
        self.started = threading.Event()
        self.done = threading.Event()

    def finish(self, code: int) -> None:
        self.returncode = code
        self.started.set()
        self.done.set()

    def poll(self) -> int | None:
        return self.returncode if self.done.is_set() else None

    def wait(self, timeout: float | None = None) -> int:
        if not self.done.wait(timeout):
            raise subprocess.TimeoutExpired(self.name, timeout)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        self._signal(sig, False)

    def signal_group(self, sig: int) -> None:
        self._signal(sig, True)

    def kill(self) -> None:
        self._signal(signal.SIGKILL, True)

    def _signal(self, sig: int, group: bool) -> None:
        if self.done.is_set():
            return
        try:
            if sig == signal.SIGKILL:
                self.actor_lost = self.killed = True
                self.ray.kill(self.actor, no_restart=True)
            else:
                self.actor.signal.remote(int(sig), group)
        except self.ray.exceptions.RayError:  # the actor already gone (its node lost)
            pass


def _pump(proc: RayProc, stream, name: str, keep: list[str], sink=None) -> None:
    """Relay one actor's stream: lines printed with the task's prefix, then its exit code."""
    sink = sink or sys.stdout
    ray = proc.ray
    code = None
    try:
        for ref in stream:
            item = ray.get(ref)
            if isinstance(item, dict):
                proc.pid = item["pid"]
                proc.started.set()
            elif isinstance(item, str):
                keep.append(item)
                with SINK_LOCK:
                    sink.write(f"[{name}] {item}\n")
                    sink.flush()
            else:
                code = int(item)
    except ray.exceptions.RayError as err:
        proc.actor_lost = True
        cause = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        how = "killed (ray.kill)" if proc.killed else "is gone"
        proc.log(f"[launch] {name}: its Ray actor {how} ({type(err).__name__}: {cause})")
        code = LOST
    proc.finish(LOST if code is None else code)


@dataclasses.dataclass
class Placed:
    """Where one task's actor is, this attempt."""

    actor: object
    bundle: int
    ip: str
    port: int
    node_id: str

    @property
    def address(self) -> str:
        return f"{self.ip}:{self.port}"


class RayEngine(Engine):
    """The job on Ray: connect (or start a local instance), place each attempt, start each task."""

    def __init__(self, ray, config: LaunchConfig, address: str | None, placement: str, log=print,
                 startup_timeout: float = STARTUP_TIMEOUT):
        self.ray, self.config, self.address, self.placement = ray, config, address, placement
        self.log = log
        self.all_names = config.names
        self.node_membership: NodeMembership | None = None  # --min-workers: who is placed
        self.startup_timeout = min(startup_timeout, config.timeout or startup_timeout)
        self.pg = None
        self.placed: dict[str, Placed] = {}
        self.tf_configs: dict[str, dict] = {}
        self.cores: dict[str, plans.CoreShare] = {}  # each task's, on its node
        self.procs: dict[str, RayProc] = {}
        self.actor_class = None
        self.local = address is None
        self.placements: list[dict] = []  # each attempt's {task: node}, for launch/ray.json
        self.formation: Formation | None = None
        # Each task's temporary files (a multiworker worker's private checkpoints)
        # go under this path on its node: the actor removes its task's when the
        # task ends, and close() the whole of it here, where a killed actor's or a
        # lost node's stay behind on a host they share with the driver.
        self.scratch = os.path.join(tempfile.gettempdir(),
                                    f"tfdist-ray-{os.getpid()}-{os.urandom(4).hex()}")

    @property
    def names(self) -> list[str]:
        """The tasks placed this attempt: every task, or under --min-workers the members."""
        placed = self.node_membership
        return placed.names if placed is not None else list(self.all_names)

    # --- the cluster ---------------------------------------------------------------

    def open(self, log) -> int | None:
        config = self.config
        files.check_launch_dir(config.launch_dir)
        os.makedirs(config.launch_dir, exist_ok=True)
        self.connect()
        log(f"[launch] {config.kind.name} on Ray: {', '.join(config.names)}; TF_CONFIGs in "
            f"{config.launch_dir}/")
        return None

    def signal(self, member: MemberProcess, sig: int, group: bool = True) -> None:
        if group:
            member.proc.signal_group(sig)
        else:
            member.proc.send_signal(sig)

    def poll(self, member: MemberProcess) -> int | None:
        return member.proc.poll()

    def wait(self, members: list[MemberProcess], timeout: float) -> None:
        wait_all(members, timeout)

    def stop(self, members: list[MemberProcess], grace: float) -> None:
        stop_members(members, grace, group_signal=lambda proc, sig: proc.signal_group(sig))

    def reads_memory(self) -> bool:
        return False  # VmHWM is read from this host's /proc: not for members on other nodes

    def connect(self) -> None:
        ray, t0 = self.ray, time.monotonic()
        if self.local:
            # Logical CPUs: one per task's bundle, whatever this host has.
            ray.init(num_cpus=len(self.all_names) * CPUS_PER_MEMBER, include_dashboard=False,
                     log_to_driver=False, logging_level=logging.WARNING)
            where = f"a local Ray instance (num_cpus={len(self.all_names) * CPUS_PER_MEMBER})"
        else:
            ray.init(address=self.address, log_to_driver=False, logging_level=logging.WARNING)
            where = f"the Ray cluster at {self.address}"
        self.actor_class = ray.remote(MemberHost)
        total = ray.cluster_resources()
        self.log(f"[launch] ray: {where} in {time.monotonic() - t0:.1f}s: {self._alive_nodes()} "
                 f"node(s), {total.get('CPU', 0):g} CPU, {total.get('GPU', 0):g} GPU")

    def _node_ip(self, node_id: str) -> str:
        if self.local:  # every task on this host: loopback (Ray names the host's own address)
            return "127.0.0.1"
        return next(n["NodeManagerAddress"] for n in self.ray.nodes() if n["NodeID"] == node_id)

    def _alive_nodes(self) -> int:
        return sum(1 for n in self.ray.nodes() if n.get("Alive"))

    def membership(self, plan: ElasticPlan, event_paths, record_path, log
                   ) -> "NodeMembership":
        """--min-workers: the supervisor's membership hook, which decides what is placed."""
        self.node_membership = NodeMembership(plan, list(self.all_names), self, event_paths,
                                              log, record_path=record_path)
        return self.node_membership

    def dead_nodes(self) -> set[str]:
        """The nodes Ray counts as dead, of those this attempt's tasks were placed on."""
        used = {p.node_id for p in self.placed.values()}
        return {n["NodeID"] for n in self.ray.nodes() if n["NodeID"] in used and not n.get("Alive")}

    def room_for(self, names: list[str]) -> int:
        """How many of ``names`` (in order) the cluster's live nodes could hold now, by
        their total resources and --ray-placement (this job's own bundles included)."""
        ray = self.ray
        total, nodes = ray.cluster_resources(), self._alive_nodes()
        gpus = total.get("GPU", 0)
        for n in range(len(names), 0, -1):
            bundles = bundles_for(self.config.kind, names[:n], gpus,
                                  pin_head=self.placement in HEAD_PINNED)
            if shortage(bundles, total, nodes, self.placement) is None:
                return n
        return 0

    def close(self) -> None:
        self._release()
        if self.ray.is_initialized():
            self.ray.shutdown()  # a local instance stops with it
        shutil.rmtree(self.scratch, ignore_errors=True)

    def _release(self) -> None:
        for placed in self.placed.values():
            try:
                self.ray.kill(placed.actor, no_restart=True)
            except Exception:  # already gone with its node
                pass
        for proc in self.procs.values():
            if proc.actor is not None:
                try:
                    self.ray.kill(proc.actor, no_restart=True)
                except Exception:
                    pass
        if self.pg is not None:
            from ray.util.placement_group import remove_placement_group

            try:
                remove_placement_group(self.pg)
            except Exception:
                pass
        self.pg, self.placed, self.procs = None, {}, {}

    # --- each attempt: place, bind, TF_CONFIGs ----------------------------------------

    def new_attempt(self, attempt: int, formation: Formation) -> None:
        """Place every task anew: the placement group, one actor per bundle, their ports,
        every TF_CONFIG, the launch files. LaunchError (one line) if the cluster lacks room."""
        self.formation = formation
        ray = self.ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self._release()
        names = self.names
        t0 = time.monotonic()
        bundles = bundles_for(self.config.kind, names, ray.cluster_resources().get("GPU", 0),
                              pin_head=self.placement in HEAD_PINNED)
        lacking = shortage(bundles, ray.cluster_resources(), self._alive_nodes(), self.placement)
        if lacking:
            raise LaunchError(lacking)
        self.pg = placement_group(bundles, strategy=PLACEMENTS[self.placement],
                                  name=f"tfdist-{os.getpid()}-{attempt}")
        try:
            ray.get(self.pg.ready(), timeout=self.startup_timeout)
        except ray.exceptions.GetTimeoutError:
            available = ray.available_resources()
            line = shortage(bundles, available, self._alive_nodes(), self.placement,
                            what="the cluster has available")
            self._release()
            raise LaunchError(
                f"{line or 'the placement group for ' + str(len(bundles)) + ' tasks did not fit'} "
                f"(waited {self.startup_timeout:g}s for room; other jobs may hold it)") from None
        actors = {}
        for i, (name, bundle) in enumerate(zip(names, bundles)):
            actors[name] = self._actor(name, i, bundle, PlacementGroupSchedulingStrategy)
        self.placed = {name: Placed(actors[name], i, 0, "", "") for i, name in
                       enumerate(names)}
        infos = self._get([actors[n].reserve.remote(0) for n in names], "bind their ports")
        for name, info in zip(names, infos):
            p = self.placed[name]
            p.ip, p.port, p.node_id = self._node_ip(info["node_id"]), info["port"], info["node_id"]
        self.cores = node_shares(self.config.kind, {n: self.placed[n].node_id for n in names},
                                 {info["node_id"]: info["cpus"] for info in infos})
        self.tf_configs = plans.tf_configs_at({n: self.placed[n].address for n in names})
        self._save(attempt)
        nodes = sorted({p.node_id for p in self.placed.values()})
        self.log(f"[launch] ray: placed in {time.monotonic() - t0:.1f}s ({self.placement}) on "
                 f"{len(nodes)} node(s): " + ", ".join(
                     f"{n} {p.address} (node {p.node_id[:8]})" for n, p in self.placed.items()))

    def _actor(self, name: str, bundle: int, resources: dict, strategy_class):
        return self.actor_class.options(
            num_cpus=resources.get("CPU", 0), num_gpus=resources.get("GPU", 0),
            max_concurrency=4, max_restarts=0,
            scheduling_strategy=strategy_class(placement_group=self.pg,
                                               placement_group_bundle_index=bundle),
        ).remote(name)

    def _get(self, refs, what: str):
        try:
            return self.ray.get(refs, timeout=self.startup_timeout)
        except self.ray.exceptions.GetTimeoutError:
            self._release()
            raise LaunchError(f"the Ray actors did not {what} within {self.startup_timeout:g}s; "
                              "is every node's Python able to import tfdist?") from None

    def _save(self, attempt: int) -> None:
        launch_dir = self.config.launch_dir
        plan = plans.ClusterPlan(self.tf_configs)
        command = member_command(self.config, self.formation)
        if attempt == 0:
            files.save_launch_files(launch_dir, plan, command)
        else:  # the progress events of every attempt stay (a relaunch appends)
            for name, tf_config in self.tf_configs.items():
                files.write_file(os.path.join(launch_dir, plans.tf_config_file(name)),
                                      json.dumps(tf_config) + "\n")
            files.write_file(os.path.join(launch_dir, "commands.sh"),
                                  plans.commands_script(plan, command, launch_dir))
        self.placements.append({n: {"node_id": p.node_id, "address": p.address}
                                for n, p in self.placed.items()})
        protocol.write_json_atomic(os.path.join(launch_dir, "ray.json"),
                                   {"placement": self.placement, "address": self.address,
                                    "attempts": self.placements})

    # --- each task -----------------------------------------------------------------------

    def start(self, name: str) -> MemberProcess:
        """Start ``name``'s process in its actor. A restart reuses the actor if it lives,
        else places a new one in the same bundle, on the same port."""
        command = member_command(self.config, self.formation)
        env, member_env = os.environ, self.formation.member_env(name)
        placed = self.placed[name]
        old = self.procs.get(name)
        if old is not None and old.actor_lost:
            replaced = self._replace(name, placed)
            if replaced is not None:
                return replaced
        proc = RayProc(self.ray, placed.actor, name, self.log)
        self.procs[name] = proc
        share = self.cores[name]
        # The supervisor sized the thread pools by the driver's cores; the task runs on
        # its node, whose cores and co-located tasks decide them (node_shares).
        own = {k: v for k, v in member_env.items() if k not in plans.THREAD_POOL_ENV}
        job_env = {**{k: v for k, v in env.items() if k in FORWARDED_ENV}, **own, **share.env,
                   "TF_CONFIG": json.dumps(self.tf_configs[name]), "PYTHONUNBUFFERED": "1",
                   "TMPDIR": os.path.join(self.scratch, name.replace(":", "-"))}
        stream = placed.actor.run.options(num_returns="streaming").remote(
            command[1:], job_env, os.getcwd(), share.cpus)
        keep: list[str] = []
        pump = threading.Thread(target=_pump, args=(proc, stream, name, keep), daemon=True)
        pump.start()
        if not proc.started.wait(self.startup_timeout):
            self.log(f"[launch] {name}: its actor did not start the task in "
                     f"{self.startup_timeout:g}s; counted as lost")
            proc.kill()
        if proc.pid is None:
            proc.pid = -(placed.bundle + 1) * 1000 - len(self.procs)  # never a real pid
        return MemberProcess(name, proc, pump, keep)

    def _replace(self, name: str, placed: Placed) -> MemberProcess | None:
        """A new actor for a lost one, in its bundle, on its port; ``None`` when that worked
        (``placed`` updated), else a task already lost (its node is gone)."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        bundle = self.pg.bundle_specs[placed.bundle]
        actor = self._actor(name, placed.bundle, bundle, PlacementGroupSchedulingStrategy)
        try:
            info = self.ray.get(actor.reserve.remote(placed.port), timeout=self.startup_timeout)
        except Exception as err:  # no room, the port taken, the bundle's node gone
            info = {"error": f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"}
        if "error" not in info:
            info["ip"] = self._node_ip(info["node_id"])
        if "error" in info or info["ip"] != placed.ip:
            why = info.get("error") or (f"its bundle is now on {info['ip']} (node "
                                        f"{info['node_id'][:8]}), its TF_CONFIG names {placed.ip}")
            self.log(f"[launch] {name}: cannot replace its actor at {placed.address}: {why}")
            try:
                self.ray.kill(actor, no_restart=True)
            except Exception:
                pass
            proc = RayProc(self.ray, actor, name, self.log)
            proc.actor_lost = True
            proc.pid = -(placed.bundle + 1) * 1000 - len(self.procs)
            proc.finish(LOST)
            self.procs[name] = proc
            done = threading.Thread(target=lambda: None, daemon=True)
            done.start()  # the supervisor joins every task's pump
            return MemberProcess(name, proc, done, [])
        placed.actor, placed.node_id = actor, info["node_id"]
        self.log(f"[launch] {name}: a new Ray actor on node {placed.node_id[:8]}, same address "
                 f"{placed.address}")
        return None


class NodeMembership(Membership):
    """--min-workers on Ray: a worker whose Ray actor is lost (its node gone) ends the
    attempt; the job re-forms with as many workers as the live nodes hold (at least M,
    at most the original N), each attempt placed anew, so the members are always the
    first workers by name. When the live nodes hold more again (a node joined), the
    job is preempted (every worker saves at one agreed step) and re-formed with them.

    Ray says a node is dead some seconds after it is (its health checks): the loss is
    decided once Ray has counted every lost task's node dead, or after --rejoin-timeout.
    """

    CHECK_EVERY = 2.0  # seconds between looks at the cluster's room (ray.nodes() is a GCS call)

    def __init__(self, plan: ElasticPlan, names: list[str], engine: "RayEngine",
                 event_paths=(), log=print, record_path: str | None = None):
        super().__init__(plan, names, event_paths, log, record_path=record_path)
        self.engine = engine
        self.lost_nodes: set[str] = set()
        self.lost_at = 0.0
        self.looked = 0.0

    def new_attempt(self, links_down) -> None:
        super().new_attempt(links_down)
        self.lost_nodes, self.looked = set(), self.clock()

    def __call__(self, state: JobState) -> list:
        self._read()
        if self.lost:
            return []
        now = self.clock()
        dead = set()
        if now - self.looked >= self.CHECK_EVERY:
            self.looked, dead = now, self.engine.dead_nodes()
        if self._gone(dead):
            self.lost_at, self.changed_at = now, time.time()
            self.log(f"[launch] {', '.join(self.lost)}: Ray actor lost: stopping this formation "
                     "of the cluster to re-form it on the nodes left")
            return [SignalMember(t.name, signal.SIGKILL, pid=t.pid)
                    for t in state.members if t.running]
        if (len(self.members) < len(self.workers) and self.started and not self.growing
                and self.looked == now):
            room = self.engine.room_for(self.all_names)
            if room > len(self.members):
                first = next((t for t in state.members if t.running and t.name in self.members),
                             None)
                if first is not None:
                    self.growing = self.workers[len(self.members):room]
                    self.changed_at = self.back_seen = time.time()
                    self.log(f"[launch] the live Ray nodes hold {workers_text(room)} again; SIGTERM "
                             f"to {first.name}: the job checkpoints where it is and stops "
                             f"(exit 42), then re-forms with {workers_text(room)}")
                    return [SignalMember(first.name, signal.SIGTERM, group=False, pid=first.pid)]
        return []

    def _gone(self, dead: set[str]) -> bool:
        """Whether a member was lost (its actor, not killed by the launcher, or its node
        dead); sets ``lost`` and ``lost_nodes``."""
        placed = self.engine.placed
        gone = [n for n in self.members
                if ((p := self.engine.procs.get(n)) is not None and p.actor_lost and not p.killed)
                or (n in placed and placed[n].node_id in dead)]
        if gone:
            self.lost = gone
            self.lost_nodes = {placed[n].node_id for n in gone if n in placed}
        return bool(gone)

    def after_attempt(self, code: int, wait_links) -> int | None:
        self._read()
        if code not in (Exit.OK, Exit.PREEMPTED) and not self.lost:
            # A worker failed first (its peer's node went and the all-reduce with it) and
            # the attempt ended before the loss was seen: Ray counts the node dead soon.
            self.lost_at, self.changed_at = self.clock(), time.time()
            deadline = self.lost_at + self.plan.rejoin_timeout
            while not self._gone(self.engine.dead_nodes()) and self.clock() < deadline:
                time.sleep(0.5)
            if self.lost:
                self.log(f"[launch] {', '.join(self.lost)}: its Ray node is dead")
        if code == Exit.PREEMPTED and self.growing:
            back = self.growing
            self.members = self.workers[:len(self.members) + len(back)]
            self._change(f"{', '.join(back)} back (a Ray node joined: the live nodes hold "
                         f"{workers_text(len(self.members))})", back=True)
            return None
        if code == Exit.OK or not self.lost:
            return code
        # Ray counts a killed node dead only after its health checks fail: until then
        # its resources still look available.
        deadline = self.lost_at + self.plan.rejoin_timeout
        while self.clock() < deadline and not self.lost_nodes <= self.engine.dead_nodes():
            time.sleep(0.5)
        room = min(self.engine.room_for(self.all_names), len(self.workers))
        dead = self.lost_nodes & self.engine.dead_nodes()
        why = (f"{', '.join(self.lost)} lost ("
               + (f"its Ray node {', '.join(sorted(n[:8] for n in dead))} gone" if dead else
                  "its Ray actor gone, its node alive") + ")")
        if room < self.plan.min_workers:
            self.log(f"[launch] {why}: the live Ray nodes hold {workers_text(room)}, below "
                     f"--min-workers={self.plan.min_workers}; stopping (exit "
                     f"{int(Exit.TASK_LOST)}): run the same command when capacity is back to "
                     "resume from the newest checkpoint")
            return Exit.TASK_LOST
        self.members = self.workers[:room]
        self._change(why, back=False)
        return None


# What the driver's environment passes to every task (each node has its own otherwise):
# where the data is, and the tasks' own knobs.
FORWARDED_ENV = ("TFDS_DATA_DIR", "TF_CPP_MIN_LOG_LEVEL", protocol.EVENTS_ENV)


def with_shared_model_dir(config: LaunchConfig) -> LaunchConfig:
    """The model dir as an absolute path in every task's flags: it is the shared path every
    node writes to, whatever each actor's working directory is."""
    options = dataclasses.replace(config.options, model_dir=os.path.abspath(config.model_dir))
    return dataclasses.replace(config, member=dataclasses.replace(config.member, options=options))
