"""Which strategy when: the benchmark under cluster conditions, next to the tutorials' code.

    python bench.py --suite scenarios       # results/scenarios.md, .json, PNGs (docs/performance.md: its time)

Scenarios, each on the same work, against the one-process baseline (``none``)
of the same bench run:

  uniform  2 workers, nothing slowed
  slow     2 workers, worker:1 at 0.3 of its speed (``launch.py --slow worker:1=0.3@step=10``)
  links    2 workers, one simulated host per worker (the ps chief and ps share
           one more), 100 Mbit/s each way (``launch.py --hosts N --link-rate 100mbit``)
  more     4 workers on this host's cores (oversubscribed where it has fewer)

Every multi-process strategy kind runs in each; a kind that averages K
gradients per update (``ps-sync``) runs twice, with K = N and with one
backup worker (K = N - 1). Every cell has an *accuracy* run (evaluated
every few steps) in a second pass; in the ``--short-scenarios`` (all by
default) it also has a *throughput* run (``--short-steps``, no
evaluation) in a first pass, interleaved with the others, and its
examples/s is the better of the two; every run's figure is shown.
In the uniform scenario, peers
written after TensorFlow's tutorials (``bench/peers/``) train the same CNN
with the same hyperparameters right after the run they are compared with;
each such pair runs again in a later round (``--peer-repeats``), and each
side's best run counts.
Then a staleness study: async ps on softmax regression over workers and
learning rates, and the big sparse embedding study (``--scenarios sparse``,
``bench/sparse.py``): the ``ctr`` task, whose table is split over 2 ps.
Targets are ratios measured in this run.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import textwrap
import time
from dataclasses import dataclass, replace

from tfdist.bench import links, model_parallel, scaling, sparse
from tfdist.bench.common import (BASELINE, TRAIN, BenchError, Run, cluster_prefix, group_by_config,
                          load_outcomes, machine_description, parse_only, run_all,
                          time_to_target)
from tfdist.bench.config import BenchConfig
from tfdist.strategies import kinds as strategy_kinds
from tfdist.strategies.kinds import StrategyKind

PEERS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "peers")
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


# Against the network's limit (``bench/links.py``), in the scenarios with shaped links.
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

    def common(scenario: Scenario, length: list[str], eval_every: int) -> list[str]:
        batch = scenario.global_batch or args.global_batch_size
        flags = ["--model", args.model, *length, "--global-batch-size", str(batch),
                 "--seed", str(args.seed), "--steps-per-execution", str(args.steps_per_execution),
                 "--eval-every", str(eval_every),
                 "--log-every", str(scenario.log_every or args.log_every)]
        return flags + (["--data-dir", args.data_dir] if args.data_dir else [])

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
            base_flags = common(uniform, ["--steps", str(args.short_steps)], 0)
        else:
            length, every, _ = accuracy_length(args, uniform)
            base_flags = common(uniform, length, every)
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
                flags = common(scenario, ["--steps", str(args.short_steps)], 0)
            else:
                length, every, _ = accuracy_length(args, scenario)
                flags = common(scenario, length, every)
            for v in (v for v in variants(scenario.workers, scenario.half) if v.kind in only):
                prefix = launch_prefix(python, strategy_kinds.get(v.kind), scenario.workers,
                                       scenario, args.run_timeout)
                add(phase, scenario, v.key, v.kind, scenario.workers, prefix,
                    [*flags, *v.train_flags])
                if phase == "accuracy" and scenario.name == UNIFORM:
                    add_peer(v.key, flags)
    runs += repeat_rounds(runs, peers, args.peer_repeats, args.out)
    runs += plan_staleness(args, python)
    if sparse.SPARSE in scenario_names(args.scenarios):
        runs += sparse.plan(args, python)
    if scaling.SCALING in scenario_names(args.scenarios):
        runs += scaling.plan(args, python)
    if model_parallel.MODEL_PARALLEL in scenario_names(args.scenarios):
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


# --- summaries (pure) ---------------------------------------------------------------

def _num(value):
    return value if isinstance(value, (int, float)) else None


def rate_from(result: dict, from_step: int) -> tuple[float, int] | None:
    """(examples/s, first step) of a run from its first evaluation at or past
    ``from_step`` to its end, on its eval curve's clock (evaluation left out); pure.

    A tutorial peer's examples/s leaves out its first Keras epoch; this is
    ours over the same part of the run, so neither side's warm-up counts.
    None without an evaluation in the run after ``from_step``.
    """
    curve = result.get("eval_curve") or []
    start = next((p for p in curve if p["step"] >= from_step), None)
    if start is None or start is curve[-1] or curve[-1]["seconds"] <= start["seconds"]:
        return None
    end = curve[-1]
    steps = end["step"] - start["step"]
    return steps * result["global_batch_size"] / (end["seconds"] - start["seconds"]), start["step"]


def summarize(results: dict[str, dict], runs: list[ScenarioRun], targets: dict[str, float],
              outcomes: dict[str, dict] | None = None) -> list[dict]:
    """One row per configuration (scenario and variant, peer, staleness point); pure.

    examples/s is the best of the configuration's runs, every run's figure
    kept; accuracy, time to the scenario's target, staleness and dropped
    gradients come from its accuracy run (the longer, evaluated one); on
    shaped links (``outcomes``: the runs' launch records), the bytes and the
    link's limit from the run whose examples/s the row shows.
    """
    rows = []
    outcomes = outcomes or {}
    for config, group in group_by_config(runs).items():
        first = group[0]
        row = {"config": config, "scenario": first.scenario, "variant": first.variant,
               "kind": first.kind, "workers": first.workers, "peer": first.peer,
               "runs": [{"name": r.name, "phase": r.phase,
                         "examples_per_sec": (results.get(r.name) or {}).get("examples_per_sec")}
                        for r in group],
               "failed": [r.name for r in group if r.name not in results]}
        row["ok"] = not row["failed"]
        done = [(r, results[r.name]) for r in group if r.name in results]
        if done:
            best_run, best = max(done, key=lambda d: d[1]["examples_per_sec"])
            row["examples_per_sec"] = best["examples_per_sec"]
            row["examples_per_sec_each"] = [res["examples_per_sec"] for _, res in done]
            row["link"] = links.figures(best, outcomes.get(best_run.name))
            # The accuracy run, else (throughput only, the staleness study) the last.
            acc = next((res for r, res in done if r.phase != "throughput"), done[-1][1])
            row["test_accuracy"] = acc.get("test_accuracy")
            # The baseline runs beside the uniform scenario, on its work.
            target = targets.get(UNIFORM if config == BASELINE else first.scenario)
            row["target"] = target
            curve = acc.get("eval_curve") or []
            row["time_to_target"] = (time_to_target(curve, target)
                                     if target is not None and curve else None)
            st = acc.get("staleness") or None
            row["staleness"] = ({"mean": st.get("mean"), "p99": st.get("p99"), "max": st.get("max")}
                                if st else None)
            row["dropped"] = acc.get("stale_gradients_dropped")
            row["aggregated"] = acc.get("aggregated_gradients")
            row["steps_per_worker"] = acc.get("steps_per_worker") or {}
            row["global_steps"] = acc.get("global_steps", acc.get("total_steps"))
            row["learning_rate"] = acc.get("learning_rate")
        rows.append(row)
    base = next((r for r in rows if r["config"] == BASELINE and "examples_per_sec" in r), None)
    for row in rows:
        if base is not None and "examples_per_sec" in row and not row["peer"] \
                and row["scenario"] != "staleness":
            row["ratio"] = row["examples_per_sec"] / base["examples_per_sec"]
    peers_by_ours = {p.key: p for p in PEERS}
    by_config = {r["config"]: r for r in rows}
    for row in rows:
        peer = peers_by_ours.get(row["peer"]) if row["peer"] else None
        if peer is None:
            continue
        ours = by_config.get(ours_config(peer))
        row["ours"] = ours["config"] if ours else None
        # Like for like: our runs of the peer's length (each run just before
        # the peer's), the best, over the part of the run the peer's figure
        # covers (after its first Keras epoch); our whole steady figure
        # where a run has no evaluation there.
        same_length = [r["name"] for r in (ours or {}).get("runs", [])
                       if r["phase"] != "throughput" and r["name"] in results]
        peer_runs = [r["name"] for r in row["runs"] if r["name"] in results]
        if same_length and peer_runs:
            skipped = results[peer_runs[0]].get("steps_per_epoch")
            figures = []
            for name in same_length:
                window = rate_from(results[name], skipped) if skipped else None
                figures.append(window or (results[name]["examples_per_sec"], None))
            best = max(figures, key=lambda f: f[0])
            row["ours_steady_examples_per_sec"] = max(results[n]["examples_per_sec"]
                                                      for n in same_length)
            row["ours_examples_per_sec"], row["ours_from_step"] = best
            row["ours_over_peer"] = row["ours_examples_per_sec"] / row["examples_per_sec"]
            row["ours_test_accuracy"] = ours["test_accuracy"]
    return rows


def _short(ratio: float, need: float) -> str:
    return f"{ratio:.2f}× against ≥ {need:g}×: missed by {need - ratio:.2f}× ({(need - ratio) / need:.0%} short)"


def check_targets(rows: list[dict]) -> list[dict]:
    """Each target: what it checks, the measured figure, met or by how much missed; pure."""
    by = {r["config"]: r for r in rows}
    out = []
    for row in rows:
        if not row["peer"]:
            continue
        peer = next(p for p in PEERS if p.key == row["peer"])
        what = f"uniform: ours ({row.get('ours')}) ≥ {PEER_TARGET:g}× {peer.label}, accuracy within {PEER_ACCURACY_SLACK}"
        if "ours_over_peer" not in row:
            out.append({"target": what, "met": None, "text": "not measured (a run failed)"})
            continue
        ratio = row["ours_over_peer"]
        gap = row["ours_test_accuracy"] - row["test_accuracy"]
        acc_ok = gap >= -PEER_ACCURACY_SLACK
        met = ratio >= PEER_TARGET and acc_ok
        parts = [f"{ratio:.2f}×" if ratio >= PEER_TARGET else _short(ratio, PEER_TARGET),
                 f"accuracy {row['ours_test_accuracy']:.4f} vs {row['test_accuracy']:.4f}"
                 + ("" if acc_ok else f" (missed by {-gap - PEER_ACCURACY_SLACK:.4f} beyond the slack)")]
        out.append({"target": what, "met": met, "ratio": ratio, "text": "; ".join(parts)})
    for scenario, variant, against, need, what in RATIO_TARGETS:
        a, b = by.get(f"{scenario}/{variant}"), by.get(f"{scenario}/{against}")
        label = f"{scenario}: {variant} ≥ {need:g}× {against} ({what})"
        if a is None and b is None:
            continue  # scenario not in this run
        if not a or not b or "examples_per_sec" not in a or "examples_per_sec" not in b:
            out.append({"target": label, "met": None, "text": "not measured (a run failed)"})
            continue
        ratio = a["examples_per_sec"] / b["examples_per_sec"]
        out.append({"target": label, "met": ratio >= need, "ratio": ratio,
                    "text": f"{ratio:.2f}×" if ratio >= need else _short(ratio, need)})
    out += sparse.check(rows)
    out += model_parallel.check(rows)
    out += check_links(rows, by)
    uniform = [r for r in rows if r["scenario"] == UNIFORM and not r["peer"]]
    if uniform:
        uniform += [r for r in rows if r["config"] == BASELINE]
        low = [r for r in uniform if (r.get("test_accuracy") or 0) < UNIFORM_ACCURACY]
        worst = min(uniform, key=lambda r: r.get("test_accuracy") or 0)
        text = (f"lowest {worst['config']} {worst.get('test_accuracy') or 0:.4f}" if not low else
                ", ".join(f"{r['config']} {r.get('test_accuracy') or 0:.4f} "
                                       f"(short by {UNIFORM_ACCURACY - (r.get('test_accuracy') or 0):.4f})"
                                       for r in low))
        out.append({"target": f"uniform: every strategy ≥ {UNIFORM_ACCURACY} test accuracy "
                              "in its accuracy run", "met": not low, "text": text})
    return out


def check_links(rows: list[dict], by: dict[str, dict]) -> list[dict]:
    """The network targets (pure): fraction of the link limit, 16-bit speed-up and
    accuracy, the traffic model's error; [] without a shaped-link run."""
    linked = [r for r in rows if r.get("link") and not r["peer"]]
    if not linked:
        return []
    out = []
    shaped = [s.name for s in SCENARIOS.values() if s.link_rate]
    for name in shaped:
        cells = [r for r in linked if r["scenario"] == name and not r["variant"].endswith("-bf16")]
        if not cells:
            continue
        low = [r for r in cells if r["link"]["fraction"] < LINK_FRACTION]
        text = ", ".join(
            f"{r['variant']} {r['link']['fraction']:.0%}"
            + (f" ({(LINK_FRACTION - r['link']['fraction']) * 100:.0f} points short)"
               if r["link"]["fraction"] < LINK_FRACTION else "")
            + (f", {r['link']['serial_fraction']:.0%} of its serial limit"
               if "serial_fraction" in r["link"] else "")
            for r in cells)
        out.append({"target": f"{name}: every multi-process strategy (float32) ≥ "
                              f"{LINK_FRACTION:.0%} of its link-bound limit",
                    "met": not low, "text": text})
        half, full = by.get(f"{name}/multiworker-bf16"), by.get(f"{name}/multiworker")
        label = (f"{name}: multiworker with {HALF} gradients ≥ {HALF_SPEEDUP:g}× float32's "
                 f"examples/s, uniform accuracy within {HALF_ACCURACY_SLACK}")
        if half is None and full is None:
            continue
        u_half, u_full = by.get(f"{UNIFORM}/multiworker-bf16"), by.get(f"{UNIFORM}/multiworker")
        if not (half and full and "examples_per_sec" in half and "examples_per_sec" in full):
            out.append({"target": label, "met": None, "text": "not measured (a run failed)"})
            continue
        ratio = half["examples_per_sec"] / full["examples_per_sec"]
        parts = [f"{ratio:.2f}×" if ratio >= HALF_SPEEDUP else _short(ratio, HALF_SPEEDUP)]
        acc_ok = None
        if u_half and u_full and u_half.get("test_accuracy") is not None \
                and u_full.get("test_accuracy") is not None:
            gap = u_full["test_accuracy"] - u_half["test_accuracy"]
            acc_ok = gap <= HALF_ACCURACY_SLACK
            parts.append(f"uniform accuracy {u_half['test_accuracy']:.4f} vs "
                         f"{u_full['test_accuracy']:.4f}"
                         + ("" if acc_ok else f" (lower by {gap:.4f}, more than "
                                              f"{HALF_ACCURACY_SLACK})"))
        else:
            parts.append("uniform accuracy not measured (run the uniform scenario too)")
        out.append({"target": label, "met": (ratio >= HALF_SPEEDUP and acc_ok)
                    if acc_ok is not None else None, "ratio": ratio, "text": "; ".join(parts)})
    modelled = [r for r in linked + [r for r in rows if r["scenario"] == scaling.SCALING
                                     and r.get("link")]
                if r["link"].get("model_worst")]
    if modelled:
        off = [r for r in modelled
               if abs((r["link"]["model_worst"]["ratio"] or 0) - 1) > MODEL_TOLERANCE]
        worst = max(modelled, key=lambda r: abs((r["link"]["model_worst"]["ratio"] or 0) - 1))
        w = worst["link"]["model_worst"]
        text = (f"worst {worst['config']}: {w['host']} {w['direction']} measured ÷ model "
                f"{w['ratio']:.2f}" + (f"; {len(off)} of {len(modelled)} cells off by more "
                                       f"than {MODEL_TOLERANCE:.0%}: "
                                       + ", ".join(f"{r['config']} {r['link']['model_worst']['ratio']:.2f}"
                                                   for r in off) if off else
                                       f"; all {len(modelled)} cells within {MODEL_TOLERANCE:.0%}"))
        out.append({"target": f"the traffic model predicts every host's bytes per step within "
                              f"{MODEL_TOLERANCE:.0%} (each cell on shaped links)",
                    "met": not off, "text": text})
    return out


# --- the report -----------------------------------------------------------------

def _fmt(value, spec, missing="–"):
    return missing if value is None else format(value, spec)


def _label(row: dict) -> str:
    if row["config"] == BASELINE:
        return f"{BASELINE} (1 process, baseline)"
    if row["peer"]:
        return next(p.label for p in PEERS if p.key == row["peer"]) + " — *peer*"
    scenario = SCENARIOS.get(row["scenario"])
    for v in variants(scenario.workers if scenario else row["workers"],
                      scenario.half if scenario else ()):
        if v.key == row["variant"]:
            return v.label
    return row["variant"]


def _runs_cell(row: dict) -> str:
    return " / ".join(f"{r['phase'][:3]} {_fmt(r['examples_per_sec'], ',.0f', 'FAILED')}"
                      for r in row["runs"])


def render_markdown(rows: list[dict], targets: list[dict], settings: dict, machine: str,
                    seconds: float | None) -> str:
    lines = ["# Which strategy when: scenarios, tutorial peers, staleness", "",
             f"Machine: {machine}.  ",
             "Work: " + ", ".join(f"{k} {v}" for k, v in settings.items()) + ".  "]
    if seconds is not None:
        lines.append(f"Suite wall time: {seconds / 60:.1f} min ({seconds:.0f} s).")
    lines += ["", "examples/s: steady state (start-up and evaluation excluded), the best of the "
              "cell's runs; *each run* lists them (*thr*: the short throughput run, *acc*: the "
              "accuracy run, *rep*: its second round, for the runs a peer is compared with). "
              "*× none*: against the one-process baseline of this bench run. "
              "Accuracy, time to target (start-up included, evaluation excluded), staleness "
              "and dropped gradients: from the accuracy run.", ""]
    base = [r for r in rows if r["config"] == BASELINE]
    for name, scenario in SCENARIOS.items():
        srows = [r for r in rows if r["scenario"] == name and not r["peer"]]
        if not srows:
            continue
        target = srows[0].get("target")
        lines += [f"## {scenario.title}", "",
                  f"| strategy | workers | examples/s | × none | test accuracy | time to {target} s "
                  "| staleness mean / p99 | dropped gradients | steps per worker | each run |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for row in (base if name == UNIFORM else []) + srows:
            lines.append(_table_row(row))
        lines.append("")
    peer_rows = [r for r in rows if r["peer"]]
    if peer_rows:
        lines += ["## Tutorial peers (uniform scenario)", "",
                  "Written after TensorFlow's tutorials (`bench/peers/`), launched by `launch.py` "
                  "on the same simulated cluster: the same CNN, optimizer, learning-rate schedule, "
                  "global batch and steps; its steps per call are the most, up to ours, that "
                  "make every call whole (its peer_results.json has both). "
                  "Each pair ran once in the accuracy pass and again in later rounds (*rep*), "
                  "ours just before the peer; each side's figure is the best of its runs. "
                  "A peer's examples/s leaves out its "
                  "first Keras epoch (start-up). *ours ÷ peer* compares with our runs of "
                  "the same length over the same part of the run: from our "
                  "first evaluation at or past the peer's first epoch end (*from step*) to the end "
                  "(evaluation left out); *ours, steady* is our whole steady-state figure.", "",
                  "| peer | examples/s | test accuracy | ours | ours examples/s | from step "
                  "| ours ÷ peer | ours accuracy | ours, steady | peer's runs |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for row in peer_rows:
            if not row["ok"]:
                lines.append(f"| {_label(row)} | FAILED (see runs/{row['failed'][0]}.log) | | | | | | | | |")
                continue
            lines.append(f"| {_label(row)} | {row['examples_per_sec']:,.0f} | {row['test_accuracy']:.4f} "
                         f"| {row.get('ours') or '–'} | {_fmt(row.get('ours_examples_per_sec'), ',.0f')} "
                         f"| {_fmt(row.get('ours_from_step'), 'd')} "
                         f"| {_fmt(row.get('ours_over_peer'), '.2f')} "
                         f"| {_fmt(row.get('ours_test_accuracy'), '.4f')} "
                         f"| {_fmt(row.get('ours_steady_examples_per_sec'), ',.0f')} "
                         f"| {_runs_cell(row)} |")
        lines.append("")
    st_rows = [r for r in rows if r["scenario"] == "staleness"]
    if st_rows:
        lines += ["## Staleness study: async ps, softmax regression, plain SGD", "",
                  "Batch 100, one step per call, constant learning rate, as in the classic "
                  "walk-through. Staleness: updates other workers applied between a step's read "
                  "of the weights and its own update.", "",
                  "| workers | learning rate | staleness mean | p99 | max | test accuracy | examples/s |",
                  "|---|---|---|---|---|---|---|"]
        for row in st_rows:
            if not row["ok"]:
                lines.append(f"| {row['workers']} | {row['variant']} | FAILED | | | | |")
                continue
            st = row["staleness"] or {}
            lines.append(f"| {row['workers']} | {_fmt(row.get('learning_rate'), 'g')} "
                         f"| {_fmt(st.get('mean'), '.2f')} | {_fmt(st.get('p99'), 'g')} "
                         f"| {_fmt(st.get('max'), 'g')} | {row['test_accuracy']:.4f} "
                         f"| {row['examples_per_sec']:,.0f} |")
        lines.append("")
    lines += render_links(rows)
    lines += scaling.render(rows)
    lines += sparse.render(rows)
    lines += model_parallel.render(rows)
    lines += ["## Targets (ratios measured in this run)", ""]
    for t in targets:
        mark = {True: "met", False: "**missed**", None: "not measured"}[t["met"]]
        lines.append(f"- {t['target']}: {mark}: {t['text']}")
    return "\n".join(lines) + "\n"


def render_links(rows: list[dict]) -> list[str]:
    """The section on the network's limit (pure): every scenario cell on shaped links."""
    linked = [r for r in rows if r.get("link") and not r["peer"] and r["scenario"] in SCENARIOS]
    if not linked:
        return []
    lines = ["## Against the network's limit (cells on shaped links)", "",
             "Bytes: each simulated host's interface counters over the run whose examples/s "
             "the row shows, per step (headers included). *Busiest link*: the host and "
             "direction that moved the most; the traffic model's figure for it beside "
             "(`docs/performance.md`); *worst host*: the host and direction where the model "
             "is furthest off. *Link limit*: the examples/s at which the busiest link would "
             "be busy all the time (its set rate over its bytes per step, times the global "
             "batch); *fraction*: of it reached. ps-sync's update reads the weights only "
             "after the gradients came in, so its *serial limit* adds both directions.", "",
             "| strategy | examples/s | busiest link | MB per step | model | measured ÷ model "
             "| worst host, measured ÷ model | link limit, examples/s | fraction "
             "| serial limit, fraction |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for row in linked:
        link = row["link"]
        worst = link.get("model_worst") or {}
        serial = (f"{link['serial_limit_examples_per_sec']:,.0f}, {link['serial_fraction']:.0%}"
                  if "serial_fraction" in link else "")
        lines.append(
            f"| {_label(row)} | {row['examples_per_sec']:,.0f} "
            f"| {link['host']} {link['direction']} ({', '.join(link['tasks'])}) "
            f"| {link['bytes_per_step'] / 1e6:.3f} "
            f"| {_fmt((link.get('model_bytes_per_step') or 0) / 1e6 or None, '.3f')} "
            f"| {_fmt(link.get('model_ratio'), '.2f')} "
            f"| {worst.get('host', '–')} {worst.get('direction', '')} "
            f"{_fmt(worst.get('ratio'), '.2f')} "
            f"| {link['limit_examples_per_sec']:,.0f} | {link['fraction']:.0%} | {serial} |")
    return lines + [""]


def _table_row(row: dict) -> str:
    if not row["ok"] and "examples_per_sec" not in row:
        logs = ", ".join(f"runs/{n}.log" for n in row["failed"])
        return f"| {_label(row)} | {row['workers']} | FAILED (see {logs}) | | | | | | | |"
    st = row.get("staleness")
    stale = f"{st['mean']:.2f} / {st['p99']:g}" if st else ""
    steps = row.get("steps_per_worker") or {}
    share = " / ".join(str(v) for v in steps.values()) if len(steps) > 1 else ""
    failed = f" (FAILED: {', '.join(row['failed'])})" if row["failed"] else ""
    return (f"| {_label(row)} | {row['workers']} | {row['examples_per_sec']:,.0f} "
            f"| {_fmt(row.get('ratio'), '.2f')} | {_fmt(row.get('test_accuracy'), '.4f')} "
            f"| {_fmt(row.get('time_to_target'), '.1f', 'not reached')} | {stale} "
            f"| {_fmt(row.get('dropped'), 'd', '')} | {share} | {_runs_cell(row)}{failed} |")


# --- plots -----------------------------------------------------------------------

MARKERS = ("o", "s", "^", "D", "v", "P", "X")
LINESTYLES = ("-", "--", "-.", ":")


def short_machine(machine: str) -> str:
    return machine.split(", Linux")[0]


def plot(rows: list[dict], results: dict[str, dict], out: str, machine: str) -> list[str]:
    """The throughput bars, the accuracy curves per scenario and the staleness
    study, each drawn when its rows exist; the PNGs' paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    where = short_machine(machine)
    srows = [r for r in rows if r["scenario"] in SCENARIOS and not r["peer"]
             and "examples_per_sec" in r]
    base = next((r for r in rows if r["config"] == BASELINE and "examples_per_sec" in r), None)
    scen = [s for s in SCENARIOS if any(r["scenario"] == s for r in srows)]
    keys = list(dict.fromkeys(r["variant"] for r in srows))
    # One colour, marker and line per strategy in every plot and panel.
    legend = {v.key: v.generic for v in variants(2, tuple(strategy_kinds.all_kinds()))}
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    styles = {BASELINE: dict(color="black", marker="*", linestyle=":")}
    for i, key in enumerate(keys):
        styles[key] = dict(color=colours[i % len(colours)], marker=MARKERS[i % len(MARKERS)],
                           linestyle=LINESTYLES[i % len(LINESTYLES)])
    kept = dict(where=where, out=out, styles=styles, legend=legend)
    if srows:
        paths.append(_plot_throughput(plt, srows, scen, keys, base, **kept))
    if scen:
        paths.append(_plot_accuracy(plt, rows, results, srows, scen, **kept))
    st = [r for r in rows if r["scenario"] == "staleness" and "examples_per_sec" in r]
    if st:
        paths.append(_plot_staleness(plt, st, where, out))
    scaled = scaling.plot(plt, rows, where, out, save)
    piped = model_parallel.plot(plt, rows, where, out, save)
    return paths + [p for p in (scaled, piped) if p]


def _plot_throughput(plt, srows, scen, keys, base, *, where, out, styles, legend) -> str:
    fig, ax = plt.subplots(figsize=(9, 4.8))
    width = 0.8 / max(1, len(keys))
    for i, key in enumerate(keys):
        xs, ys, lows, highs = [], [], [], []
        for j, s in enumerate(scen):
            row = next((r for r in srows if r["scenario"] == s and r["variant"] == key), None)
            if row is None:
                continue
            each = row["examples_per_sec_each"]
            xs.append(j + (i - (len(keys) - 1) / 2) * width)
            ys.append(row["examples_per_sec"])
            lows.append(row["examples_per_sec"] - min(each))
            highs.append(0)
        ax.bar(xs, ys, width, label=legend.get(key, key), hatch=("", "//", "..", "xx", "\\\\")[i % 5],
               color=styles[key]["color"], edgecolor="black", linewidth=0.5)
        # Run-to-run spread: from the slowest run up to the best (the bar).
        ax.errorbar(xs, ys, yerr=[lows, highs], fmt="none", ecolor="black", capsize=3,
                    linewidth=1)
    if base is not None:
        ax.axhline(base["examples_per_sec"], color="grey", linestyle="--", linewidth=1,
                   label=f"none (1 process): {base['examples_per_sec']:,.0f}")
    ax.set_xticks(range(len(scen)))
    ax.set_xticklabels([SCENARIOS[s].label for s in scen])
    ax.set_ylabel("examples/s (steady state; bar: best run, whisker: slowest run)")
    ax.set_title(f"Throughput per scenario and strategy\n{where}", fontsize=10)
    ax.legend(fontsize=8, ncol=3, loc="upper right")
    return save(fig, out, "scenarios_throughput.png")


def _plot_accuracy(plt, rows, results, srows, scen, *, where, out, styles, legend) -> str:
    acc_runs = {row["config"]: run["name"] for row in rows if not row["peer"]
                for run in row.get("runs", ()) if run["phase"] == "accuracy"}
    cols = 2
    nrows = (len(scen) + 1) // 2
    fig, axes = plt.subplots(nrows, cols, figsize=(10, 3.6 * nrows), squeeze=False)
    for ax, s in zip(axes.flat, scen):
        target = next((r.get("target") for r in srows if r["scenario"] == s), None)
        configs = ([BASELINE] if s == UNIFORM else []) + \
            [r["config"] for r in srows if r["scenario"] == s]
        low = 1.0
        for config in configs:
            res = results.get(acc_runs.get(config, ""), {})
            curve = res.get("eval_curve") or []
            if not curve:
                continue
            ys = [p["test_accuracy"] for p in curve]
            low = min(low, min(ys))
            key = config.split("/")[-1]
            ax.plot([p["seconds"] for p in curve], ys, markersize=4,
                    label=legend.get(key, key), **styles[key])
        if target is not None:
            ax.axhline(target, color="grey", linestyle=":", linewidth=1)
            ax.set_ylim(max(low - 0.005, target - 0.08), 1.0)
        ax.set_title(textwrap.fill(SCENARIOS[s].title, 60), fontsize=9)
        ax.set_xlabel("seconds since start (evaluation excluded)", fontsize=8)
        ax.set_ylabel("test accuracy", fontsize=8)
        ax.legend(fontsize=7, loc="lower right")
    for ax in list(axes.flat)[len(scen):]:
        ax.axis("off")
    fig.suptitle(f"Test accuracy against time, per scenario (dotted: target) — {where}",
                 fontsize=10)
    return save(fig, out, "scenarios_accuracy.png")


def _plot_staleness(plt, st, where, out) -> str:
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    lrs = sorted({r["learning_rate"] for r in st})
    for i, lr in enumerate(lrs):
        pts = sorted((r["workers"], r) for r in st if r["learning_rate"] == lr)
        ws = [w for w, _ in pts]
        style = dict(marker=MARKERS[i % len(MARKERS)], linestyle=LINESTYLES[i % len(LINESTYLES)])
        left.plot(ws, [(r["staleness"] or {}).get("mean") for _, r in pts],
                  label=f"lr {lr:g}: mean", **style)
        left.plot(ws, [(r["staleness"] or {}).get("p99") for _, r in pts], alpha=0.5,
                  label=f"lr {lr:g}: p99", marker=style["marker"], linestyle=":")
        right.plot(ws, [r["test_accuracy"] for _, r in pts], label=f"lr {lr:g}", **style)
    for ax in (left, right):
        ax.set_xlabel("workers")
        ax.set_xticks(sorted({r["workers"] for r in st}))
        ax.legend(fontsize=8)
    left.set_ylabel("staleness (updates by others between read and apply)")
    right.set_ylabel("final test accuracy")
    left.set_title("Staleness against workers", fontsize=10)
    right.set_title("Accuracy against workers", fontsize=10)
    fig.suptitle(f"Async ps, softmax regression, SGD, batch 100 — {where}", fontsize=10)
    return save(fig, out, "staleness.png")


def save(fig, out: str, name: str) -> str:
    import matplotlib.pyplot as plt

    path = os.path.join(out, name)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# --- the suite -------------------------------------------------------------------

def have_tf_keras() -> bool:
    return importlib.util.find_spec("tf_keras") is not None


SETTINGS_ORDER = ("model", "global batch", "seed", "steps per call", "throughput runs",
                  "accuracy runs", "staleness study", "sparse study", "scaling study",
                  "model-parallel study")


def report_only(out: str) -> int:
    """scenarios.md and the plots again, from a finished suite's scenarios.json."""
    path = os.path.join(out, "scenarios.json")
    try:
        with open(path) as f:
            saved = json.load(f)
        rows, results = saved["rows"], saved["results"]
        machine, seconds = saved["machine"], saved["suite_seconds"]
        # JSON keeps the keys sorted: back to the order the suite wrote them in.
        settings = dict(sorted(saved["settings"].items(), key=lambda kv: (
            SETTINGS_ORDER.index(kv[0]) if kv[0] in SETTINGS_ORDER else len(SETTINGS_ORDER))))
    except (OSError, ValueError, KeyError, TypeError) as err:
        print(f"error: --report-only reads {path!r}, which is missing or not a scenarios "
              f"suite's record ({type(err).__name__}: {err}); run the suite first", file=sys.stderr)
        return 2
    with open(os.path.join(out, "scenarios.md"), "w") as f:
        f.write(render_markdown(rows, check_targets(rows), settings, machine, seconds))
    paths = plot(rows, results, out, machine) if results else []
    print(f"[bench] wrote {out}/scenarios.md, {', '.join(os.path.basename(p) for p in paths)} "
          f"from {path}", flush=True)
    return 0


def run(args: BenchConfig) -> int:
    """The scenarios suite (or, with ``report_only``, its report again); the exit code."""
    if args.report_only:
        return report_only(args.out)
    started = time.perf_counter()
    if args.peers and not os.path.isdir(PEERS_DIR):
        # An installed copy: the peers live in the source checkout only.
        print(f"[bench] no {PEERS_DIR}: the tutorial peers are left out (run from a checkout)",
              flush=True)
        args = replace(args, peers=False)
    try:
        tfk = have_tf_keras()
        runs = plan_runs(args, have_tf_keras=tfk)
    except BenchError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    os.makedirs(args.out, exist_ok=True)
    if args.peers and not tfk:
        print("[bench] tf_keras is not installed (pip install 'tf-keras==2.21.*', or the "
              "project's [bench] extra): the Keras 2 tutorial peers are left out", flush=True)
    results = run_all(runs, args.run_timeout + 60)
    return report(args, runs, results, time.perf_counter() - started)


def report(args: BenchConfig, runs: list[Run], results: dict[str, dict], seconds: float) -> int:
    """The suite's rows, targets, scenarios.md, scenarios.json and plots from its runs'
    records; the exit code (1 if a run failed)."""
    targets = {s: accuracy_length(args, SCENARIOS[s])[2] for s in SCENARIOS}
    studied = [r for r in runs if isinstance(r, sparse.SparseRun)]
    scaled = [r for r in runs if isinstance(r, scaling.ScalingRun)]
    piped = [r for r in runs if isinstance(r, model_parallel.ModelParallelRun)]
    outcomes = load_outcomes(runs)
    rows = summarize(results, [r for r in runs if r not in studied and r not in scaled
                               and r not in piped], targets, outcomes)
    rows += sparse.summarize(results, outcomes, studied)
    rows += scaling.summarize(results, outcomes, scaled)
    rows += model_parallel.summarize(results, outcomes, piped)
    checked = check_targets(rows)
    machine = machine_description()
    uniform_len = f"{args.steps} steps" if args.steps else f"{args.epochs} epochs"
    settings = {
        "model": args.model, "global batch": f"{args.global_batch_size} (more: 120)",
        "seed": args.seed, "steps per call": args.steps_per_execution,
        "throughput runs": f"{args.short_steps} steps",
        "accuracy runs": f"uniform {uniform_len} (eval every {args.eval_every} steps, target "
                         f"{args.target}), other scenarios {args.accuracy_steps} steps (eval every "
                         f"{args.accuracy_eval_every}, target {args.scenario_target})",
        "staleness study": f"{args.staleness_steps} steps per run",
        "sparse study": f"ctr, {args.sparse_steps} steps at global batch {args.sparse_global_batch}",
        "scaling study": f"{args.scaling_steps} steps, workers {args.scaling_workers}",
        "model-parallel study": (f"{model_parallel.TASK}, {model_parallel.STEPS} steps at global "
                                 f"batch {model_parallel.GLOBAL_BATCH}, S {model_parallel.STAGES} "
                                 f"x M {model_parallel.MICRO_BATCHES}"),
    }
    assert tuple(settings) == SETTINGS_ORDER
    markdown = render_markdown(rows, checked, settings, machine, seconds)
    with open(os.path.join(args.out, "scenarios.md"), "w") as f:
        f.write(markdown)
    # The record first: --report-only draws the plots again from it.
    with open(os.path.join(args.out, "scenarios.json"), "w") as f:
        json.dump({"machine": machine, "settings": settings, "suite_seconds": round(seconds, 1),
                   "rows": rows, "targets": checked, "results": results},
                  f, indent=2, sort_keys=True)
    paths = plot(rows, results, args.out, machine) if results else []
    print(markdown, flush=True)
    print(f"[bench] wrote {args.out}/scenarios.md, scenarios.json, "
          f"{', '.join(os.path.basename(p) for p in paths)}; the suite took "
          f"{seconds / 60:.1f} min ({seconds:.0f} s)", flush=True)
    return 0 if all(r["ok"] for r in rows) else 1
