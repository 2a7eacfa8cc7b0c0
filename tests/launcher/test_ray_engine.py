"""--engine ray without a cluster (pure, default tier): the flags, what it refuses, the
bundles, the shortage lines, the TF_CONFIGs it builds from placed addresses, and the
one line when Ray is missing. The jobs themselves run in the Ray tier (test_ray.py)."""

from __future__ import annotations

import builtins
import sys

import pytest

from tfdist.cli import launch as launch_cli
from tfdist.launcher import plan as plans
from tfdist.launcher.engine import ray_engine
from tfdist.launcher.config import Cluster, Faults, LaunchRequest, MemberArgs
from tfdist.launcher.job import build_config, run_request
from tfdist.launcher.plan import LaunchError
from tfdist.options import TrainOptions
from tfdist.protocol import Exit
from tfdist.strategies import kinds


def test_flags_reach_the_request():
    args, train = launch_cli.parse_args(["--strategy", "ps", "--ps", "2", "--engine", "ray",
                                         "--address", "auto", "--ray-placement", "strict-spread",
                                         "--", "--steps", "5"])
    request = launch_cli.request_from_args(args, train)
    cluster = request.cluster
    assert (cluster.engine, cluster.address, cluster.ray_placement) == ("ray", "auto",
                                                                         "strict-spread")
    assert LaunchRequest(strategy="ps").cluster.engine == "local"


RAY = dict(engine="ray")


@pytest.mark.parametrize("cluster, faults, dry_run, words", [
    (dict(RAY, hosts=3), {}, False, "--hosts does not apply with --engine ray"),
    (RAY, dict(slow=("worker:0=0.5",)), False, "--slow does not apply"),
    (dict(RAY, link_trace=True), {}, False, "--link-trace does not apply with --engine ray"),
    (RAY, dict(memory_limit=("ps=1G",)), False, "--memory-limit does not apply"),
    (RAY, {}, True, "--dry-run does not apply"),
    (dict(RAY, host="10.0.0.5"), {}, False, "--host does not apply"),
    (dict(address="auto"), {}, False, "--address auto names a Ray cluster; add --engine ray"),
    (dict(ray_placement="pack"), {}, False,
     "--ray-placement pack places Ray actors; add --engine ray"),
    (dict(RAY, ray_placement="diagonal"), {}, False, "--ray-placement 'diagonal' is not known"),
    (dict(engine="yarn"), {}, False, "--engine 'yarn' is not known; use one of local, ray"),
])
def test_what_the_engine_refuses_is_one_line(cluster, faults, dry_run, words):
    request = LaunchRequest(strategy="ps", cluster=Cluster(ps=1, **cluster),
                            faults=Faults(**faults), dry_run=dry_run)
    with pytest.raises(LaunchError) as err:
        build_config(request)
    assert words in str(err.value) and "\n" not in str(err.value)


def test_bundles_ps_cpu_only_workers_get_gpus():
    kind = kinds.get("ps")
    names = plans.member_names(kind, 2, 2)
    gpu = dict(zip(names, ray_engine.bundles_for(kind, names, gpus=4)))
    assert gpu["worker:0"] == {"CPU": 1.0, "GPU": 1.0} and gpu["worker:1"]["GPU"] == 1.0
    assert "GPU" not in gpu["ps:0"] and "GPU" not in gpu["chief:0"]  # the coordinator computes nothing
    assert all("GPU" not in b for b in ray_engine.bundles_for(kind, names, gpus=0))
    mw = kinds.get("multiworker")
    assert ray_engine.bundles_for(mw, plans.member_names(mw, 2), gpus=2) == [
        {"CPU": 1.0, "GPU": 1.0}] * 2


def test_each_node_shares_its_own_cores_among_its_own_tasks():
    # Sized by the node each task runs on, never by the driver's machine: two workers on
    # one 2-core node are pinned apart with a core each; a worker alone on a 32-core node
    # gets all 32; a ps task serves with one thread.
    kind = kinds.get("ps")
    node_of = {"chief:0": "head", "ps:0": "head", "worker:0": "a", "worker:1": "a",
               "worker:2": "big"}
    got = ray_engine.node_shares(kind, node_of, {"head": 2, "a": 2, "big": 32})
    assert got["worker:0"].cpus == (0,) and got["worker:1"].cpus == (1,)
    assert got["worker:0"].env["TF_NUM_INTRAOP_THREADS"] == "1"
    assert got["worker:2"].cpus == () and got["worker:2"].env["TF_NUM_INTRAOP_THREADS"] == "32"
    assert got["ps:0"].env["TF_NUM_INTRAOP_THREADS"] == "1" and got["ps:0"].cpus == ()
    assert set(got) == set(node_of)


def test_spread_workers_pins_what_computes_nothing_to_the_head():
    kind = kinds.get("ps")
    names = plans.member_names(kind, 2, 2)
    pinned = dict(zip(names, ray_engine.bundles_for(kind, names, gpus=0, pin_head=True)))
    on_head = {n for n, b in pinned.items() if ray_engine.HEAD_RESOURCE in b}
    assert on_head == {"chief:0", "ps:0", "ps:1"}  # the workers may go anywhere
    mw = kinds.get("multiworker")
    assert all(ray_engine.HEAD_RESOURCE not in b for b in ray_engine.bundles_for(
        mw, plans.member_names(mw, 2), gpus=0, pin_head=True))  # every task computes
    assert ray_engine.PLACEMENTS["spread-workers"] == "SPREAD"


def test_shortage_names_what_is_missing():
    bundles = [{"CPU": 1.0}] * 3
    assert ray_engine.shortage(bundles, {"CPU": 2.0}, 1, "spread") == (
        "--engine ray needs 3 CPU bundles (3 CPU, one bundle per task), the cluster has 2; "
        "add nodes or run fewer tasks")
    assert ray_engine.shortage(bundles, {"CPU": 8.0}, 2, "spread") is None
    assert "strict-spread needs 3 nodes (one per task), the cluster has 2" in \
        ray_engine.shortage(bundles, {"CPU": 8.0}, 2, "strict-spread")
    gpus = [{"CPU": 1.0, "GPU": 1.0}] * 2
    assert "needs 2 GPU bundles" in ray_engine.shortage(gpus, {"CPU": 8.0, "GPU": 1.0}, 2, "pack")


def test_tf_configs_from_placed_addresses_match_the_local_launchers():
    kind = kinds.get("ps")
    names = plans.member_names(kind, 2, 1)
    ports = [4001, 4002, 4003, 4004]
    local = plans.build_cluster(kind, 2, 1, ports, host="10.1.2.3")
    placed = plans.tf_configs_at({n: f"10.1.2.3:{p}" for n, p in zip(names, ports)})
    assert placed == local


def test_model_dir_made_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    config = build_config(LaunchRequest(strategy="ps", cluster=Cluster(ps=1, engine="ray"),
                                        member=MemberArgs(options=TrainOptions(
                                            model_dir="runs/x", steps=3))))
    out = ray_engine.with_shared_model_dir(config)
    assert out.model_dir == str(tmp_path / "runs/x")
    assert out.member.argv() == ["--steps", "3", "--model-dir", str(tmp_path / "runs/x")]


def test_missing_ray_is_one_line_exit_2(monkeypatch, capsys):
    real_import = builtins.__import__

    def no_ray(name, *args, **kwargs):
        if name == "ray" or name.startswith("ray."):
            raise ImportError("No module named 'ray'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_ray)
    monkeypatch.delitem(sys.modules, "ray", raising=False)
    code = launch_cli.main(["--strategy", "ps", "--ps", "1", "--engine", "ray", "--", "--steps",
                            "3"])
    err = capsys.readouterr().err.strip()
    assert code == Exit.BAD_INPUT
    assert err == ("error: --engine ray needs Ray, which is not installed here; install it: "
                   "pip install 'tf-distribute-showcase[ray]'")
    with pytest.raises(LaunchError):
        run_request(LaunchRequest(strategy="ps", cluster=Cluster(ps=1, engine="ray")))


def test_python_api_takes_the_engine():
    import tfdist

    options = tfdist.TrainOptions(steps=3, model_dir="/nonexistent/x")
    with pytest.raises(tfdist.TfdistError) as err:
        tfdist.launch("ps", cluster=tfdist.Cluster(ps=1, engine="ray", hosts=2), options=options)
    assert err.value.exit_code == Exit.BAD_INPUT
    assert "--hosts does not apply with --engine ray" in err.value.message
    with pytest.raises(tfdist.TfdistError) as err:
        tfdist.launch("ps", cluster=tfdist.Cluster(ps=1, address="auto"), options=options)
    assert "add --engine ray" in err.value.message
