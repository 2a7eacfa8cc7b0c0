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
``bench/suites/sparse.py``): the ``ctr`` task, whose table is split over 2 ps.
Targets are ratios measured in this run.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import time
from dataclasses import replace

from tfdist.bench.suites import model_parallel, scaling, sparse
from tfdist.bench.common import BenchError, Run, load_outcomes, machine_description, run_all
from tfdist.bench.config import BenchConfig
from tfdist.bench.suites.scenario_plan import PEERS_DIR, SCENARIOS, accuracy_length, plan_runs
from tfdist.bench.suites.scenario_summary import check_targets, summarize
from tfdist.bench.suites.scenario_report import plot, render_markdown


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
        "model-parallel study": (
            ", ".join(f"{t} at global batch {b}" for t, b in model_parallel.TASKS)
            + f", {model_parallel.STEPS} steps, S {model_parallel.STAGES} x M "
            f"{model_parallel.MICRO_BATCHES} x {'|'.join(model_parallel.SCHEDULES)}"),
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
