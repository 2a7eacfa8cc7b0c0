"""The launcher's private network namespace, measured from outside it.

While a simulated cluster runs under ``--netns on``, its ports accept
connections inside the namespace and refuse them from this test process,
on loopback and on the host's own address; the job still ends with exit 0,
and a signal to the launcher still stops every task.
"""

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys

import pytest

from tfdist.launcher.machine import network
from conftest import descendants_alive, launch_cmd

pytestmark = pytest.mark.multiprocess

PROBLEM = network.netns_problem()
needs_netns = pytest.mark.skipif(PROBLEM is not None, reason=f"no network namespace here: {PROBLEM}")


def _ports(model_dir):
    ports = []
    for path in sorted((model_dir / "launch").glob("*.tf_config.json")):
        tf_config = json.loads(path.read_text())
        task = tf_config["task"]
        address = tf_config["cluster"][task["type"]][task["index"]]
        ports.append(int(address.rpartition(":")[2]))
    return ports


def _connect(host, port):
    """'open', 'refused', or the error's name: one TCP connect attempt."""
    try:
        with socket.create_connection((host, port), timeout=3):
            return "open"
    except ConnectionRefusedError:
        return "refused"
    except OSError as err:
        return type(err).__name__


def _host_address():
    """This host's address on its default route (no packet is sent), if any."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))  # TEST-NET-1: routing lookup only
        except OSError:
            return None
        address = s.getsockname()[0]
    return None if address.startswith("127.") else address


def _task_pids(model_dir):
    pids = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().split(b"\0")
        except OSError:
            continue
        # A task: the launcher runs `python -m tfdist.cli.train`.
        if b"tfdist.cli.train" in cmd and str(model_dir).encode() in cmd:
            pids.append(int(pid))
    return pids


def _connect_inside(pid, port):
    """A connect from inside the namespace of task ``pid`` (the positive control)."""
    code = (f"import socket; socket.create_connection(('127.0.0.1', {port}), timeout=3); "
            "print('open')")
    out = subprocess.run(
        ["nsenter", f"--target={pid}", "--user", "--net", "--preserve-credentials",
         sys.executable, "-c", code],
        capture_output=True, text=True, timeout=60,
    )
    return out.stdout.strip() or out.stderr.strip().splitlines()[-1]


@needs_netns
@pytest.mark.timeout(240)
def test_ports_are_unreachable_from_outside_and_the_job_still_succeeds(tmp_path, spawn):
    model_dir = tmp_path / "ns"
    p = spawn(launch_cmd("multiworker", "--workers", "2", "--netns", "on", "--timeout", "200",
                         train_args=["--model", "logreg", "--steps", "400", "--log-every", "20",
                                     "--model-dir", str(model_dir)]))
    p.wait_for_line(r"^\[worker:1\] step 20/400", timeout=150)
    ports = _ports(model_dir)
    assert len(ports) == 2
    host = _host_address()

    outside = {port: _connect("127.0.0.1", port) for port in ports}
    outside_host = {port: _connect(host, port) for port in ports} if host else {}
    pids = _task_pids(model_dir)
    inside = {port: _connect_inside(pids[0], port) for port in ports} if shutil.which("nsenter") else {}
    # Both tasks still ran after the probes, so their servers were up throughout.
    alive_after = len(_task_pids(model_dir))
    lines_at_probe = len(p.lines)

    assert outside == {port: "refused" for port in ports}, outside
    assert all(v != "open" for v in outside_host.values()), outside_host
    assert alive_after == 2, p.output
    if inside:
        assert inside == {port: "open" for port in ports}, inside
    assert p.wait(150) == 0, p.output
    assert any(re.match(r"^\[worker:\d\] step 400/400", l) for l in p.lines[lines_at_probe:]), \
        "training ended before the probes; they proved nothing"
    assert descendants_alive(str(model_dir)) == []


@needs_netns
@pytest.mark.long
@pytest.mark.timeout(180)
def test_sigterm_to_the_outer_launcher_stops_every_task(tmp_path, spawn):
    model_dir = tmp_path / "nsterm"
    p = spawn(launch_cmd("multiworker", "--workers", "2", "--netns", "on", "--grace", "3",
                         train_args=["--model", "logreg", "--steps", "1000000", "--log-every", "20",
                                     "--model-dir", str(model_dir)]))
    p.wait_for_line(r"^\[worker:0\] step 20/", timeout=150)
    assert len(_task_pids(model_dir)) == 2
    p.proc.send_signal(signal.SIGTERM)
    # As a shell reports a process ended by SIGTERM (protocol.Exit.TERMINATED);
    # the launcher before the launcher/ package returned 143 here too.
    assert p.wait(60) == 143, p.output
    assert descendants_alive(str(model_dir)) == []
