"""Serving tasks (ps, and workers under ps) and the startup watchdog.

TensorFlow waits for missing peers forever, and its servers cannot be
stopped from Python, so both ends here are bounded and explicit: the
watchdog ends a task that is still waiting after ``--startup-timeout``, and
a serving task exits once the chief it served has gone away.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

from tfdist.protocol import Exit
from tfdist.strategies.tf_config import ClusterConfig


def reachable(address: str, timeout: float = 0.5) -> bool:
    """Whether ``address`` accepts a TCP connection now; never raises.

    The watchdog, the lost-task and the stall paths ask this, and must go on
    to their own one-line error whatever the address: a host that the name
    codec (idna) rejects raises UnicodeError (a ValueError), a bad port
    ValueError or OverflowError, the network OSError. All mean unreachable.
    """
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout):
            return True
    except (OSError, ValueError, OverflowError):
        return False


def missing_tasks(cluster: ClusterConfig) -> list[str]:
    """Peers (not this task) that accept no connection on their address."""
    return [
        f"{role}:{i} ({addr})"
        for role, i, addr in cluster.members()
        if (role, i) != (cluster.task_type, cluster.task_index)
        and role != "evaluator"
        and not reachable(addr)
    ]


def unreachable_text(cluster: ClusterConfig) -> str:
    """"unreachable tasks: ..." for the lines that give up waiting on peers."""
    missing = missing_tasks(cluster)
    names = ", ".join(missing) if missing else "none (a peer is up but stuck)"
    return f"unreachable tasks: {names}"


# What a gRPC client sends first (HTTP/2's connection preface, then an empty
# SETTINGS frame). A live gRPC server answers with its own SETTINGS at once;
# a stopped process's kernel still completes the TCP handshake, but nothing
# answers: that tells a stuck task from a slow one and from a gone one.
_H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0])


def answers(address: str, timeout: float = 1.5) -> str:
    """"ok" (its gRPC server answered), "stuck" (a connection, then silence
    for ``timeout`` s) or "unreachable" (no connection); never raises."""
    host, _, port = address.rpartition(":")
    try:
        sock = socket.create_connection((host.strip("[]"), int(port)), timeout=timeout)
    except (OSError, ValueError, OverflowError):
        return "unreachable"
    with sock:
        try:
            sock.settimeout(timeout)
            sock.sendall(_H2_PREFACE)
            return "ok" if sock.recv(64) else "unreachable"
        except socket.timeout:
            return "stuck"
        except OSError:
            return "unreachable"


def peer_states(cluster: ClusterConfig, timeout: float = 1.5) -> dict[str, str]:
    """{"role:index (address)": answers(...)} for every peer, asked at once
    (threads), so the whole probe takes at most ``timeout`` s, and a second
    try for one found stuck (a busy host can be slow to answer once)."""
    import threading

    peers = {f"{role}:{i} ({addr})": addr for role, i, addr in cluster.members()
             if (role, i) != (cluster.task_type, cluster.task_index) and role != "evaluator"}
    states: dict[str, str] = {}

    def ask(name, addr):
        state = answers(addr, timeout)
        states[name] = answers(addr, timeout) if state == "stuck" else state

    threads = [threading.Thread(target=ask, args=item, daemon=True) for item in peers.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join(2 * timeout + 1)
    return {name: states.get(name, "stuck") for name in peers}


def stuck_text(cluster: ClusterConfig, timeout: float = 1.5) -> str:
    """"stuck tasks: ...; unreachable tasks: ..." for the lines that end a
    wait on a peer that is alive but makes no progress."""
    return states_text(peer_states(cluster, timeout))


def states_text(states: dict[str, str]) -> str:
    """The text of ``stuck_text`` for states already probed (``peer_states``)."""
    stuck = [n for n, s in states.items() if s == "stuck"]
    gone = [n for n, s in states.items() if s == "unreachable"]
    parts = []
    if stuck:
        parts.append(f"stuck tasks (they accept connections but do not answer): "
                     f"{', '.join(stuck)}")
    if gone:
        parts.append(f"unreachable tasks: {', '.join(gone)}")
    return "; ".join(parts) or "every task answers (a peer is slow, not stuck)"


def exit_now(code: int, message: str) -> None:
    """Print ``message`` and end the process at once.

    For watchdogs only: a TensorFlow call blocked on a missing peer holds
    the main thread, and only ``_exit`` ends the process then.
    """
    print(message, file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(code)


class StartupWatchdog:
    """Ends this process with one line unless ``done()`` comes in time.

    Started before the strategy is built and marked done after the first
    step. MultiWorkerMirroredStrategy waits for its peers inside a call that
    holds the GIL, so no thread of ours could run meanwhile: the watchdog is
    a small child process instead. It reads our pipe; ``done()`` (or our
    death) closes it, and on timeout it names the missing peers and kills us.
    """

    def __init__(self, cluster: ClusterConfig, timeout: float, what: str):
        self._proc = None
        if cluster.is_local:
            return
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "tfdist.strategies.server", cluster.to_json(), str(timeout),
             what, str(os.getpid())],
            stdin=subprocess.PIPE,
            # Its error line must not depend on this process (which it kills)
            # forwarding it: straight to our stderr, filtered or not.
            stderr=sys.stderr,
        )

    def done(self) -> None:
        if self._proc is not None:
            self._proc.stdin.close()
            self._proc.wait()
            self._proc = None


def _watch(tf_config: str, timeout: float, what: str, parent: int) -> None:
    import select

    from tfdist.strategies.tf_config import parse_tf_config

    ready, _, _ = select.select([sys.stdin], [], [], timeout)
    if ready:  # the parent said done, or died: either way, nothing to do
        return
    cluster = parse_tf_config(tf_config)
    print(
        f"error: {cluster.member_name} gave up after --startup-timeout={timeout:g}s "
        f"waiting to {what}; {unreachable_text(cluster)}. Start every task in "
        "TF_CONFIG, or raise --startup-timeout",
        file=sys.stderr, flush=True,
    )
    os.kill(parent, signal.SIGKILL)


class CallGuard:
    """Ends this process with one line if a guarded call blocks on a stuck peer.

    For calls that TensorFlow may block inside while holding the GIL (a
    checkpoint save registers a new function with every task, and a stopped
    task never answers): no thread of ours could run then, so the guard is a
    small child process, as ``StartupWatchdog`` is. ``guarded(what, then)``
    arms it; past ``timeout`` it probes the peers, waits again if every one
    answers (a slow save, not a blocked one) and otherwise prints the line
    and kills us with SIGKILL, the only end a blocked process still takes.
    """

    def __init__(self, cluster: ClusterConfig, timeout: float):
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "tfdist.strategies.server", "--guard", cluster.to_json(), str(timeout),
             str(os.getpid())],
            stdin=subprocess.PIPE, stderr=sys.stderr,
        )

    def _send(self, line: str) -> None:
        try:
            self._proc.stdin.write(line.replace("\n", " ").encode() + b"\n")
            self._proc.stdin.flush()
        except (OSError, ValueError):  # the guard is gone: the call goes unguarded
            pass

    def guarded(self, what: str, then: str):
        import contextlib

        @contextlib.contextmanager
        def armed():
            self._send(f"arm {what}\t{then}")
            try:
                yield
            finally:
                self._send("disarm")

        return armed()

    def close(self) -> None:
        try:
            self._proc.stdin.close()
        except OSError:
            pass
        try:
            self._proc.wait(5)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()


def _guard(tf_config: str, timeout: float, parent: int) -> None:
    import select

    from tfdist.strategies.tf_config import parse_tf_config

    cluster = parse_tf_config(tf_config)
    armed, since, pending = None, 0.0, b""
    while True:
        wait = None if armed is None else max(0.0, since + timeout - time.monotonic())
        ready, _, _ = select.select([0], [], [], wait)
        if ready:
            chunk = os.read(0, 65536)
            if not chunk:  # the parent closed the pipe, or died
                return
            pending += chunk
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                cmd, _, text = line.decode(errors="replace").partition(" ")
                armed, since = (text.split("\t", 1) if cmd == "arm" else None), time.monotonic()
            continue
        states = peer_states(cluster)
        if "stuck" not in states.values():
            since = time.monotonic()  # slow, not blocked: wait again
            continue
        what, then = armed
        print(f"error: {cluster.member_name}: {what} has waited over {timeout:g}s "
              f"(--stuck-timeout) on a task that does not answer; {states_text(states)}; "
              f"TensorFlow holds this task inside that call, so it is ended (SIGKILL); {then}",
              file=sys.stderr, flush=True)
        os.kill(parent, signal.SIGKILL)
        return


def serve(cluster: ClusterConfig, *, startup_timeout: float, poll: float = 0.5,
          chief_grace: float = 2.0) -> int:
    """Run this task's ``tf.distribute.Server`` until the chief is gone.

    A ps or worker server under ParameterServerStrategy only executes what the
    coordinator (chief) sends; once the chief has been up and then stays
    unreachable for ``chief_grace`` seconds, the job is over.
    """
    import tensorflow as tf

    jobs = {r: list(a) for r, a in cluster.roles.items() if r != "evaluator"}
    server = tf.distribute.Server(
        tf.train.ClusterSpec(jobs), job_name=cluster.task_type,
        task_index=cluster.task_index, protocol="grpc", start=True,
    )
    # A polite preemption: the coordinator reschedules this worker's closures
    # (or, for a ps task, the chief stops and the job is relaunched).
    signal.signal(signal.SIGTERM, lambda *_: exit_now(
        128 + signal.SIGTERM, f"{cluster.member_name}: SIGTERM; stopping serving"))
    print(f"{cluster.member_name} serving at {cluster.address} (target {server.target})", flush=True)
    chief = cluster.roles["chief"][0]
    started = time.monotonic()
    seen_at = None
    while True:
        now = time.monotonic()
        if reachable(chief):
            seen_at = now
        elif seen_at is None and now - started > startup_timeout:
            exit_now(
                Exit.TASK_LOST,
                f"error: {cluster.member_name} gave up after --startup-timeout={startup_timeout:g}s: "
                f"the chief at {chief} never came up; start the chief task, or raise --startup-timeout",
            )
        elif seen_at is not None and now - seen_at > chief_grace:
            print(f"{cluster.member_name}: chief at {chief} is gone; stopping", flush=True)
            exit_now(Exit.OK, f"{cluster.member_name} stopped")
        time.sleep(poll)


if __name__ == "__main__":
    if sys.argv[1] == "--guard":
        _guard(sys.argv[2], float(sys.argv[3]), int(sys.argv[4]))
    else:
        _watch(sys.argv[1], float(sys.argv[2]), sys.argv[3], int(sys.argv[4]))
