"""The scenarios suite's plan (``bench/suites/scenarios.py``): the scenarios, the variants, the
tutorial peers, the targets, and every run they make, in order."""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass, replace

from tfdist.bench.suites import model_parallel, scaling, sparse
from tfdist.bench.common import BASELINE, TRAIN, BenchError, Run, cluster_prefix, parse_only
from tfdist.strategies import kinds as strategy_kinds
from tfdist.strategies.kinds import StrategyKind

PEERS_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "peers")
UNIFORM = "uniform"


@dataclass(frozen=True)
class ScenarioRun(Run):
    """A run of this suite: which scenario, which phase ("throughput": short,
    "accuracy": long and evaluated, "repeat", "staleness"), which variant of
    the kind (e.g. ps-sync with a backup worker), and whether a tutorial peer
    (not this library) runs it."""

    scenario: str = ""
    phase: str = ""
    variant: str = ""
    peer: str = ""

    @property
    def results_file(self) -> str:
        return PEER_RESULTS if self.peer else super().results_file

    def load_results(self, path: str) -> dict:
        return PeerResults.load(path).to_dict() if self.peer else super().load_results(path)


PEER_RESULTS = "peer_results.json"  # what a tutorial peer (bench/peers/) writes


@dataclass(frozen=True)
class PeerResults:
    """``peer_results.json``: the figures of a tutorial peer run that compare with ours.

    Written by ``bench/peers/peer_lib.py``, which is kept apart from the
    library; its examples/s leave out the first Keras epoch (start-up).
    """

    peer: str
    keras_version: str
    num_workers: int
    global_batch_size: int
    total_steps: int
    steps_per_execution: int
    steps_per_epoch: int
    startup_seconds: float
    train_seconds: float
    steady_steps: int
    examples_per_sec: float
    test_accuracy: float
    wall_seconds: float

    def to_dict(self) -> dict:
        return dict(self.__dict__)

    @classmethod
    def load(cls, path: str) -> "PeerResults":
        with open(path) as f:
            data = json.load(f)
        return cls(**{k: data[k] for k in cls.__dataclass_fields__})


@dataclass(frozen=True)
class Scenario:
    name: str
    title: str
    workers: int
    slow: str | None = None  # a launch.py --slow spec
    link_rate: str | None = None  # with simulated hosts
    global_batch: int | None = None  # None: --global-batch-size
    log_every: int | None = None  # None: --log-every
    short: str = ""  # the plots' axis label
    # Kinds that also run with gradients in 16 bits (--gradient-dtype), as a row of their own.
    half: tuple[str, ...] = ()

    @property
    def label(self) -> str:
        return self.short or self.name


SCENARIOS = {s.name: s for s in (
    # 16-bit gradients: their accuracy over the uniform run's 3 epochs, their
    # speed where the bytes are the bound.
    Scenario(UNIFORM, "uniform: 2 workers, nothing slowed", 2, short="uniform",
             half=("multiworker",)),
    # Slowed once the job has run its first call (step 10, reported by a
    # progress event every call), not from its start: a worker slowed from
    # its start can spend a short run still starting up, and never join.
    Scenario("slow", "one worker slowed: worker:1 at 0.3 of its speed (a CPU quota) from step 10",
             2, slow="worker:1=0.3@step=10", log_every=10, short="worker:1 at 0.3"),
    Scenario("links", "slow links: simulated hosts, 100 Mbit/s each way per host", 2,
             link_rate="100mbit", short="100 Mbit/s links", half=("multiworker", "ps", "ps-sync")),
    # 120 splits into 4 and into 3 equal gradients (K = N and K = N - 1).
    Scenario("more", "4 workers (oversubscribed: 2 per core on 2 cores)", 4, global_batch=120,
             short="4 workers on 2 cores"),
)}


@dataclass(frozen=True)
class Variant:
    key: str  # the row's id in a scenario: the kind's name, or <name>-backup
    kind: str
    label: str
    train_flags: tuple[str, ...] = ()
    generic: str = ""  # the label whatever N (plot legends across scenarios)


HALF = "bfloat16"  # the 16-bit gradient dtype the suite measures (float16 is refused)


def variants(workers: int, half: tuple[str, ...] = ()) -> list[Variant]:
    """The multi-process kinds, a kind that aggregates K gradients twice (K = N, N - 1);
    then each kind in ``half`` again (K = N) with gradients in 16 bits."""
    out = []
    for name, kind in strategy_kinds.all_kinds().items():
        # A pipelined kind cuts the model instead of copying it: the
        # model-parallel scenario measures it on a model made for cutting.
        if kind.single_process or kind.pipelined:
            continue
        if not kind.aggregates_gradients:
            out.append(Variant(name, name, name, generic=name))
            continue
        out.append(Variant(name, name, f"{name} K={workers}",
                           ("--replicas-to-aggregate", str(workers)), f"{name} K=N"))
        if workers > 1:
            out.append(Variant(f"{name}-backup", name, f"{name} K={workers - 1} (1 backup)",
                               ("--replicas-to-aggregate", str(workers - 1)),
                               f"{name} K=N-1 (1 backup)"))
    for v in [v for v in out if v.key in half]:
        out.append(Variant(f"{v.key}-bf16", v.kind, f"{v.label}, {HALF} gradients",
                           (*v.train_flags, "--gradient-dtype", HALF), f"{v.generic}, {HALF}"))
    return out


@dataclass(frozen=True)
class Peer:
    key: str
    script: str  # under bench/peers/
    ours: str  # the variant (or the baseline) it is compared with
    label: str
    tf_keras: bool  # needs the tf_keras package (Keras 2)


PEERS = (
    Peer("keras3", "keras3_fit.py", BASELINE,
         "Keras 3 model.fit, one process (tfds tutorial)", tf_keras=False),
    Peer("tf_keras-multiworker", "tf_keras_multiworker.py", "multiworker",
         "tf_keras model.fit, MultiWorkerMirroredStrategy (multi-worker Keras tutorial)",
         tf_keras=True),
    Peer("tf_keras-ps", "tf_keras_ps.py", "ps",
         "tf_keras model.fit + steps_per_execution, ParameterServerStrategy (ps tutorial)",
         tf_keras=True),
)

def ours_config(peer: Peer) -> str:
    """The row (config) of our run that ``peer`` is compared with."""
    return peer.ours if peer.ours == BASELINE else f"{UNIFORM}/{peer.ours}"


# Targets: ratios of examples/s measured in this run.
PEER_TARGET = 1.0  # each of our strategies against its tutorial peer
PEER_ACCURACY_SLACK = 0.002  # ... at equal or better test accuracy, within this
UNIFORM_ACCURACY = 0.99  # every strategy, uniform, within the accuracy run (3 epochs)
RATIO_TARGETS = (
    # (scenario, variant, against, at least, what it checks)
    ("slow", "ps", "multiworker", 1.5, "async ps against multiworker, one worker at 0.3"),
    ("slow", "ps-sync-backup", "ps-sync", 1.5,
     "ps-sync with one backup against ps-sync without, one worker at 0.3"),
)


# Against the network's limit (``bench/link_limit.py``), in the scenarios with shaped links.
LINK_FRACTION = 0.85  # every float32 multi-process cell reaches this fraction of its limit
HALF_SPEEDUP = 1.6  # multiworker with 16-bit gradients over float32, on shaped links ...
HALF_ACCURACY_SLACK = 0.002  # ... at a uniform test accuracy within this of float32's
MODEL_TOLERANCE = 0.10  # the traffic model within this of the measured bytes per step


def parse_list(text: str, cast, flag: str) -> list:
    try:
        values = [cast(v) for v in text.split(",") if v.strip()]
    except ValueError:
        values = []
    if not values or any(v <= 0 for v in values):
        raise BenchError(f"{flag} {text!r} is not a comma-separated list of positive numbers")
    return values


# Studies chosen by --scenarios beside the scenarios: a task of their own.
STUDIES = (sparse.SPARSE, scaling.SCALING, model_parallel.MODEL_PARALLEL)


def scenario_names(text: str | None) -> list[str]:
    """The scenarios and studies ``--scenarios`` names (all of them when empty)."""
    if not text:
        return [*SCENARIOS, *STUDIES]
    names = [n.strip() for n in text.split(",") if n.strip()]
    bad = [n for n in names if n not in SCENARIOS and n not in STUDIES]
    if bad or not names:
        raise BenchError(f"--scenarios {text!r} names {bad or 'nothing'}; "
                               f"allowed: {', '.join([*SCENARIOS, *STUDIES])}")
    return names


def parse_scenarios(text: str | None) -> list[Scenario]:
    """The MNIST scenarios ``text`` names (the studies are planned apart)."""
    return [SCENARIOS[n] for n in scenario_names(text) if n in SCENARIOS]


def launch_prefix(python: str, kind: StrategyKind, workers: int, scenario: Scenario,
                  timeout: float, program: str | None = None) -> list[str]:
    return cluster_prefix(python, kind, workers, timeout, slow=scenario.slow,
                          link_rate=scenario.link_rate, program=program)


def accuracy_length(args, scenario: Scenario) -> tuple[list[str], int, float]:
    """(length flags, eval every, target) of a scenario's accuracy run."""
    if scenario.name == UNIFORM:
        length = ["--steps", str(args.steps)] if args.steps else ["--epochs", str(args.epochs)]
        return length, args.eval_every, args.target
    return (["--steps", str(args.accuracy_steps)], args.accuracy_eval_every,
            args.scenario_target)


def plan_runs(args, python: str = sys.executable, have_tf_keras: bool = True) -> list[ScenarioRun]:
    """Every run of the scenarios suite, in order; pure (starts nothing).

    Two interleaved passes: every cell's throughput run, then every cell's
    accuracy run (each tutorial peer right after the run it is compared
    with), then the staleness study.
    """
    scenarios = parse_scenarios(args.scenarios)
    only = parse_only(args.only)
    if args.short_steps < 0 or args.accuracy_steps < 1 or args.peer_repeats < 1:
        raise BenchError("--short-steps must be 0 (no throughput pass) or more, "
                               "--accuracy-steps and --peer-repeats at least 1")
    # Scenarios whose cells get a short throughput run besides the accuracy
    # run (the others keep one run per cell, to keep the suite's time).
    short_in = {s.name for s in parse_scenarios(args.short_scenarios)} if args.short_scenarios else set()
    runs: list[ScenarioRun] = []
    train = TRAIN

    def add(phase, scenario, key, kind, workers, prefix, flags, peer=""):
        config = key if scenario is None else f"{scenario.name}/{key}"
        name = f"{phase[:3]}-{config.replace('/', '-')}"
        model_dir = os.path.join(args.out, "runs", name)
        runs.append(ScenarioRun(name, kind, workers, (*prefix, *flags, "--model-dir", model_dir),
                              model_dir, config, scenario.name if scenario else "", phase,
                              key, peer))

    uniform = SCENARIOS[UNIFORM]
    peers = [p for p in PEERS if args.peers and (have_tf_keras or not p.tf_keras)
             and strategy_kinds.get(p.ours).name in only]

    def add_peer(ours: str, flags: list[str]):
        for peer in (p for p in peers if p.ours == ours):
            kind = strategy_kinds.get(peer.ours)
            script = os.path.join(PEERS_DIR, peer.script)
            if kind.single_process:
                prefix = [python, script, f"--strategy={kind.name}"]
            else:
                prefix = launch_prefix(python, kind, uniform.workers, uniform,
                                       args.run_timeout, program=script)
            add("accuracy", uniform, f"peer-{peer.key}", kind.name,
                1 if kind.single_process else uniform.workers, prefix, flags, peer=peer.key)

    for phase in ("throughput", "accuracy")[0 if args.short_steps else 1:]:
        if phase == "throughput":
            base_flags = _common_flags(args, uniform, ["--steps", str(args.short_steps)], 0)
        else:
            length, every, _ = accuracy_length(args, uniform)
            base_flags = _common_flags(args, uniform, length, every)
        if not scenarios:
            break  # a study alone (--scenarios sparse): no MNIST run at all
        add(phase, None, BASELINE, BASELINE, 1,
            [python, train, f"--strategy={BASELINE}"], base_flags)
        if phase == "accuracy":
            add_peer(BASELINE, base_flags)
        for scenario in scenarios:
            if phase == "throughput" and scenario.name not in short_in:
                continue
            if phase == "throughput":
                flags = _common_flags(args, scenario, ["--steps", str(args.short_steps)], 0)
            else:
                length, every, _ = accuracy_length(args, scenario)
                flags = _common_flags(args, scenario, length, every)
            for v in (v for v in variants(scenario.workers, scenario.half) if v.kind in only):
                prefix = launch_prefix(python, strategy_kinds.get(v.kind), scenario.workers,
                                       scenario, args.run_timeout)
                add(phase, scenario, v.key, v.kind, scenario.workers, prefix,
                    [*flags, *v.train_flags])
                if phase == "accuracy" and scenario.name == UNIFORM:
                    add_peer(v.key, flags)
    runs += repeat_rounds(runs, peers, args.peer_repeats, args.out)
    return runs + plan_staleness(args, python) + _plan_studies(args, python)


def _common_flags(args, scenario: Scenario, length: list[str], eval_every: int) -> list[str]:
    """The training flags every run of ``scenario`` shares (its batch, seed, cadences, data)."""
    batch = scenario.global_batch or args.global_batch_size
    flags = ["--model", args.model, *length, "--global-batch-size", str(batch),
             "--seed", str(args.seed), "--steps-per-execution", str(args.steps_per_execution),
             "--eval-every", str(eval_every),
             "--log-every", str(scenario.log_every or args.log_every)]
    return flags + (["--data-dir", args.data_dir] if args.data_dir else [])


def _plan_studies(args, python: str) -> list[ScenarioRun]:
    """The runs of the studies ``--scenarios`` names (sparse, scaling, model-parallel), in that order."""
    names, runs = scenario_names(args.scenarios), []
    if sparse.SPARSE in names:
        runs += sparse.plan(args, python)
    if scaling.SCALING in names:
        runs += scaling.plan(args, python)
    if model_parallel.MODEL_PARALLEL in names:
        runs += model_parallel.plan(args, python)
    return runs


def repeat_rounds(runs: list[ScenarioRun], peers, rounds: int, out: str) -> list[ScenarioRun]:
    """Every pair of a peer and the run it is compared with, again in later
    rounds (--peer-repeats), in the same order: a single pair is at the
    mercy of a slow minute on a shared host. The same commands, each round
    in directories of its own."""
    compared = {ours_config(p) for p in peers}
    pairs = [r for r in runs if r.phase == "accuracy" and (r.peer or r.config in compared)]
    again = []
    for i in range(1, rounds):
        tag = "rep" if i == 1 else f"rep{i}"
        for run in pairs:
            name = f"{tag}-{run.name.partition('-')[2]}"
            model_dir = os.path.join(out, "runs", name)
            again.append(replace(run, name=name, phase="repeat", model_dir=model_dir,
                                 cmd=(*run.cmd[:-1], model_dir)))
    return again


def staleness_kind() -> StrategyKind:
    """The asynchronous multi-process kind: the one whose updates can be stale."""
    return next(k for k in strategy_kinds.all_kinds().values()
                if k.asynchronous and not k.single_process)


def plan_staleness(args, python: str = sys.executable) -> list[ScenarioRun]:
    """Async ps on softmax regression with plain SGD (the classic walk-through's
    set-up: batch 100, one step per call), over workers and learning rates."""
    if not args.staleness_workers:
        return []
    kind = staleness_kind()
    runs = []
    for workers in parse_list(args.staleness_workers, int, "--staleness-workers"):
        for lr in parse_list(args.staleness_lrs, float, "--staleness-lrs"):
            config = f"staleness/{workers}w-lr{lr:g}"
            name = f"sta-{workers}w-lr{lr:g}"
            model_dir = os.path.join(args.out, "runs", name)
            flags = ["--model", "logreg", "--optimizer", "sgd", "--learning-rate", f"{lr:g}",
                     "--lr-schedule", "constant", "--global-batch-size", "100",
                     "--steps", str(args.staleness_steps), "--steps-per-execution", "1",
                     "--eval-every", "0", "--log-every", str(args.staleness_steps),
                     "--seed", str(args.seed)]
            flags += ["--data-dir", args.data_dir] if args.data_dir else []
            prefix = launch_prefix(python, kind, workers, Scenario("staleness", "", workers),
                                   args.run_timeout)
            runs.append(ScenarioRun(name, kind.name, workers,
                                    (*prefix, *flags, "--model-dir", model_dir),
                                    model_dir, config, "staleness", "staleness", f"lr={lr:g}"))
    return runs
