"""The simulated network: a private namespace, hosts on a bridge, shaped links.

TensorFlow's servers listen on every interface without authentication, so
where the OS allows it the launcher runs the whole cluster in a private
network namespace of its own (``unshare --user --map-root-user --net``):
its ports exist only there. With ``--hosts N`` that namespace also holds a
bridge, and each simulated host is a network namespace of its own, nested
inside, joined to the bridge by a veth pair and given its own address
(``plan.host_address``). A host namespace is held by a ``sleep`` process
that dies with the launcher, so the namespaces, veths and qdiscs vanish by
themselves however the launcher ends. No address outside that namespace is
used, and no packet leaves the machine.

``--link-rate`` shapes both ends of every host's veth with a token bucket
(``tc qdisc ... tbf``): each host has RATE up and RATE down. Latency would need
``netem``, a kernel module many hosts lack: there is no latency emulation.

    python -m tfdist.cli.tools.hosts --hosts 2 --link-rate 100mbit   # build, measure, tear down
"""

from __future__ import annotations

import ctypes
import glob
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
from dataclasses import dataclass

from tfdist.launcher import plan as plans
from tfdist.launcher.plan import LaunchError
from tfdist.linux import CLONE_NEWNET, die_with_parent, enter_netns, libc
from tfdist.strategies.kinds import StrategyKind

NETNS_MODES = ("auto", "on", "off")
# A user namespace makes an unprivileged network namespace possible; mapping
# our uid to root inside it lets the launcher bring devices up.
UNSHARE = ("unshare", "--user", "--map-root-user", "--net")
INSIDE_FLAG = "--netns-inside"
# The hosts' self-check and probe, a command of its own (tfdist/cli/tools/hosts.py), run in a namespace.
PROBE_COMMAND = ("-m", "tfdist.cli.tools.hosts")
LAUNCH = ("-m", "tfdist.cli.launch")  # the same command, re-run inside the namespace
BRIDGE = "simbr0"
PROBE_PORT = 5201


# --- the launcher's own namespace -----------------------------------------------------

def decide_netns(mode: str, kind: StrategyKind, probe) -> tuple[bool, str | None]:
    """Whether to run the cluster in a private network namespace (pure).

    ``probe()`` says why no namespace can be made here (``None``: it can); it
    is called only when the answer matters. Returns ``(use, warning)``.
    """
    if mode not in NETNS_MODES:
        raise LaunchError(f"unknown --netns {mode!r}; allowed: {', '.join(NETNS_MODES)}")
    if mode == "off" or kind.single_process:  # one process opens no port
        return False, None
    problem = probe()
    if problem is None:
        return True, None
    if mode == "on":
        raise LaunchError(
            f"--netns on, but this host cannot make a private network namespace ({problem}); "
            f"make `{' '.join(UNSHARE)} true` work (util-linux installed; unprivileged user "
            "namespaces allowed: sysctl user.max_user_namespaces > 0, and "
            "kernel.unprivileged_userns_clone=1 or kernel.apparmor_restrict_unprivileged_userns=0 "
            "where those exist), or use --netns auto to run on the host network"
        )
    return False, (
        f"[launch] warning: no private network namespace ({problem}); the cluster's ports are "
        "open on every interface of this host. --netns off silences this, --netns on makes it an error"
    )


def check_hosts_mode(hosts: int, netns: str, link_rate: str | None, probe,
                     link_trace: bool = False) -> None:
    """``--hosts``, ``--link-rate`` and ``--link-trace`` need namespaces; say so in one
    line (pure but for ``probe``)."""
    if link_trace and link_rate is None:
        raise LaunchError(
            "--link-trace samples the shaped links between simulated hosts and gives each "
            "sample as a fraction of their rate; add --hosts N --link-rate RATE (e.g. 100mbit)")
    if link_rate is not None and hosts < 2:
        raise LaunchError(
            f"--link-rate {link_rate} shapes the links between simulated hosts; add --hosts N "
            "with N >= 2 (tasks on one host talk over its loopback, which is not shaped)"
        )
    if not hosts:
        return
    if netns == "off":
        raise LaunchError("--hosts runs each simulated host in a network namespace; "
                          "it cannot be combined with --netns off")
    problem = probe()
    if problem is not None:
        raise LaunchError(f"--hosts needs network namespaces, which this host cannot make "
                          f"({problem}); run without --hosts for one loopback cluster")


def netns_problem(timeout: float = 10.0) -> str | None:
    """Why ``unshare`` cannot make a user + network namespace here, or ``None``."""
    try:
        probe = subprocess.run(
            [*UNSHARE, "true"], stdin=subprocess.DEVNULL, capture_output=True, text=True,
            timeout=timeout,
        )
    except FileNotFoundError:
        return "the unshare command (util-linux) is not installed"
    except subprocess.TimeoutExpired:
        return f"unshare did not finish within {timeout:g}s"
    if probe.returncode != 0:
        lines = probe.stderr.strip().splitlines()
        return lines[-1] if lines else f"unshare exited with code {probe.returncode}"
    return None


def hosts_problem(timeout: float = 20.0) -> str | None:
    """Why simulated hosts (nested namespaces, veth, bridge) cannot be built here, or ``None``."""
    problem = netns_problem(timeout)
    if problem is not None:
        return problem
    try:
        probe = subprocess.run(
            [*UNSHARE, sys.executable, *PROBE_COMMAND, "--hosts", "2", "--probe"],
            stdin=subprocess.DEVNULL, capture_output=True,
            text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return f"building two simulated hosts took over {timeout:g}s"
    if probe.returncode != 0:
        lines = (probe.stderr.strip() or probe.stdout.strip()).splitlines()
        return lines[-1] if lines else f"exit code {probe.returncode}"
    return None


def netns_command(launch_argv: list[str], member_argv: list[str],
                  python: str = sys.executable) -> list[str]:
    """This launcher again, inside new namespaces, told that it is inside (pure);
    ``member_argv``: every member's flags (``MemberArgs.argv``), after ``--``."""
    return [*UNSHARE, python, *LAUNCH, *launch_argv, INSIDE_FLAG, "--", *member_argv]


def loopback_up() -> None:
    """Bring ``lo`` up: a new network namespace starts with it down."""
    import fcntl
    import struct

    siocgifflags, siocsifflags, iff_up = 0x8913, 0x8914, 0x1
    ifreq = "16sH22x"  # struct ifreq: name, then ifr_flags in a 24-byte union
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        flags = struct.unpack(ifreq, fcntl.ioctl(s, siocgifflags, struct.pack(ifreq, b"lo", 0)))[1]
        fcntl.ioctl(s, siocsifflags, struct.pack(ifreq, b"lo", flags | iff_up))


def run_in_netns(command: list[str], grace: float) -> int:
    """Run the inner launcher; forward SIGTERM/SIGINT to it; return its exit code.

    The inner launcher stops its tasks on SIGTERM as usual. A second signal
    kills it outright, and its tasks die with it (``PR_SET_PDEATHSIG``).
    """
    # Own session: a terminal's Ctrl-C reaches only this process, which
    # forwards it once, instead of both launchers acting on it at once.
    proc = subprocess.Popen(command, stdin=subprocess.DEVNULL, start_new_session=True,
                            preexec_fn=die_with_parent)
    signals = []

    def forward(signum, _frame):
        signals.append(signum)
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM if len(signals) == 1 else signal.SIGKILL)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        code = proc.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    # Killed by a signal: report it the way a shell would.
    return code if code >= 0 else 128 - code


# --- link rates ----------------------------------------------------------------------------

_RATE_RX = re.compile(r"^(\d+(?:\.\d+)?)(bit|kbit|mbit|gbit)$")
_UNITS = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9}
MIN_RATE, MAX_RATE = 10**6, 10 * 10**9


def parse_rate(text: str) -> int:
    """``100mbit`` -> 100_000_000 bits/s (pure); tc's bit units only."""
    m = _RATE_RX.match(text.strip().lower())
    if not m:
        raise LaunchError(
            f"--link-rate {text!r} is not a rate; use a number and a bit unit as tc does: "
            "100mbit, 1gbit, 5000kbit"
        )
    bits = int(float(m.group(1)) * _UNITS[m.group(2)])
    if not MIN_RATE <= bits <= MAX_RATE:
        raise LaunchError(f"--link-rate {text}: use 1mbit to 10gbit")
    return bits


def tbf_args(rate_bits: int) -> list[str]:
    """``tc qdisc`` arguments for a token bucket at ``rate_bits`` (pure).

    The bucket holds 5 ms of traffic (at least 32 KiB, so a full-size
    segment always fits) and queues up to 50 ms: TCP then sees a steady
    link instead of bursts of drops.
    """
    burst = max(32 * 1024, rate_bits // 8 // 200)
    return ["tbf", "rate", f"{rate_bits}bit", "burst", str(burst), "latency", "50ms"]


def probe_bytes(rate_bits: int) -> int:
    """A transfer of about 0.6 s at ``rate_bits``, at most 64 MiB, and at least
    8 buckets, so the bucket's first burst at full speed skews it by < 13 %."""
    burst = int(tbf_args(rate_bits)[4])
    return int(min(64 << 20, max(8 * burst, rate_bits // 8 * 0.6)))


@dataclass(frozen=True)
class LinkCheck:
    set_bits: int
    measured_bits: float
    size: int
    seconds: float

    def describe(self, rate: str) -> str:
        return (f"every host's link shaped to {rate} each way (tc tbf; no latency emulation: "
                f"netem is not available); measured host0 -> host1: "
                f"{self.measured_bits / 1e6:.1f} Mbit/s ({self.size / 2**20:.1f} MiB in "
                f"{self.seconds:.2f} s, {self.measured_bits / self.set_bits:.0%} of the set rate)")

    def to_dict(self) -> dict:
        return {"set_bits_per_sec": self.set_bits, "measured_bits_per_sec": round(self.measured_bits),
                "probe_bytes": self.size, "probe_seconds": round(self.seconds, 4)}


# --- simulated hosts -------------------------------------------------------------------

def _unshare_net():  # runs in the holder between fork and exec
    die_with_parent()
    if libc().unshare(CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"unshare(CLONE_NEWNET): {os.strerror(err)}")


def _run(cmd: list[str], netns: str | None = None, timeout: float = 20.0) -> None:
    _output(cmd, netns, timeout)


def _output(cmd: list[str], netns: str | None = None, timeout: float = 20.0) -> str:
    out = subprocess.run(cmd, capture_output=True, text=True, stdin=subprocess.DEVNULL,
                         timeout=timeout,
                         preexec_fn=(lambda: enter_netns(netns)) if netns else None)
    if out.returncode != 0:
        raise RuntimeError(f"`{' '.join(cmd)}` failed: {out.stderr.strip() or out.returncode}")
    return out.stdout


def parse_net_dev(text: str) -> dict[str, tuple[int, int]]:
    """``/proc/net/dev`` -> ``{interface: (rx_bytes, tx_bytes)}`` (pure)."""
    out = {}
    for line in text.splitlines()[2:]:  # two header lines
        name, sep, rest = line.partition(":")
        fields = rest.split()
        if sep and len(fields) >= 9:
            out[name.strip()] = (int(fields[0]), int(fields[8]))
    return out


def read_net_dev() -> str:
    """This namespace's ``/proc/net/dev``: ``/sys/class/net`` would show the
    namespace that mounted sysfs, not this one."""
    with open("/proc/net/dev") as f:
        return f.read()


def host_counters(devices: dict[str, tuple[int, int]], hosts: int) -> dict[int, dict[str, int]]:
    """Each host's bytes sent and received, from its veth's bridge end (pure).

    The bridge end ``vh<i>`` receives what host i sends and transmits what
    it receives, so its rx is the host's tx: what crossed the host's link,
    Ethernet, IP and TCP headers included.
    """
    out = {}
    for i in range(hosts):
        rx, tx = devices[f"vh{i}"]
        out[i] = {"tx_bytes": rx, "rx_bytes": tx}
    return out


def parse_snmp_tcp(text: str) -> dict[str, int]:
    """``/proc/net/snmp`` -> its ``Tcp:`` counters, e.g. ``OutSegs``, ``RetransSegs`` (pure)."""
    rows = [line.split()[1:] for line in text.splitlines() if line.startswith("Tcp:")]
    if len(rows) < 2:
        raise ValueError("no Tcp: counters")
    return {k: int(v) for k, v in zip(rows[0], rows[1])}


_DROPPED_RX = re.compile(r"\(dropped (\d+),")


def parse_qdisc_drops(text: str) -> int:
    """``tc -s qdisc show dev D`` -> the packets its qdiscs dropped (pure)."""
    return sum(int(n) for n in _DROPPED_RX.findall(text))


class SimulatedHosts:
    """N hosts on a bridge inside the launcher's namespace; call ``close`` when done."""

    def __init__(self, hosts: int, rate_bits: int | None = None):
        self.count, self.rate_bits = hosts, rate_bits
        self.holders: list[subprocess.Popen] = []

    def netns(self, index: int) -> str:
        return f"/proc/{self.holders[index].pid}/ns/net"

    def up(self) -> "SimulatedHosts":
        try:
            loopback_up()
            _run(["ip", "link", "add", BRIDGE, "type", "bridge"])
            _run(["ip", "addr", "add", f"{plans.BRIDGE_ADDRESS}/{plans.PREFIX}", "dev", BRIDGE])
            _run(["ip", "link", "set", BRIDGE, "up"])
            for i in range(self.count):
                self._add_host(i)
        except BaseException:
            self.close()
            raise
        return self

    def build(self, cluster, link_rate: str | None, log):
        """Bring the hosts up and measure a shaped link: the link record (``None``
        unshaped), or ``False`` if the machine cannot (exit 1, not 2: the outer
        launcher's probe passed, so it is the machine, not the flags).
        ``cluster``: the ``plan.ClusterPlan`` placed on them."""
        try:
            self.up()
            check = self.measure() if self.rate_bits else None
        except (OSError, RuntimeError, ValueError, subprocess.SubprocessError) as err:
            log(f"[launch] error: could not build or measure {cluster.hosts} simulated "
                f"hosts: {err}")
            return False
        log("[launch] hosts: " + ", ".join(
            f"host{i} {plans.host_address(i)} ("
            f"{', '.join(n for n, h in cluster.host_of.items() if h == i)})"
            for i in range(cluster.hosts)) + f" on bridge {BRIDGE} "
            f"({plans.BRIDGE_ADDRESS}/{plans.PREFIX}), private to this launcher")
        if check is None:
            return None
        log(f"[launch] links: {check.describe(link_rate)}")
        return {"rate": link_rate, **check.to_dict()}

    def _add_host(self, i: int) -> None:
        # Popen returns after exec, so after the holder's unshare: its
        # namespace exists (a veth moved in earlier would land in ours).
        holder = subprocess.Popen(["sleep", "infinity"], stdin=subprocess.DEVNULL,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                  preexec_fn=_unshare_net)
        self.holders.append(holder)
        ns, outer = self.netns(i), f"vh{i}"
        _run(["ip", "link", "add", outer, "type", "veth", "peer", "name", "eth0", "netns", ns])
        _run(["ip", "link", "set", outer, "master", BRIDGE, "up"])
        _run(["ip", "addr", "add", f"{plans.host_address(i)}/{plans.PREFIX}", "dev", "eth0"], ns)
        _run(["ip", "link", "set", "eth0", "up"], ns)
        _run(["ip", "link", "set", "lo", "up"], ns)
        if self.rate_bits:
            # Both ends: the host's uplink (its eth0) and its downlink (the
            # bridge port); a host then has RATE each way, like a NIC.
            _run(["tc", "qdisc", "add", "dev", "eth0", "root", *tbf_args(self.rate_bits)], ns)
            _run(["tc", "qdisc", "add", "dev", outer, "root", *tbf_args(self.rate_bits)])

    def set_link(self, index: int, up: bool) -> None:
        """``--partition``: host ``index``'s link down (its bridge end; the
        host's eth0 loses its carrier), or up again. Connections stay open,
        as across a real switch failure: packets are simply not delivered."""
        if not 0 <= index < len(self.holders):
            raise ValueError(f"no simulated host{index}")
        _run(["ip", "link", "set", f"vh{index}", "up" if up else "down"])

    def counters(self) -> dict[int, dict[str, int]]:
        """Every host's bytes sent and received so far (its veth's counters).

        Read from ``/proc/net/dev`` of this (the launcher's) namespace, where
        the bridge ends live (``read_net_dev``).
        """
        out = host_counters(parse_net_dev(read_net_dev()), self.count)
        # Why a link runs below its rate: TCP segments sent and sent again
        # (the host's own namespace) and packets its shapers dropped, the
        # uplink's (eth0, in the host) and the downlink's (its bridge end).
        for i, counts in out.items():
            with open(f"/proc/{self.holders[i].pid}/net/snmp") as f:
                tcp = parse_snmp_tcp(f.read())
            counts["tcp_segments_sent"] = tcp["OutSegs"]
            counts["tcp_segments_retransmitted"] = tcp["RetransSegs"]
            if self.rate_bits:
                counts["shaper_drops_tx"] = parse_qdisc_drops(
                    _output(["tc", "-s", "qdisc", "show", "dev", "eth0"], self.netns(i)))
                counts["shaper_drops_rx"] = parse_qdisc_drops(
                    _output(["tc", "-s", "qdisc", "show", "dev", f"vh{i}"]))
        return out

    def measure(self, src: int = 0, dst: int = 1, timeout: float = 30.0) -> LinkCheck:
        """One TCP transfer from host ``src`` to host ``dst``, timed by the receiver."""
        size = probe_bytes(self.rate_bits or 10**9)
        recv = subprocess.Popen(
            [sys.executable, "-m", "tfdist.launcher.machine.linkprobe", "recv", plans.host_address(dst),
             str(PROBE_PORT)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            stdin=subprocess.DEVNULL, text=True, preexec_fn=self._entering(dst))
        try:
            ready = _readline(recv.stdout, timeout)
            if ready.strip() != "ready":
                raise RuntimeError(f"link probe receiver did not start: {ready!r} "
                                   f"{recv.stderr.read() if recv.poll() is not None else ''}")
            subprocess.run([sys.executable, "-m", "tfdist.launcher.machine.linkprobe", "send",
                            plans.host_address(dst), str(PROBE_PORT), str(size)],
                           check=True, timeout=timeout, stdin=subprocess.DEVNULL,
                           preexec_fn=self._entering(src))
            result = json.loads(_readline(recv.stdout, timeout))
            recv.wait(timeout)
        finally:
            if recv.poll() is None:
                recv.kill()
                recv.wait()
        seconds = max(result["seconds"], 1e-6)
        return LinkCheck(self.rate_bits or 0, result["bytes"] * 8 / seconds, result["bytes"], seconds)

    def _entering(self, index: int):
        ns = self.netns(index)

        def setup():
            die_with_parent()
            enter_netns(ns)

        return setup

    def close(self) -> None:
        """Holders gone, their namespaces go, and the veths and qdiscs with them."""
        for holder in self.holders:
            if holder.poll() is None:
                holder.kill()
            holder.wait()
        self.holders.clear()
        subprocess.run(["ip", "link", "del", BRIDGE], capture_output=True, stdin=subprocess.DEVNULL)


def _readline(stream, timeout: float) -> str:
    """One line from ``stream``, or RuntimeError after ``timeout`` (a thread does the read)."""
    box: list[str] = []
    reader = threading.Thread(target=lambda: box.append(stream.readline()), daemon=True)
    reader.start()
    reader.join(timeout)
    if not box:
        raise RuntimeError(f"no answer from the link probe within {timeout:g}s")
    return box[0]


# --- data, before entering a namespace without network -----------------------------

def mnist_prepared(data_dir: str) -> bool:
    return bool(glob.glob(os.path.join(os.path.expanduser(data_dir), "mnist", "*",
                                       "dataset_info.json")))


def prepare_data_command(data_dir: str, python: str = sys.executable) -> list[str]:
    return [python, "-m", "tfdist.cli.tools.prepare_data", *(["--data-dir", data_dir] if data_dir else [])]


def prepare_data(data_dir: str | None, env: dict[str, str]) -> int:
    """Download MNIST first if tfds would: the namespace has no network.
    ``data_dir``: the members' ``--data-dir`` (None: ``TFDS_DATA_DIR``, else tfds's own)."""
    data_dir = data_dir or env.get("TFDS_DATA_DIR") or ""
    where = data_dir or os.path.join("~", "tensorflow_datasets")
    if mnist_prepared(where):
        return 0
    print(f"[launch] no MNIST in {where}; checking or downloading it before entering the "
          "network namespace, which has no network", flush=True)
    return subprocess.run(prepare_data_command(data_dir), env=env,
                          stdin=subprocess.DEVNULL).returncode
