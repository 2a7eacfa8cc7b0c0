"""The launcher's pure stages, without starting any process."""

import json

import pytest

import launch
from strategies import parse_tf_config, resolve_strategy_name


def test_multiworker_cluster_one_tf_config_per_worker():
    tasks = launch.build_cluster("multiworker", 3, ports=[11, 12, 13], host="127.0.0.1")
    assert list(tasks) == ["worker:0", "worker:1", "worker:2"]
    cluster = {"worker": ["127.0.0.1:11", "127.0.0.1:12", "127.0.0.1:13"]}
    for i, (name, tf_config) in enumerate(tasks.items()):
        assert tf_config == {"cluster": cluster, "task": {"type": "worker", "index": i}}
        cfg = parse_tf_config(json.dumps(tf_config))  # our own parser accepts it
        assert cfg.task_name == name and cfg.is_chief == (i == 0)
        assert resolve_strategy_name("auto", cfg) == "multiworker"


def test_ps_cluster_has_a_chief_workers_and_ps():
    tasks = launch.build_cluster("ps", 2, ps=2, ports=[1, 2, 3, 4, 5])
    assert list(tasks) == ["chief:0", "worker:0", "worker:1", "ps:0", "ps:1"]
    assert tasks["ps:1"]["cluster"] == {
        "chief": ["localhost:1"], "worker": ["localhost:2", "localhost:3"],
        "ps": ["localhost:4", "localhost:5"],
    }
    assert tasks["ps:1"]["task"] == {"type": "ps", "index": 1}


def test_mirrored_is_one_task_without_tf_config():
    assert launch.build_cluster("mirrored", 1) == {"local:0": None}


@pytest.mark.parametrize("args,words", [
    (("horovod", 2), "unknown --strategy 'horovod'"),
    (("ps", 2, 0), "--ps >= 1"),
    (("multiworker", 2, 1), "takes no ps tasks"),
    (("multiworker", 0), "at least 1 worker"),
    (("mirrored", 2), "one process"),
])
def test_bad_layouts(args, words):
    with pytest.raises(launch.LaunchError, match=words.replace("(", r"\(")):
        launch.build_cluster(*args, ports=list(range(1, 10)))


def test_free_ports_are_distinct():
    ports = launch.free_ports(5)
    assert len(set(ports)) == 5 and all(0 < p < 65536 for p in ports)


@pytest.mark.parametrize("strategy,exits,expected", [
    ("multiworker", {"worker:0": None, "worker:1": None}, None),
    ("multiworker", {"worker:0": 0, "worker:1": None}, None),
    ("multiworker", {"worker:0": None, "worker:1": -9}, -9),
    ("multiworker", {"worker:0": 0, "worker:1": 0}, 0),
    ("ps", {"chief:0": None, "worker:0": -9, "ps:0": None}, None),  # chief reschedules
    ("ps", {"chief:0": 0, "worker:0": None, "ps:0": None}, 0),
    ("ps", {"chief:0": 1, "worker:0": None, "ps:0": None}, 1),
])
def test_decide(strategy, exits, expected):
    assert launch.decide(strategy, exits) == expected


def test_saved_files_replay_each_task(tmp_path):
    tasks = launch.build_cluster("multiworker", 2, ports=[21, 22])
    cmd = launch.task_command("multiworker", ["--epochs", "1"], python="python")
    launch.save_launch_files(str(tmp_path), tasks, cmd)
    for name, tf_config in tasks.items():
        saved = json.loads((tmp_path / f"{name.replace(':', '-')}.tf_config.json").read_text())
        assert saved == tf_config
    script = (tmp_path / "commands.sh").read_text()
    assert script.count("--strategy=multiworker --epochs 1") == 2
    assert "worker-1.tf_config.json" in script


def _probe(answer):
    calls = []

    def probe():
        calls.append(1)
        return answer
    return probe, calls


@pytest.mark.parametrize("mode,strategy,problem,use,warns,probed", [
    ("auto", "multiworker", None, True, False, True),
    ("on", "ps", None, True, False, True),
    ("auto", "ps", "unshare: Operation not permitted", False, True, True),
    ("off", "multiworker", None, False, False, False),   # no probe, no namespace
    ("auto", "mirrored", None, False, False, False),     # one process opens no port
    ("on", "mirrored", "denied", False, False, False),
])
def test_decide_netns(mode, strategy, problem, use, warns, probed):
    probe, calls = _probe(problem)
    got_use, warning = launch.decide_netns(mode, strategy, probe)
    assert got_use is use
    assert (warning is not None) is warns
    assert bool(calls) is probed
    if warns:
        assert problem in warning and "--netns on" in warning and "\n" not in warning


def test_netns_on_without_namespaces_is_an_error_naming_the_cause():
    probe, _ = _probe("unshare: unshare failed: Operation not permitted")
    with pytest.raises(launch.LaunchError, match="Operation not permitted.*--netns auto"):
        launch.decide_netns("on", "multiworker", probe)
    with pytest.raises(launch.LaunchError, match="unknown --netns 'yes'"):
        launch.decide_netns("yes", "multiworker", probe)


def test_netns_command_reruns_this_launcher_inside_and_keeps_the_train_args():
    cmd = launch.netns_command(["--strategy", "ps", "--ps", "1"], ["--epochs", "1"], python="py")
    assert cmd[:4] == ["unshare", "--user", "--map-root-user", "--net"]
    assert cmd[4:6] == ["py", launch.__file__]
    assert cmd[6:] == ["--strategy", "ps", "--ps", "1", launch.INSIDE_FLAG, "--", "--epochs", "1"]
    args, train_args = launch.parse_args(cmd[6:])
    assert args.netns_inside and train_args == ["--epochs", "1"]


def test_inner_launcher_does_not_decide_again(monkeypatch):
    # Inside the namespace a second unshare would nest namespaces forever.
    monkeypatch.setattr(launch, "netns_problem", lambda: pytest.fail("probed inside"))
    monkeypatch.setattr(launch, "start_tasks", lambda *a, **k: [])
    monkeypatch.setattr(launch, "supervise", lambda *a, **k: 0)
    monkeypatch.setattr(launch, "loopback_up", lambda: None)
    monkeypatch.setattr(launch, "save_launch_files", lambda *a: None)
    monkeypatch.setattr(launch, "run_in_netns", lambda *a: pytest.fail("re-entered"))
    monkeypatch.setattr(launch.signal, "signal", lambda *a: None)  # keep pytest's handlers
    assert launch.main(["--strategy", "multiworker", launch.INSIDE_FLAG, "--", "--steps", "1"]) == 0


def test_mnist_prepared_looks_for_a_tfds_copy(tmp_path):
    assert not launch.mnist_prepared(str(tmp_path))
    (tmp_path / "mnist" / "3.0.1").mkdir(parents=True)
    (tmp_path / "mnist" / "3.0.1" / "dataset_info.json").write_text("{}")
    assert launch.mnist_prepared(str(tmp_path))


def test_thread_env_splits_cores_between_computing_tasks():
    mw = launch.build_cluster("multiworker", 2, ports=[1, 2])
    assert launch.thread_env("multiworker", mw, 8) == {
        "worker:0": {"TF_NUM_INTRAOP_THREADS": "4"}, "worker:1": {"TF_NUM_INTRAOP_THREADS": "4"},
    }
    ps = launch.build_cluster("ps", 3, ps=1, ports=[1, 2, 3, 4, 5])
    env = {n: e["TF_NUM_INTRAOP_THREADS"] for n, e in launch.thread_env("ps", ps, 2).items()}
    # The ps chief only dispatches and the ps only applies updates; never below one thread.
    assert env == {"chief:0": "1", "worker:0": "1", "worker:1": "1", "worker:2": "1", "ps:0": "1"}
    ps6 = {n: e["TF_NUM_INTRAOP_THREADS"] for n, e in launch.thread_env("ps", ps, 6).items()}
    assert ps6["worker:0"] == "2" and ps6["chief:0"] == ps6["ps:0"] == "1"
