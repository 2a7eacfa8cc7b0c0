"""Every option and default has one source: the dataclass field (tfdist.flags).

train.py's, launch.py's and bench.py's parsers are checked against their
dataclasses (same default, shown once in --help, help text on every flag);
the Python API takes the same dataclasses, so its defaults are theirs; the
checker itself is shown to fail on each kind of drift. Pure: no process, no
TensorFlow.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect

import pytest

import tfdist
from tfdist import flags, protocol
from tfdist.bench.config import BenchConfig
from tfdist.cli import bench as bench_cli
from tfdist.cli import launch as launch_cli
from tfdist.cli import train as train_cli
from tfdist.launcher import job
from tfdist.launcher.config import Cluster, Faults, LaunchConfig, LaunchRequest, Limits, Recovery
from tfdist.strategies import kinds
from tfdist.strategies.tf_config import LOCAL
from tfdist.training import plan
from tfdist.training.config import TrainConfig, TrainOptions

LAUNCH_CLASSES = (LaunchRequest, Cluster, Faults, Recovery, Limits)
PARSERS = {
    "train.py": (train_cli.parser, (TrainConfig,)),
    "launch.py": (launch_cli.parser, LAUNCH_CLASSES),
    "bench.py": (bench_cli.parser, (BenchConfig,)),
}


@pytest.mark.parametrize("command", sorted(PARSERS))
def test_every_flag_agrees_with_its_dataclass_and_says_its_default_once(command):
    make, classes = PARSERS[command]
    assert flags.problems(make(), *classes) == []


@pytest.mark.parametrize("command", sorted(PARSERS))
def test_help_has_groups_no_markup_and_exit_codes_one_a_line(command):
    text = PARSERS[command][0]().format_help()
    assert "``" not in text and ":class:" not in text
    assert text.count("default: None") == 0 and text.count("(default: False)") == 0
    sections = [line for line in text.splitlines() if line and not line[0].isspace()
                and line.endswith(":")]
    assert len(sections) >= 3, sections  # options, groups, exit codes
    codes = text[text.index("exit codes:"):].splitlines()[1:]
    assert codes and all(line.split()[0].isdigit() for line in codes if not line.startswith("      "))


def test_the_checker_fails_on_each_kind_of_drift():
    @dataclasses.dataclass(frozen=True)
    class Options:
        steps: int = flags.option(10, "steps")
        rate: float | None = flags.option(None, "a rate", unset="the task's own")

    p = argparse.ArgumentParser(formatter_class=flags.HelpFormatter)
    flags.add_options(p, Options)
    assert flags.problems(p, Options) == []

    changed = argparse.ArgumentParser(formatter_class=flags.HelpFormatter)
    changed.add_argument("--steps", type=int, default=20, help="steps (default: 10)")
    changed.add_argument("--rate", type=float, default=None, help="a rate (default: 0.1) "
                         "(default: 0.2)")
    changed.add_argument("--quiet", action="store_true")
    found = flags.problems(changed, Options)
    assert any("--steps: the parser's default 20 is not Options.steps's 10" in f for f in found)
    assert any("--rate: its default is said more than once" in f for f in found)
    assert any("--quiet: no help text" in f for f in found)

    missing = argparse.ArgumentParser(formatter_class=flags.HelpFormatter)
    flags.add_options(missing, Options, exclude=("rate",))
    assert flags.problems(missing, Options) == ["--rate: Options.rate has no flag"]

    # A dataclass default changed under a parser built before: the help no longer shows it.
    stale = argparse.ArgumentParser(formatter_class=flags.HelpFormatter)
    stale.add_argument("--steps", type=int, default=10, help="steps (default: 12)")
    assert any("does not show Options.steps's default 10" in f
               for f in flags.problems(stale, Options))


def test_a_new_option_is_one_field():
    @dataclasses.dataclass(frozen=True)
    class Options:
        buckets: int = flags.option(4, "gradient buckets", metavar="N", group="overlap")
        tags: tuple[str, ...] = flags.option((), "a tag; repeatable", flag="--tag")
        profile: bool = flags.option(False, "write a trace")
        peers: bool = flags.option(True, "leave the peers out", flag="--no-peers")

    p = argparse.ArgumentParser(formatter_class=flags.HelpFormatter)
    flags.add_options(p, Options)
    assert "overlap" in [g.title for g in p._action_groups]
    got = flags.from_args(Options, p.parse_args(["--buckets", "8", "--tag", "a", "--tag", "b",
                                                 "--profile", "--no-peers"]))
    assert got == Options(buckets=8, tags=("a", "b"), profile=True, peers=False)
    assert flags.to_argv(got) == ["--buckets", "8", "--tag", "a", "--tag", "b", "--profile",
                                  "--no-peers"]
    assert flags.from_args(Options, p.parse_args(flags.to_argv(got))) == got
    assert flags.to_argv(Options()) == [] and flags.from_args(Options, p.parse_args([])) == Options()


def test_launch_takes_typed_groups_in_at_most_ten_parameters():
    params = inspect.signature(tfdist.launch).parameters
    assert len(params) <= 10
    groups = {"cluster": Cluster, "faults": Faults, "recovery": Recovery, "limits": Limits,
              "options": TrainOptions}
    assert {n for n in params if n in groups} == set(groups)
    for name in groups:
        assert params[name].default is None  # None: the group's own defaults, nothing else
    for name in ("Cluster", "Faults", "Recovery", "Limits", "TrainOptions"):
        assert getattr(tfdist, name) is {**groups, "TrainOptions": TrainOptions}.get(
            name.lower(), getattr(tfdist, name))
        assert name in tfdist.__all__
    assert tfdist.Cluster is Cluster and tfdist.TrainOptions is TrainOptions


def test_fit_takes_train_options_not_arbitrary_keywords():
    params = inspect.signature(tfdist.fit).parameters
    assert not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    assert params["options"].default is None
    with pytest.raises(TypeError):
        tfdist.fit("mnist-logreg", steps=3)  # noqa: the options go in TrainOptions
    with pytest.raises(tfdist.TfdistError) as err:
        tfdist.fit("mnist-logreg", options={"steps": 3})
    assert err.value.message.startswith("error: options= takes a tfdist.TrainOptions(")


def test_the_api_the_dataclasses_and_the_parsers_share_their_defaults():
    # API: what the API's None means is the group's default instance, the parser's too.
    args, rest = launch_cli.parse_args([])
    assert launch_cli.request_from_args(args, rest) == LaunchRequest()
    assert train_cli.config_from_args(train_cli.parse_args([])).strategy == TrainConfig().strategy
    options = {f.name for f in dataclasses.fields(TrainOptions)}
    assert {f.name for f in dataclasses.fields(TrainConfig)} >= options  # one class, extended
    # The launch's resolved config holds the request's limits, not defaults of its own.
    assert not any(f.name in ("timeout", "grace") for f in dataclasses.fields(LaunchConfig))
    # One default strategy: the API's, train.py's, launch.py's.
    assert (inspect.signature(tfdist.fit).parameters["strategy"].default
            == inspect.signature(tfdist.launch).parameters["strategy"].default
            == TrainConfig().strategy == LaunchRequest().strategy == kinds.AUTO)


def test_launch_has_no_default_time_limit():
    args, rest = launch_cli.parse_args(["--strategy", "multiworker", "--", "--steps", "3"])
    config = job.build_config(launch_cli.request_from_args(args, rest))
    assert config.timeout is None
    assert "--timeout" not in config.launch_argv
    assert "(default: no limit)" in " ".join(launch_cli.parser().format_help().split())
    args, rest = launch_cli.parse_args(["--strategy", "multiworker", "--timeout", "7200"])
    config = job.build_config(launch_cli.request_from_args(args, rest))
    assert config.timeout == 7200.0 and config.launch_argv[-2:] == ("--timeout", "7200.0")
    with pytest.raises(job.LaunchError, match="--timeout=0 is not allowed"):
        job.check_times(Limits(timeout=0))


def test_one_run_directory_rule_and_one_strategy_for_every_entry(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    local = plan.request(TrainConfig(task="mnist-logreg"))
    assert local.config.model_dir == protocol.default_model_dir(local.kind.name)
    assert local.kind is kinds.resolve("auto", LOCAL)
    args, rest = launch_cli.parse_args(["--workers", "2", "--ps", "1"])
    config = job.build_config(launch_cli.request_from_args(args, rest))
    assert config.kind.name == "ps" and config.model_dir == protocol.default_model_dir("ps")
    assert config.launch_argv[:2] == ("--strategy", "ps")
    args, rest = launch_cli.parse_args(["--workers", "2"])
    assert job.build_config(launch_cli.request_from_args(args, rest)).kind.name == "multiworker"
    assert not (tmp_path / "runs").exists()  # resolving writes nothing


def test_every_tfdist_error_starts_the_same_way():
    assert tfdist.TfdistError("x", 2).message == "error: x"
    assert str(tfdist.TfdistError("error: y", 2)) == "error: y"
    refusals = [
        lambda: tfdist.fit("mnist-logreg", ps=1),
        lambda: tfdist.fit("mnist-logreg", strategy="multiworker"),
        lambda: tfdist.fit(lambda: None, workers=2),
        lambda: tfdist.launch("nonesuch"),
        lambda: tfdist.launch("ps", cluster=tfdist.Cluster(ps=1, address="auto")),
        lambda: tfdist.launch("ps", limits={"timeout": 3}),
    ]
    for refuse in refusals:
        with pytest.raises(tfdist.TfdistError) as err:
            refuse()
        assert err.value.message.startswith("error: ") and err.value.exit_code == 2
        assert "\n" not in err.value.message


def test_auto_says_what_it_chose_once_and_a_named_strategy_says_nothing():
    chosen = plan.resolve(TrainConfig(task="mnist-logreg", steps=1), gpus=[])
    assert chosen.kind.name == "mirrored"
    assert chosen.strategy_note() == ("--strategy auto: mirrored (one process; give --strategy "
                                      "to choose another)")
    named = plan.resolve(TrainConfig(task="mnist-logreg", steps=1, strategy="none"), gpus=[])
    assert named.strategy_note() is None
    ps = job.auto_cluster(Cluster(workers=2, ps=1))
    assert kinds.auto_note(kinds.auto_choice(ps), ps).startswith("--strategy auto: ps (2 workers")
