"""A real multi-node Ray cluster on this machine, for the Ray tier (tests/launcher/test_ray.py).

Each node is its own ``ray start --block`` process in a session of its own,
with its own node address (127.0.0.1, 127.0.0.2, ...: all of 127.0.0.0/8 is
loopback on Linux), its own ``--temp-dir``, ports and worker-port range. A
node's raylet, agents and actors are in that session's process group, so a
node is lost (or stopped) precisely by killing that group: never ``ray stop``,
which would stop every Ray process on the machine.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import sys
import tempfile
import time

from conftest import Proc, child_env

HEAD_IP = "127.0.0.3"  # 127.0.0.1 itself Ray replaces by the machine's own address
RAY = os.path.join(os.path.dirname(sys.executable), "ray")
# Node deaths noticed in about 10 s, not the default ~30 s (not faster: a busy 2-core
# host must not look like a dead node); no token file, no usage report.
ENV = {"RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0",
       "RAY_health_check_period_ms": "2000", "RAY_health_check_timeout_ms": "2000",
       "RAY_health_check_failure_threshold": "4", "RAY_health_check_initial_delay_ms": "2000"}
# Ray gives a starting node 30 s (fixed) to register; a loaded host may miss it once.
TRIES = 2


def free_port(host: str = "127.0.0.1") -> int:
    s = socket.socket()
    s.bind((host, 0))
    port = s.getsockname()[1]
    s.close()
    return port


class Node:
    def __init__(self, proc: Proc, ip: str, temp_dir: str):
        self.proc, self.ip, self.temp_dir = proc, ip, temp_dir

    @property
    def alive(self) -> bool:
        return self.proc.proc.poll() is None

    def kill(self) -> None:
        """The node lost at once: its raylet, agents, actors (and so their tasks) SIGKILLed."""
        try:
            os.killpg(self.proc.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.proc.wait(timeout=30)


class RayCluster:
    """``ray start --head`` plus worker nodes; ``close()`` leaves nothing behind."""

    def __init__(self, head_ip: str = HEAD_IP, port_base: int = 20000):
        """``head_ip``/``port_base``: another cluster's, so two can run side by side
        (their own loopback addresses and worker-port ranges)."""
        self.root = tempfile.mkdtemp(prefix="rt", dir="/tmp")  # short: Unix socket paths
        self.nodes: list[Node] = []
        self.failed: list[Node] = []  # a start that timed out (killed, tried again)
        self.head_ip, self.port_base = head_ip, port_base
        self.port = free_port()
        self.address = f"{head_ip}:{self.port}"
        self.env = child_env(**ENV)

    def _start(self, ip: str, args: list[str], num_cpus: int, timeout: float = 120) -> Node:
        for attempt in range(TRIES):
            node = self._start_once(ip, args, num_cpus, timeout, attempt)
            try:
                node.proc.wait_for_line(r"Ray runtime started", timeout)
                return node
            except AssertionError:
                node.kill()
                self.nodes.remove(node)
                self.failed.append(node)
                if attempt == TRIES - 1:
                    raise
        raise AssertionError("unreachable")

    def _start_once(self, ip, args, num_cpus, timeout, attempt) -> Node:
        i = len(self.nodes) + len(self.failed)
        temp_dir = os.path.join(self.root, f"n{i}")
        os.makedirs(temp_dir)
        low = self.port_base + 2000 * i  # each node its own range of worker ports
        cmd = [RAY, "start", "--block", "--node-ip-address", ip, "--num-cpus", str(num_cpus),
               "--num-gpus", "0", "--temp-dir", temp_dir, "--disable-usage-stats",
               "--min-worker-port", str(low), "--max-worker-port", str(low + 999),
               "--dashboard-agent-listen-port", str(free_port()),
               "--dashboard-agent-grpc-port", str(free_port()),
               "--metrics-export-port", str(free_port()),
               "--runtime-env-agent-port", str(free_port()), *args]
        node = Node(Proc(cmd, self.env), ip, temp_dir)
        self.nodes.append(node)
        return node

    def start_head(self, num_cpus: int) -> Node:
        return self._start(self.head_ip, ["--head", "--port", str(self.port),
                                         "--include-dashboard", "false",
                                         "--dashboard-port", str(free_port()),
                                         "--ray-client-server-port", str(free_port())], num_cpus)

    def add_node(self, ip: str, num_cpus: int) -> Node:
        return self._start(ip, ["--address", self.address], num_cpus)

    def victim(self) -> Node:
        """A live node other than the head, one a test may kill (the first such; a new one,
        on the next loopback address, when every other node is gone)."""
        alive = [n for n in self.nodes if n.ip != self.head_ip and n.alive]
        return alive[0] if alive else self.add_node(self.next_ip(), num_cpus=2)

    def next_ip(self) -> str:
        used = {int(n.ip.rsplit(".", 1)[1]) for n in self.nodes + self.failed}
        return f"127.0.0.{max(used | {int(self.head_ip.rsplit('.', 1)[1])}) + 1}"

    def leftovers(self) -> list[str]:
        """Live processes of this cluster (by its temp dir, or in a node's process group)."""
        groups = {n.proc.proc.pid for n in self.nodes + self.failed}
        out = []
        for pid in os.listdir("/proc"):
            if not pid.isdigit():
                continue
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
                with open(f"/proc/{pid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if fields[0] != "Z" and (self.root in cmd or int(fields[2]) in groups):
                out.append(f"{pid}: {cmd[:160]}")
        return out

    def close(self) -> None:
        for node in reversed(self.nodes):
            if node.alive:
                try:
                    os.killpg(node.proc.proc.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + 15
        for node in self.nodes:
            try:
                node.proc.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except Exception:
                pass
            try:  # whatever the group still holds
                os.killpg(node.proc.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 15
        while self.leftovers() and time.monotonic() < deadline:
            time.sleep(0.2)
        shutil.rmtree(self.root, ignore_errors=True)
