"""A probe table of bad input: every row one `error:` line, exit 2, nothing written.

Each row goes through ``train.py --dry-run`` as a user would run it: a
``TF_CONFIG`` in the environment, flags on the command line, the working
directory a fresh temporary one and ``--model-dir`` inside it. Most rows run
in this process (``train.main``, with the environment patched and every byte
written to fd 1 and 2 captured); the rows in ``SUBPROCESS`` also run as a real
``python train.py`` to prove the end-to-end path (exit status, stderr).

``GOOD`` rows must plan (exit 0, the plan as JSON). ``FLAG_LIMITS`` rows
are values argparse accepts but the run cannot use (non-finite numbers,
out-of-range seeds, absurd lengths): ``TrainConfig.validate`` refuses them.

The cases after the table (TF_CONFIG, flags and run directories given
through ``train.main``, and a few as real commands): exit code 2, one
'error:' line naming the input, the model dir untouched.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field

import pytest

from tfdist.cli import train
from conftest import REPO, child_env


TIMEOUT = 30.0  # seconds, for one row


@dataclass(frozen=True)
class Row:
    id: str
    tf_config: object = None  # None: unset; a str as is; anything else json.dumps'd
    argv: tuple[str, ...] = ()
    words: tuple[str, ...] = field(default=())  # the error line must contain each
    files: tuple[str, ...] = ()  # regular files made (relative to the cwd) before the row runs

    @property
    def env_value(self) -> str | None:
        if self.tf_config is None or isinstance(self.tf_config, str):
            return self.tf_config
        return json.dumps(self.tf_config)


def tfc(cluster, task_type="worker", index=0, **extra):
    return {"cluster": cluster, "task": {"type": task_type, "index": index}, **extra}


def workers(*addresses, task_type="worker", index=0, **extra):
    return tfc({"worker": list(addresses)}, task_type, index, **extra)


W2 = ["localhost:2222", "localhost:2223"]
PS = {"chief": ["localhost:2221"], "worker": ["localhost:2222"], "ps": ["localhost:2223"]}
PS_FREE = {"chief": ["localhost:2221"], "worker": ["localhost:2222", "localhost:2223"]}
DEEP = "[" * 50_000 + "]" * 50_000  # an environment variable holds at most 128 KiB
DEEP_OBJECT = '{"cluster": ' * 3000 + "{}" + "}" * 3000

BAD_TF_CONFIG = [
    # The JSON itself.
    Row("json-truncated", '{"cluster": {"worker": [', words=("not valid JSON",)),
    Row("json-empty-object", "{}", words=("no 'cluster'",)),
    Row("json-a-list", "[]", words=("must be a JSON object",)),
    Row("json-a-number", "2222", words=("must be a JSON object",)),
    Row("json-a-string", '"worker"', words=("must be a JSON object",)),
    Row("json-null", "null", words=("must be a JSON object",)),
    Row("json-deep-list", DEEP, words=("nested too deeply",)),
    Row("json-deep-object", DEEP_OBJECT, words=("nested too deeply",)),
    Row("json-huge-integer", '{"cluster": {"worker": ["a:1"]}, "task": {"type": "worker", "index": '
        + "9" * 5000 + "}}", words=("cannot be read", "digits")),
    Row("json-duplicate-key", '{"cluster": {"worker": ["localhost:1"]}, "cluster": {"ps": ["x:1"]}, '
        '"task": {"type": "worker"}}', words=("'cluster' twice",)),
    Row("json-lone-surrogate", '{"cluster": {"worker": ["\\ud800:1"]}, "task": {"type": "worker"}}',
        words=("cluster.worker[0]", "control characters")),
    Row("unknown-top-key", {**workers(*W2), "tasks": {}}, words=("unknown key(s)", "'tasks'")),
    # The cluster.
    Row("cluster-a-list", {"cluster": W2, "task": {"type": "worker", "index": 0}},
        words=("TF_CONFIG cluster is", "non-empty object")),
    Row("cluster-empty", tfc({}), words=("non-empty object",)),
    Row("role-unknown", tfc({"worker": W2, "master": ["localhost:1"]}), words=("'master'", "allowed roles")),
    Row("role-empty-list", tfc({"worker": []}), words=("cluster.worker is []",)),
    Row("role-a-string", tfc({"worker": "localhost:2222"}), words=("cluster.worker is 'localhost:2222'",)),
    Row("two-chiefs", tfc({"chief": W2, "worker": ["localhost:1"]}, "chief"), words=("at most 1 chief",)),
    Row("ps-without-worker", tfc({"chief": ["localhost:1"], "ps": ["localhost:2"]}, "chief"),
        words=("no worker", "at least one worker")),
    Row("ps-only", tfc({"ps": ["localhost:2"]}, "ps"), words=("no worker",)),
    # Addresses.
    Row("address-a-number", workers(2222), words=("cluster.worker[0] is 2222",)),
    Row("address-null", workers(None), words=("cluster.worker[0] is None",)),
    Row("address-empty", workers(""), words=("cluster.worker[0] is ''",)),
    Row("address-no-port", workers("localhost"), words=("no port",)),
    Row("address-empty-port", workers("localhost:"), words=("the port ''",)),
    Row("address-no-host", workers(":2222"), words=("host is missing",)),
    Row("port-zero", workers("localhost:0"), words=("the port '0'", "1 to 65535")),
    Row("port-65536", workers("localhost:65536"), words=("the port '65536'",)),
    Row("port-negative", workers("localhost:-1"), words=("the port '-1'",)),
    Row("port-plus-sign", workers("localhost:+22"), words=("the port '+22'",)),
    Row("port-superscript-two", workers("localhost:\u00b2"), words=("the port",)),
    Row("port-arabic-indic-digits", workers("localhost:\u0662\u0662\u0662\u0662"), words=("the port",)),
    Row("port-leading-zeros", workers("localhost:02222"), words=("leading zeros", "'localhost:2222'")),
    Row("port-a-name", workers("localhost:http"), words=("the port 'http'",)),
    Row("scheme-grpc", workers("grpc://localhost:2222"), words=("scheme prefix 'grpc://'", "'localhost:2222'")),
    Row("scheme-http-with-path", workers("http://localhost:2222/"), words=("scheme prefix", "'localhost:2222'")),
    Row("host-empty-label", workers("host..example:2222"), words=("empty label",)),
    Row("host-leading-dot", workers(".example:2222"), words=("empty label",)),
    Row("host-label-64-chars", workers("a" * 64 + ".example:2222"), words=("64 characters", "at most 63")),
    Row("host-name-254-chars", workers(".".join(["a" * 50] * 5) + ".abc:2222"), words=("at most 253",)),
    Row("host-with-space", workers("local host:2222"), words=("spaces",)),
    Row("host-with-newline", workers("localhost\n:2222"), words=("control characters",)),
    Row("host-leading-space", workers(" localhost:2222"), words=("spaces",)),
    Row("host-hyphen-at-end", workers("node-:2222"), words=("'node-'", "start or end with '-'")),
    Row("host-slash", workers("node/1:2222"), words=("'node/1'",)),
    Row("host-non-ascii", workers("b\u00fccher.example:2222"), words=("not ASCII", "xn--bcher-kva.example")),
    Row("host-non-ascii-no-idna", workers("\u00e9" * 70 + ":2222"), words=("not ASCII", "no IDNA")),
    Row("host-short-ipv4", workers("127.1:2222"), words=("not a valid IPv4",)),
    Row("host-ipv4-leading-zeros", workers("127.000.000.001:2222"), words=("not a valid IPv4",)),
    Row("host-unspecified-ipv4", workers("0.0.0.0:2222"), words=("0.0.0.0", "connect to")),
    Row("host-unspecified-ipv6", workers("[::]:2222"), words=(":: is not", "connect to")),
    Row("ipv6-without-brackets", workers("::1:2222"), words=("in brackets",)),
    Row("ipv6-no-port", workers("[::1]"), words=("'[address]:port'",)),
    Row("ipv6-bad", workers("[::g]:2222"), words=("not an IPv6 address",)),
    Row("ipv4-in-brackets", workers("[127.0.0.1]:2222"), words=("not an IPv6 address",)),
    Row("duplicate-same-text", workers("localhost:2222", "localhost:2222"), words=("used twice",)),
    Row("duplicate-port-zeros-vs-plain", workers("node:2222", "node:02222"), words=("leading zeros",)),
    Row("duplicate-upper-lower", workers("Node-1:2222", "node-1:2222"), words=("same host:port",)),
    Row("duplicate-trailing-dot", workers("node.example:2222", "node.example.:2222"), words=("same host:port",)),
    Row("duplicate-localhost-127", workers("localhost:2222", "127.0.0.1:2222"), words=("same host:port", "loopback")),
    Row("duplicate-ipv6-loopback", workers("[::1]:2222", "[0:0:0:0:0:0:0:1]:2222"), words=("same host:port",)),
    Row("duplicate-across-roles", tfc({"chief": ["localhost:2222"], "worker": ["LOCALHOST:2222"]}, "chief"),
        words=("chief:0", "worker:0", "same host:port")),
    # The task.
    Row("task-missing", {"cluster": {"worker": W2}}, words=("no 'task'",)),
    Row("task-a-string", {"cluster": {"worker": W2}, "task": "worker"}, words=("TF_CONFIG task is 'worker'",)),
    Row("task-a-list", {"cluster": {"worker": W2}, "task": ["worker", 0]}, words=("TF_CONFIG task is",)),
    Row("task-type-a-list", workers(*W2, task_type=["worker"]), words=("task.type is ['worker']",)),
    Row("task-type-a-dict", workers(*W2, task_type={"worker": 0}), words=("task.type is",)),
    Row("task-type-missing", {"cluster": {"worker": W2}, "task": {"index": 0}}, words=("task.type is None",)),
    Row("task-type-not-in-cluster", workers(*W2, task_type="ps"), words=("'ps'", "allowed: worker")),
    Row("task-type-uppercase", workers(*W2, task_type="Worker"), words=("'Worker'",)),
    Row("task-unknown-key", {"cluster": {"worker": W2}, "task": {"type": "worker", "idx": 1}},
        words=("unknown key(s) ['idx']",)),
    Row("index-float-string", workers(*W2, index="1.0"), words=("'1.0'", "integer")),
    Row("index-word", workers(*W2, index="one"), words=("'one'",)),
    Row("index-padded-string", workers(*W2, index=" 1"), words=("' 1'",)),
    Row("index-leading-zero-string", workers(*W2, index="01"), words=("'01'",)),
    Row("index-superscript-string", workers(*W2, index="\u00b9"), words=("task.index",)),
    Row("index-true", workers(*W2, index=True), words=("True",)),
    Row("index-float", workers(*W2, index=1.5), words=("1.5",)),
    Row("index-integral-float", workers(*W2, index=1.0), words=("1.0",)),
    Row("index-null", workers(*W2, index=None), words=("None",)),
    Row("index-negative", workers(*W2, index=-1), words=("index is -1", "0 to 1")),
    Row("index-out-of-range", workers(*W2, index=2), words=("index is 2",)),
    Row("index-string-out-of-range", workers(*W2, index="7"), words=("index is 7",)),
    Row("index-huge", workers(*W2, index=10 ** 400), words=("out of range",)),
    Row("index-infinity", '{"cluster": {"worker": ["localhost:1"]}, "task": {"type": "worker", "index": Infinity}}',
        words=("inf",)),
    Row("evaluator-index-1-outside", tfc(PS, "evaluator", 1), words=("index is 1",)),
    # The other keys.
    Row("environment-a-list", workers(*W2, environment=["cloud"]), words=("environment is ['cloud']",)),
    Row("environment-a-number", workers(*W2, environment=1), words=("environment is 1",)),
    Row("environment-long", workers(*W2, environment="c" * 5000), words=("environment is", "...")),
    Row("environment-newline", workers(*W2, environment="cloud\nx"), words=("environment is",)),
    Row("rpc-layer-other", workers(*W2, rpc_layer="grpc+verbs"), words=("rpc_layer is 'grpc+verbs'", "gRPC")),
    Row("rpc-layer-empty", workers(*W2, rpc_layer=""), words=("rpc_layer is ''",)),
    Row("rpc-layer-a-number", workers(*W2, rpc_layer=1), words=("rpc_layer is 1",)),
    # Clipping: a megabyte of TF_CONFIG still gives a short line.
    # (An environment variable holds at most 128 KiB.)
    Row("long-address", workers("x" * 100_000 + ":2222"), words=("at most 253",)),
    Row("long-role-name", tfc({"w" * 100_000: W2}), words=("allowed roles",)),
    Row("long-json-garbage", "{" + "x" * 1_000_000, words=("not valid JSON",)),
]

BAD_FLAGS = [
    Row("flag-unknown", None, ("--learning-rat=1",), ("--learning-rat", "--help")),
    Row("flag-positional", None, ("extra",), ("unrecognized arguments: extra",)),
    Row("flag-missing-value", None, ("--epochs",), ("--epochs", "expected one argument")),
    Row("flag-abbreviated", None, ("--epoch=1",), ("--epoch",)),
    Row("flag-dry-run-with-value", None, ("--dry-run=1",), ("--dry-run",)),
    Row("strategy-unknown", None, ("--strategy=horovod",), ("'horovod'",)),
    Row("strategy-empty", None, ("--strategy=",), ("''",)),
    Row("model-unknown", None, ("--model=resnet",), ("'resnet'", "cnn, logreg")),
    Row("optimizer-unknown", None, ("--optimizer=rmsprop",), ("'rmsprop'", "adam, sgd")),
    Row("lr-schedule-unknown", None, ("--lr-schedule=linear",), ("'linear'",)),
    Row("all-reduce-unknown", None, ("--all-reduce=mpi",), ("'mpi'",)),
    Row("gradient-dtype-unknown", None, ("--gradient-dtype=int8",), ("'int8'", "bfloat16")),
    Row("gradient-dtype-float16", None, ("--gradient-dtype=float16",), ("loss scaling", "bfloat16")),
    Row("epochs-zero", None, ("--epochs=0",), ("--epochs=0", "greater than 0")),
    Row("epochs-negative", None, ("--epochs=-3",), ("--epochs=-3",)),
    Row("epochs-float", None, ("--epochs=1.5",), ("'1.5'",)),
    Row("steps-zero", None, ("--steps=0",), ("--steps=0",)),
    Row("steps-word", None, ("--steps=ten",), ("'ten'",)),
    Row("steps-exponent", None, ("--steps=1e3",), ("'1e3'",)),
    Row("batch-zero", None, ("--global-batch-size=0",), ("--global-batch-size=0",)),
    Row("batch-negative", None, ("--global-batch-size=-128",), ("--global-batch-size=-128",)),
    Row("learning-rate-zero", None, ("--learning-rate=0",), ("--learning-rate=0",)),
    Row("learning-rate-negative", None, ("--learning-rate=-0.1",), ("--learning-rate=-0.1",)),
    Row("learning-rate-nan", None, ("--learning-rate=nan",), ("--learning-rate=nan",)),
    Row("learning-rate-word", None, ("--learning-rate=fast",), ("'fast'",)),
    Row("seed-float", None, ("--seed=1.5",), ("'1.5'",)),
    Row("steps-per-execution-zero", None, ("--steps-per-execution=0",), ("--steps-per-execution=0",)),
    Row("log-every-zero", None, ("--log-every=0",), ("--log-every=0",)),
    Row("eval-every-negative", None, ("--eval-every=-1",), ("--eval-every=-1",)),
    Row("checkpoint-every-zero", None, ("--checkpoint-every=0",), ("--checkpoint-every=0",)),
    Row("ps-shards-two", None, ("--ps-shards=2",), ("--ps-shards=2",)),
    Row("ps-shards-zero", None, ("--ps-shards=0",), ("--ps-shards=0",)),
    Row("startup-timeout-zero", None, ("--startup-timeout=0",), ("--startup-timeout=0",)),
    Row("startup-timeout-negative", None, ("--startup-timeout=-5",), ("--startup-timeout=-5",)),
    Row("startup-timeout-nan", None, ("--startup-timeout=nan",), ("--startup-timeout=nan",)),
    Row("cluster-resolver-unknown", None, ("--cluster-resolver=k8s",), ("'k8s'", "tf_config, slurm")),
    Row("slurm-ps-without-slurm", None, ("--slurm-ps=1",), ("--slurm-ps", "--cluster-resolver=slurm")),
    Row("slurm-resolver-without-step", None, ("--cluster-resolver=slurm",), ("no Slurm job step",)),
    # Flags against the cluster.
    Row("ps-strategy-without-ps", workers(*W2), ("--strategy=ps",), ("'ps' job",)),
    Row("ps-strategy-without-chief", tfc({"worker": ["localhost:1"], "ps": ["localhost:2"]}), ("--strategy=ps",),
        ("'chief'",)),
    Row("multiworker-with-ps", tfc(PS, "worker"), ("--strategy=multiworker",), ("--strategy=ps",)),
    Row("mirrored-with-cluster", workers(*W2), ("--strategy=mirrored",), ("2 tasks",)),
    Row("none-with-cluster", workers(*W2), ("--strategy=none",), ("2 tasks",)),
    Row("batch-not-divisible", workers("localhost:1", "localhost:2", "localhost:3"),
        ("--strategy=multiworker", "--global-batch-size=100"), ("--global-batch-size=100", "3 replica")),
    Row("slurm-with-tf-config", workers(*W2), ("--cluster-resolver=slurm",), ("no Slurm job step",)),
    # --shard-state: an unknown level, a strategy without data-parallel workers, what
    # the sharded update cannot combine with.
    Row("shard-state-unknown", workers(*W2), ("--shard-state=zero1",),
        ("'zero1'", "off, optimizer, gradients, weights")),
    Row("shard-state-under-none", None, ("--strategy=none", "--shard-state=optimizer"),
        ("--shard-state optimizer", "--strategy none", "--strategy multiworker")),
    Row("shard-state-under-mirrored", None, ("--strategy=mirrored", "--shard-state=gradients"),
        ("--strategy mirrored", "one process's devices")),
    Row("shard-state-under-ps", tfc(PS, "chief"), ("--strategy=ps", "--shard-state=optimizer"),
        ("--strategy ps", "ps tasks hold")),
    Row("shard-state-under-pipeline", tfc(PS_FREE, "chief"), ("--strategy=pipeline",
                                                              "--shard-state=optimizer"),
        ("--strategy pipeline", "stage")),
    Row("shard-state-carried", workers(*W2), ("--shard-state=optimizer", "--carry-all-reduce=on"),
        ("--carry-all-reduce on", "reduce-scatter")),
]

BAD = BAD_TF_CONFIG + BAD_FLAGS

# Also run as real processes: inputs that once escaped as tracebacks or hangs, and one of each kind.
SUBPROCESS = (
    "host-empty-label", "host-label-64-chars", "ps-without-worker", "scheme-grpc",
    "port-arabic-indic-digits", "duplicate-port-zeros-vs-plain", "task-type-a-list",
    "json-deep-list", "port-superscript-two", "index-float-string", "long-address",
    "learning-rate-nan", "flag-unknown", "epochs-zero",
)

GOOD = [
    Row("no-tf-config"),
    Row("index-numeric-string", workers(*W2, index="1")),
    Row("index-string-zero", workers(*W2, index="0")),
    Row("ipv6-loopback", workers("[::1]:2222", "[::1]:2223")),
    Row("ipv6-zone", workers("[fe80::1%eth0]:2222", "[fe80::2%eth0]:2222")),
    Row("ipv4-and-names", workers("127.0.0.1:2222", "node-1.example.com:2222", "node_2:65535"),
        argv=("--global-batch-size=96",)),
    Row("uppercase-hosts", workers("NODE-1:2222", "NODE-2:2222")),
    Row("fully-qualified-trailing-dot", workers("node-1.example.com.:2222", "node-2.example.com.:2222")),
    Row("kubeflow-environment", workers(*W2, index=1, environment="cloud")),
    Row("rpc-layer-grpc", workers(*W2, rpc_layer="grpc")),
    Row("trial-key", {"cluster": {"worker": W2}, "task": {"type": "worker", "index": 0, "trial": "3"}}),
    Row("ps-chief", tfc(PS, "chief")),
    Row("ps-worker-index-string", tfc(PS, "worker", "0")),
    Row("evaluator-outside-cluster", tfc(PS, "evaluator", environment="cloud")),
    Row("three-workers-explicit-batch", workers("localhost:1", "localhost:2", "localhost:3"),
        argv=("--global-batch-size=96",)),
    Row("shard-state-optimizer", workers(*W2), argv=("--shard-state=optimizer",)),
    Row("shard-state-gradients-bfloat16", workers(*W2),
        argv=("--shard-state=gradients", "--gradient-dtype=bfloat16")),
]

# Flags argparse accepts but the run cannot use; TrainConfig.validate refuses them.
FLAG_LIMITS = [
    Row("learning-rate-inf", None, ("--learning-rate=inf",), ("--learning-rate",)),
    Row("learning-rate-overflow", None, ("--learning-rate=1e309",), ("--learning-rate",)),
    Row("seed-negative", None, ("--seed=-1",), ("--seed",)),
    Row("seed-2-to-32", None, ("--seed=4294967296",), ("--seed",)),
    Row("startup-timeout-inf", None, ("--startup-timeout=inf",), ("--startup-timeout",)),
    Row("epochs-huge", None, ("--epochs=1000000000000",), ("--epochs",)),
    Row("steps-huge", None, ("--steps=1000000000000000000000",), ("--steps",)),
    Row("batch-larger-than-dataset", None, ("--global-batch-size=60001",), ("--global-batch-size",)),
    Row("model-dir-empty", None, ("--model-dir=",), ("--model-dir",)),
]


# --model-dir paths the chief could never write: refused before TensorFlow
# starts (the dry run refuses them too), and the probe leaves nothing behind.
MODEL_DIRS = [
    Row("model-dir-under-proc", None, ("--model-dir=/proc/x/run",),
        ("'/proc/x/run'", "not a writable directory")),
    Row("model-dir-under-a-file", None, ("--model-dir=afile/run",), ("'afile/run'", "not a directory"),
        files=("afile",)),
    Row("model-dir-under-dev-null", None, ("--model-dir=/dev/null/run",), ("'/dev/null'", "not a directory")),
    Row("model-dir-name-too-long", None, ("--model-dir=" + "x" * 300,), ("File name too long",)),
    Row("model-dir-nul-byte", None, ("--model-dir=run\0x",), ("null byte",)),
    Row("model-dir-deep-under-file", None, ("--model-dir=afile/a/b/c",), ("'afile' is not a directory",),
        files=("afile",)),
]


def _ids(rows):
    return [r.id for r in rows]


def snapshot(root):
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*"))


def run_in_process(row: Row, tmp_path, monkeypatch, capfd):
    """``train.main`` as ``python train.py`` would call it; (code, out, err, seconds)."""
    monkeypatch.chdir(tmp_path)
    for name in row.files:
        (tmp_path / name).write_text("x")
    if row.env_value is None:
        monkeypatch.delenv("TF_CONFIG", raising=False)
    else:
        monkeypatch.setenv("TF_CONFIG", row.env_value)
    argv = [*row.argv, "--dry-run"]
    if not any(a.startswith("--model-dir") for a in argv):
        argv += ["--model-dir", str(tmp_path / "run")]
    started = time.monotonic()
    code = train.main(argv)
    took = time.monotonic() - started
    out, err = capfd.readouterr()
    return code, out, err, took


def assert_one_error_line(row: Row, code, out, err):
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert "Traceback" not in out + err, err
    assert code == 2, f"exit {code}; stderr:\n{err[-2000:]}\nstdout:\n{out[-500:]}"
    assert len(errors) == 1, err[-2000:]
    assert len(errors[0]) < 600, f"error line of {len(errors[0])} characters: {errors[0][:300]}..."
    for word in row.words:
        assert word in errors[0], f"{word!r} not in {errors[0]!r}"


def test_the_table_is_broad():
    assert len(BAD) >= 60
    everything = BAD + GOOD + FLAG_LIMITS + MODEL_DIRS
    assert len(set(_ids(everything))) == len(everything)
    assert set(SUBPROCESS) <= set(_ids(BAD))


@pytest.mark.parametrize("row", BAD, ids=_ids(BAD))
def test_bad_input_in_process(row, tmp_path, monkeypatch, capfd):
    before = snapshot(tmp_path)
    code, out, err, took = run_in_process(row, tmp_path, monkeypatch, capfd)
    assert_one_error_line(row, code, out, err)
    assert snapshot(tmp_path) == before
    assert took < TIMEOUT


PROCESS_ROWS = [(r, dry) for r in BAD if r.id in SUBPROCESS
                for dry in ((True, False) if r in BAD_TF_CONFIG else (True,))]


@pytest.mark.parametrize("row,dry_run", PROCESS_ROWS,
                         ids=[f"{r.id}{'' if dry else '-real-run'}" for r, dry in PROCESS_ROWS])
def test_bad_input_as_a_process(row, dry_run, tmp_path):
    """A bad TF_CONFIG also stops a real run (no --dry-run) before anything starts."""
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    started = time.monotonic()
    proc = subprocess.run(
        [sys.executable, str(REPO / "train.py"), *row.argv, *(["--dry-run"] if dry_run else []),
         "--model-dir", str(cwd / "run")],
        cwd=cwd, env=child_env(tf_config=row.env_value), capture_output=True, text=True,
        errors="replace", timeout=TIMEOUT,
    )
    assert time.monotonic() - started < TIMEOUT
    assert_one_error_line(row, proc.returncode, proc.stdout, proc.stderr)
    assert proc.stdout == ""
    assert snapshot(cwd) == []


@pytest.mark.parametrize("row", GOOD, ids=_ids(GOOD))
def test_good_input_plans(row, tmp_path, monkeypatch, capfd):
    code, out, err, took = run_in_process(row, tmp_path, monkeypatch, capfd)
    assert code == 0, err[-2000:]
    assert not [line for line in err.splitlines() if line.startswith("error:")]
    plan = json.loads(out.strip().splitlines()[-1])
    assert plan["model_dir"] == str(tmp_path / "run")
    # --dry-run shows the level the run would shard its state at.
    asked = [a.split("=", 1)[1] for a in row.argv if a.startswith("--shard-state=")]
    assert plan["shard_state"] == (asked[0] if asked else "off")
    if row.env_value is not None:
        task = json.loads(row.env_value)["task"]
        assert plan["task"] == f"{task['type']}:{int(task.get('index', 0))}"
    assert snapshot(tmp_path) == []  # a dry run writes nothing
    assert took < TIMEOUT


@pytest.mark.parametrize("row", FLAG_LIMITS, ids=_ids(FLAG_LIMITS))
def test_flag_limits_are_refused(row, tmp_path, monkeypatch, capfd):
    before = snapshot(tmp_path)
    code, out, err, took = run_in_process(row, tmp_path, monkeypatch, capfd)
    assert_one_error_line(row, code, out, err)
    assert snapshot(tmp_path) == before
    assert took < TIMEOUT


@pytest.mark.parametrize("row", MODEL_DIRS, ids=_ids(MODEL_DIRS))
def test_unusable_model_dir_is_refused(row, tmp_path, monkeypatch, capfd):
    before = snapshot(tmp_path) + [f for f in row.files if f not in snapshot(tmp_path)]
    code, out, err, took = run_in_process(row, tmp_path, monkeypatch, capfd)
    assert_one_error_line(row, code, out, err)
    assert snapshot(tmp_path) == sorted(before)
    assert took < TIMEOUT


def test_unusable_model_dir_is_refused_before_tensorflow_starts(tmp_path):
    """A real run (no --dry-run) of every row stops without importing TensorFlow."""
    (tmp_path / "afile").write_text("x")
    rows = [r for r in MODEL_DIRS if "\0" not in r.argv[0]]  # argv cannot carry NUL
    script = (
        "import sys, train\n"
        "codes = [int(train.main([arg, '--strategy=none'])) for arg in sys.argv[1:]]\n"
        "assert 'tensorflow' not in sys.modules, 'TensorFlow was imported'\n"
        "print(codes)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", script, *[r.argv[0] for r in rows]], cwd=tmp_path,
        env=child_env(PYTHONPATH=str(REPO)), capture_output=True, text=True, timeout=TIMEOUT,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == str([2] * len(rows))
    errors = [l for l in proc.stderr.splitlines() if l.startswith("error:")]
    assert len(errors) == len(rows) and "Traceback" not in proc.stderr, proc.stderr
    assert snapshot(tmp_path) == ["afile"]


# --- the launcher's own flags, and a task's flags passed through it ------------------------

LAUNCH_BAD = [
    ("timeout-negative", ["--timeout", "-5"], "--timeout=-5"),
    ("timeout-nan", ["--timeout", "nan"], "--timeout=nan"),
    ("timeout-inf", ["--timeout", "inf"], "--timeout=inf"),
    ("grace-negative", ["--grace", "-1"], "--grace=-1"),
    ("restart-delay-nan", ["--restart-delay", "nan"], "--restart-delay=nan"),
    ("max-restarts-negative", ["--max-restarts", "-1"], "--max-restarts=-1"),
    ("workers-zero", ["--workers", "0"], "--workers=0"),
    ("hosts-negative", ["--hosts", "-1"], "--hosts=-1"),
    ("strategy-unknown", ["--strategy", "horovod"], "unknown --strategy"),
    ("kill-unknown-task", ["--kill", "worker:7@step=3"], "worker:7"),
    ("slow-fraction-zero", ["--slow", "worker:1=0"], "worker:1=0"),
    ("train-flag-bad", ["--", "--learning-rate", "inf"], "--learning-rate=inf"),
    ("train-flag-unknown", ["--", "--epoch", "1"], "--epoch"),
    ("train-strategy-twice", ["--", "--strategy", "ps"], "pass --strategy to launch.py"),
    ("train-dry-run-after", ["--", "--dry-run"], "pass --dry-run to launch.py"),
]


@pytest.mark.parametrize("argv,word", [r[1:] for r in LAUNCH_BAD], ids=[r[0] for r in LAUNCH_BAD])
def test_bad_launch_input_is_one_line_exit_2_nothing_written(argv, word, tmp_path, monkeypatch,
                                                             capfd):
    from tfdist.cli import launch

    monkeypatch.chdir(tmp_path)
    if "--strategy" not in argv[:argv.index("--") if "--" in argv else len(argv)]:
        argv = ["--strategy", "multiworker", *argv]
    started = time.monotonic()
    code = launch.main(argv)
    out, err = capfd.readouterr()
    assert code == 2, out + err
    assert "Traceback" not in out + err
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and word in lines[0], err
    assert list(tmp_path.iterdir()) == []
    assert time.monotonic() - started < TIMEOUT


def test_tasks_that_disagree_on_the_cluster_get_tensorflows_reason_in_one_line():
    from tfdist.training.loop.survival.recovery import cluster_disagreement

    # The text TensorFlow 2.21 raised when worker:0 saw 2 workers and worker:1 saw 3.
    tf_text = ("{{function_node __wrapped__CollectiveBcastSend_device_/job:worker/replica:0/task:0"
               "/device:CPU:0}} Collective ops is aborted by: Device /job:worker/replica:0/task:1/"
               "device:CPU:0 is joining a group with size3, but that group has size 2 "
               "(group_key=1)\nThe error could be from a previous operation. [Op:CollectiveBcastSend]")
    line = cluster_disagreement(RuntimeError(tf_text))
    assert line is not None and "\n" not in line
    assert "is joining a group with size3, but that group has size 2" in line
    assert "same TF_CONFIG" in line
    assert cluster_disagreement(RuntimeError("Connection reset by peer")) is None


def tf_config_json(cluster, task_type="worker", index=0):
    return json.dumps({"cluster": cluster, "task": {"type": task_type, "index": index}})


TWO_WORKERS = {"worker": ["localhost:2222", "localhost:2223"]}
PS_NO_CHIEF = {"worker": ["localhost:2222"], "ps": ["localhost:2223"]}

# (case id, TF_CONFIG or None, extra argv, words the message must contain)
CASES = [
    ("invalid-json", '{"cluster": {"worker": [', [], ["not valid JSON", '{"cluster"']),
    ("cluster-missing", json.dumps({"task": {"type": "worker", "index": 0}}), [], ["no 'cluster'", "expected"]),
    ("task-missing", json.dumps({"cluster": TWO_WORKERS}), [], ["no 'task'", "expected"]),
    ("task-type-not-in-cluster", tf_config_json(TWO_WORKERS, "chief"), [], ["'chief'", "allowed: worker"]),
    ("index-out-of-range", tf_config_json(TWO_WORKERS, "worker", 2), [], ["index is 2", "0 to 1"]),
    # "1" is accepted, as TensorFlow's resolver accepts it; "1.0" is not.
    ("index-not-int", tf_config_json(TWO_WORKERS, "worker", "1.0"), [], ["'1.0'", "integer"]),
    ("index-bool", tf_config_json(TWO_WORKERS, "worker", True), [], ["True", "integer"]),
    ("duplicate-address", tf_config_json({"worker": ["localhost:2222", "localhost:2222"]}), [],
     ["'localhost:2222' is used twice", "own host:port"]),
    ("address-without-port", tf_config_json({"worker": ["localhost"]}), [], ["'localhost'", "host:port"]),
    ("unknown-role", tf_config_json({"worker": ["a:1"], "master": ["b:1"]}), [], ["'master'", "allowed roles"]),
    ("ps-without-ps-job", tf_config_json(TWO_WORKERS), ["--strategy=ps"], ["'ps' job", "multiworker"]),
    ("multiworker-with-ps-job", tf_config_json(PS, "worker"), ["--strategy=multiworker"], ["1 ps task", "--strategy=ps"]),
    ("ps-without-chief", tf_config_json(PS_NO_CHIEF, "worker"), ["--strategy=ps"], ["'chief'", "received roles"]),
    ("mirrored-with-cluster", tf_config_json(TWO_WORKERS), ["--strategy=mirrored"], ["2 tasks", "multiworker"]),
    ("unknown-strategy", None, ["--strategy=horovod"], ["'horovod'", "auto, none, mirrored, multiworker, ps"]),
    ("batch-not-divisible", tf_config_json({"worker": ["a:1", "b:1", "c:1"]}), ["--strategy=multiworker", "--global-batch-size=128"],
     ["128", "3 replica", "multiple of 3"]),
    ("unknown-model", None, ["--model=resnet"], ["'resnet'", "cnn, logreg"]),
    ("unknown-lr-schedule", None, ["--lr-schedule=linear"], ["'linear'", "cosine, constant"]),
    ("zero-epochs", None, ["--epochs=0"], ["--epochs=0", "greater than 0"]),
    ("non-int-steps", None, ["--steps=ten"], ["'ten'", "--help"]),
    ("ps-shards-is-gone", None, ["--ps-shards=2"], ["--ps-shards", "--help"]),
    ("unknown-flag", None, ["--learning-rat=1"], ["--learning-rat", "--help"]),
]


@pytest.fixture
def model_dir(tmp_path):
    """An existing run directory: bad input must leave it exactly as it was."""
    d = tmp_path / "run"
    d.mkdir()
    (d / "results.json").write_text('{"keep": true}\n')
    return d


def snapshot_bytes(d):
    return sorted((p.relative_to(d).as_posix(), p.read_bytes()) for p in d.rglob("*") if p.is_file())


@pytest.mark.parametrize("case,tf_config,argv,words", CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_one_line_and_exit_2(case, tf_config, argv, words, model_dir, monkeypatch, capsys):
    before = snapshot_bytes(model_dir)
    fresh = model_dir.parent / "fresh"
    if tf_config is None:
        monkeypatch.delenv("TF_CONFIG", raising=False)
    else:
        monkeypatch.setenv("TF_CONFIG", tf_config)
    for target in (model_dir, fresh):
        code = train.main([*argv, "--model-dir", str(target), "--dry-run"])
        err = capsys.readouterr().err
        errors = [line for line in err.splitlines() if line.startswith("error:")]
        assert code == 2, err
        assert len(errors) == 1, err
        assert "Traceback" not in err
        for word in words:
            assert word in errors[0], f"{word!r} not in {errors[0]!r}"
    assert snapshot_bytes(model_dir) == before
    assert not fresh.exists()


def test_model_dir_that_is_a_file(tmp_path, capsys):
    target = tmp_path / "file"
    target.write_text("x")
    assert train.main(["--model-dir", str(target)]) == 2
    assert "is not a directory" in capsys.readouterr().err
    assert target.read_text() == "x"


@pytest.mark.parametrize("stopped", [False, True], ids=["empty", "stopped-download"])
def test_missing_mnist_is_one_line_without_download(tmp_path, stopped):
    """A data dir without MNIST: a pointer to --data-dir, not minutes of retries, and
    nothing else on stderr (with a download that stopped, an empty mnist/3.0.1, tfds
    logs an absl warning of its own first)."""
    empty = tmp_path / "no-data"
    (empty / "mnist" / "3.0.1" if stopped else empty).mkdir(parents=True)
    tmp = tmp_path / "tmp"  # the run's temporary directory: it must stay empty
    tmp.mkdir()
    proc = subprocess.run(
        [sys.executable, str(REPO / "train.py"), "--steps=1", "--data-dir", str(empty),
         "--model-dir", str(tmp_path / "m")],
        env={**child_env(), "TMPDIR": str(tmp)}, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    # tfds leaves an empty directory there whenever the data are missing; ours removes it.
    assert [p.name for p in tmp.iterdir()] == []
    errors = proc.stderr.strip().splitlines()
    assert len(errors) == 1 and errors[0].startswith("error:"), proc.stderr
    assert "--data-dir" in errors[0] and str(empty) in errors[0]
    assert not (tmp_path / "m").exists()


def test_subprocess_exit_code_and_clean_stderr(tmp_path):
    """End to end: the real exit status, and nothing but the error on stderr."""
    proc = subprocess.run(
        [sys.executable, str(REPO / "train.py"), "--strategy=ps", "--model-dir", str(tmp_path / "m")],
        env=child_env(tf_config=tf_config_json(TWO_WORKERS)), capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()]
    assert proc.stderr.startswith("error: --strategy=ps needs a 'ps' job")
    assert not (tmp_path / "m").exists()
