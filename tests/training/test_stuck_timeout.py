"""--stuck-timeout: parsed into the frozen config and plan, bad values refused
in one line (exit 2), and the probe that tells a stuck task from a gone one.

No TensorFlow runs here: the flag is checked before the runtime starts, and
the probe is plain sockets (a server that accepts and never answers is what
a stopped process looks like from outside).
"""

from __future__ import annotations

import json
import socket
import threading

import pytest

from tfdist.cli import train
from tfdist.protocol import ConfigError, Exit
from tfdist.strategies import server
from tfdist.training.config import DEFAULT_STUCK_TIMEOUT, STUCK_TIMEOUT_RANGE, TrainConfig


def _main(argv, capsys, monkeypatch, tmp_path):
    monkeypatch.delenv("TF_CONFIG", raising=False)
    monkeypatch.chdir(tmp_path)
    code = train.main([*argv, "--model-dir", str(tmp_path / "run")])
    out, err = capsys.readouterr()
    return code, out, err


def test_the_default_is_documented_in_help_and_lands_in_the_config():
    assert train.config_from_args(train.parse_args([])).stuck_timeout == DEFAULT_STUCK_TIMEOUT
    config = train.config_from_args(train.parse_args(["--stuck-timeout", "12.5"]))
    assert config.stuck_timeout == 12.5


def test_help_names_the_flag_and_its_range(capsys):
    with pytest.raises(SystemExit) as exit_info:
        train.parse_args(["--help"])
    assert exit_info.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "--stuck-timeout SECONDS" in text
    assert f"({STUCK_TIMEOUT_RANGE[0]:g} to {STUCK_TIMEOUT_RANGE[1]:g})" in text
    assert f"default: {DEFAULT_STUCK_TIMEOUT:g}" in text, text


@pytest.mark.parametrize("value", ["0", "-5", "1.9", "nan", "inf", "86401", "1e309"])
def test_out_of_range_values_are_one_line_and_exit_2(value, capsys, monkeypatch, tmp_path):
    code, out, err = _main([f"--stuck-timeout={value}", "--dry-run"], capsys, monkeypatch,
                           tmp_path)
    assert code == Exit.BAD_INPUT
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: --stuck-timeout="), err
    assert "use 2 to 86400 seconds" in lines[0]
    assert out == "" and not (tmp_path / "run").exists()


def test_a_word_is_refused_by_the_parser_in_one_line(capsys, monkeypatch, tmp_path):
    code, out, err = _main(["--stuck-timeout=soon", "--dry-run"], capsys, monkeypatch, tmp_path)
    assert code == Exit.BAD_INPUT
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "--stuck-timeout" in lines[0] and "'soon'" in lines[0], err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("value", [2.0, 30.0, 86400.0])
def test_values_in_range_validate(value):
    TrainConfig(stuck_timeout=value).validate()


def test_the_plan_carries_the_bound(capsys, monkeypatch, tmp_path):
    code, out, err = _main(["--stuck-timeout=7", "--dry-run", "--model", "logreg"], capsys,
                           monkeypatch, tmp_path)
    assert code == Exit.OK, err
    assert json.loads(out)["stuck_timeout"] == 7.0


def test_validate_names_the_flag():
    with pytest.raises(ConfigError, match=r"^--stuck-timeout=1 is not allowed"):
        TrainConfig(stuck_timeout=1.0).validate()


# --- the probe: answers, stuck (connects, then silence), unreachable ------------

def _server(reply: bytes | None):
    """A listening socket on a free port; accepts, then replies (or stays silent)."""
    srv = socket.create_server(("127.0.0.1", 0))
    held = []

    def serve():
        while True:
            try:
                conn, _ = srv.accept()
            except OSError:
                return
            held.append(conn)
            if reply is not None:
                conn.recv(64)
                conn.sendall(reply)

    threading.Thread(target=serve, daemon=True).start()
    return srv, held, f"127.0.0.1:{srv.getsockname()[1]}"


def test_a_server_that_answers_is_ok():
    srv, held, address = _server(b"\x00\x00\x00\x04\x00\x00\x00\x00\x00")
    try:
        assert server.answers(address, timeout=2.0) == "ok"
    finally:
        srv.close()


def test_a_server_that_accepts_and_stays_silent_is_stuck():
    srv, held, address = _server(None)
    try:
        assert server.answers(address, timeout=0.5) == "stuck"
    finally:
        srv.close()
        for conn in held:
            conn.close()


def test_a_closed_port_is_unreachable():
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()  # nothing listens there now
    assert server.answers(f"127.0.0.1:{port}", timeout=0.5) == "unreachable"
    assert server.answers("not a host:1", timeout=0.5) == "unreachable"


def test_stuck_text_names_stuck_and_unreachable_peers():
    from tfdist.strategies.tf_config import parse_tf_config

    silent, held, silent_addr = _server(None)
    ok, _, ok_addr = _server(b"\x00\x00\x00\x04\x00\x00\x00\x00\x00")
    gone = socket.socket()
    gone.bind(("127.0.0.1", 0))
    gone_addr = f"127.0.0.1:{gone.getsockname()[1]}"
    gone.close()
    cluster = parse_tf_config(json.dumps({
        "cluster": {"chief": ["127.0.0.1:1"], "worker": [ok_addr, silent_addr],
                    "ps": [gone_addr]},
        "task": {"type": "chief", "index": 0}}))
    try:
        states = server.peer_states(cluster, timeout=0.5)
        assert states == {f"worker:0 ({ok_addr})": "ok", f"worker:1 ({silent_addr})": "stuck",
                          f"ps:0 ({gone_addr})": "unreachable"}
        text = server.stuck_text(cluster, timeout=0.5)
        assert text == (f"stuck tasks (they accept connections but do not answer): worker:1 "
                        f"({silent_addr}); unreachable tasks: ps:0 ({gone_addr})")
    finally:
        silent.close()
        ok.close()
        for conn in held:
            conn.close()


# --- the call guard: a child process that ends a task blocked on a stuck peer ---------

OK_REPLY = b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"


def _guard_for(victim_pid: int, worker_addr: str, timeout: str = "1"):
    """The guard's child process, as ``CallGuard`` starts it, guarding ``victim_pid``."""
    import subprocess
    import sys

    from conftest import REPO
    from tfdist.strategies.tf_config import parse_tf_config

    cluster = parse_tf_config(json.dumps({
        "cluster": {"chief": ["127.0.0.1:1"], "worker": [worker_addr]},
        "task": {"type": "chief", "index": 0}}))
    return subprocess.Popen([sys.executable, "-m", "tfdist.strategies.server", "--guard", cluster.to_json(),
                             timeout, str(victim_pid)], cwd=REPO, stdin=subprocess.PIPE,
                            stderr=subprocess.PIPE)


@pytest.mark.timeout(60)
def test_the_guard_ends_a_call_blocked_on_a_stuck_peer_with_one_line():
    import subprocess

    silent, held, address = _server(None)
    victim = subprocess.Popen(["sleep", "60"])
    guard = _guard_for(victim.pid, address)
    try:
        guard.stdin.write(b"arm the checkpoint save at step 300\trelaunch to resume from 200\n")
        guard.stdin.flush()
        # Past 1 s armed, the probe (2 x 1.5 s) finds worker:0 stuck.
        assert victim.wait(timeout=30) == -9
        err = guard.communicate(timeout=10)[1].decode()
        lines = [l for l in err.splitlines() if l.strip()]
        assert len(lines) == 1, err
        assert lines[0].startswith("error: chief:0: the checkpoint save at step 300 has waited "
                                   "over 1s (--stuck-timeout)"), lines[0]
        assert f"stuck tasks (they accept connections but do not answer): worker:0 " \
               f"({address})" in lines[0] and lines[0].endswith("relaunch to resume from 200")
    finally:
        victim.kill()
        victim.wait()
        guard.kill()
        guard.wait()
        silent.close()
        for conn in held:
            conn.close()


@pytest.mark.timeout(60)
def test_the_guard_leaves_a_slow_call_whose_peers_answer_and_ends_with_the_pipe():
    import subprocess
    import time

    ok, held, address = _server(OK_REPLY)
    victim = subprocess.Popen(["sleep", "60"])
    guard = _guard_for(victim.pid, address, timeout="0.5")
    try:
        guard.stdin.write(b"arm a slow save\tnothing\n")
        guard.stdin.flush()
        # Several rounds of 0.5 s and a probe: every peer answers, so it waits on.
        deadline = time.monotonic() + 4
        while time.monotonic() < deadline:
            assert victim.poll() is None and guard.poll() is None
            time.sleep(0.2)
        guard.stdin.write(b"disarm\n")
        guard.stdin.close()  # the task's close(): the guard ends
        assert guard.wait(timeout=10) == 0
        assert victim.poll() is None
        assert guard.stderr.read() == b""
    finally:
        victim.kill()
        victim.wait()
        guard.kill()
        guard.wait()
        ok.close()
        for conn in held:
            conn.close()
