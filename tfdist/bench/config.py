"""The benchmark's flags as one frozen object (``tfdist.cli.bench`` builds it once).

Each field is one ``bench.py`` flag, declared once with ``tfdist.flags.option``
(its default and help here, nowhere else): a new benchmark option is one field.
"""

from __future__ import annotations

from dataclasses import dataclass

from tfdist.flags import option

SCENARIOS_GROUP = "--suite scenarios (the flags above set the uniform accuracy runs)"
PREDICT_GROUP = "--predict (the target cluster; --workers gives its worker counts)"


def _kinds() -> str:
    from tfdist.bench.common import KINDS

    return ",".join(KINDS)


def _models() -> tuple[str, ...]:
    from tfdist.models import MODEL_NAMES

    return tuple(MODEL_NAMES)


def _scenarios_help() -> str:
    from tfdist.bench.suites.scenario_plan import SCENARIOS, STUDIES

    return (f"comma-separated subset of the scenarios {','.join(SCENARIOS)} and the studies "
            f"{','.join(STUDIES)} (sparse: the ctr task under each strategy; scaling: 1-4 "
            "workers on 100 Mbit/s links; model-parallel: the pipeline on a model made for "
            "cutting)")


@dataclass(frozen=True)
class BenchConfig:
    """bench.py's flags: every run's work, the suite and its scenarios, and the
    predictor's target cluster (``--predict``, ``--predict-check``)."""

    # Every run's work (both suites; the scenarios' uniform accuracy runs).
    model: str = option("cnn", "the built-in model every run trains (train.py --model)",
                        choices=_models)
    epochs: int = option(3, "epochs of each run", metavar="N")
    steps: int | None = option(None, "total steps of each run; overrides --epochs", metavar="N",
                               unset="--epochs' steps")
    global_batch_size: int = option(128, "global batch of every run", metavar="N")
    seed: int = option(42, "every run's seed", metavar="N")
    steps_per_execution: int = option(10, "steps per tf.function call in every run",
                                      metavar="N")
    eval_every: int = option(234, "steps between test evaluations (the accuracy curves)",
                             metavar="N")
    log_every: int = option(200, "steps between progress lines", metavar="N")
    workers: str = option("2", "worker counts for multiworker and ps, e.g. 1,2,4 (a scaling "
                          "curve)", metavar="N[,N...]")
    repeats: int = option(2, "runs of each configuration, interleaved; a row shows the best",
                          metavar="N")
    only: str | None = option(None, lambda: f"comma-separated subset of {_kinds()}",
                              metavar="KIND[,KIND...]", unset="all of them")
    target: float = option(0.99, "test accuracy for time-to-target", metavar="ACCURACY")
    data_dir: str | None = option(None, "tfds data dir (train.py --data-dir)", metavar="DIR",
                                  unset="TFDS_DATA_DIR, else tfds's own")
    out: str = option("results", "where results, tables and plots are written", metavar="DIR")
    run_timeout: float = option(900.0, "seconds one run may take before it is stopped",
                                metavar="SECONDS")
    suite: str = option("default", "the suite to run: default, every strategy on a uniform "
                        "cluster; scenarios, which strategy when (slow worker, slow links, "
                        "more workers, tutorial peers, staleness); or evaluation, the final "
                        "evaluation shared by 2 workers at half a core against the chief alone",
                        choices=("default", "scenarios", "evaluation"))
    # --suite scenarios only.
    scenarios: str | None = option(None, _scenarios_help, metavar="NAME[,NAME...]",
                                   group=SCENARIOS_GROUP, unset="all")
    short_steps: int = option(200, "steps of each throughput run (0: no throughput pass)",
                              metavar="N", group=SCENARIOS_GROUP)
    short_scenarios: str = option(
        "uniform,slow,links,more", "scenarios whose cells also get a short throughput run (a "
        "second measurement, interleaved); the others run each cell once ('' for none)",
        metavar="NAME[,NAME...]", group=SCENARIOS_GROUP)
    accuracy_steps: int = option(160, "steps of the accuracy runs of the scenarios other than "
                                 "uniform", metavar="N", group=SCENARIOS_GROUP)
    accuracy_eval_every: int = option(40, "steps between test evaluations in those runs",
                                      metavar="N", group=SCENARIOS_GROUP)
    scenario_target: float = option(0.97, "test accuracy for time-to-target in the scenarios "
                                     "other than uniform", metavar="ACCURACY",
                                     group=SCENARIOS_GROUP)
    peers: bool = option(True, "leave out the tutorial peers (tfdist/bench/peers/)",
                         flag="--no-peers", group=SCENARIOS_GROUP)
    peer_repeats: int = option(2, "rounds of each peer and the run it is compared with "
                               "(interleaved; each side's best counts)", metavar="N",
                               group=SCENARIOS_GROUP)
    staleness_workers: str = option("1,2,4", "async ps worker counts of the staleness study "
                                    "('' to skip it)", metavar="N[,N...]",
                                    group=SCENARIOS_GROUP)
    staleness_lrs: str = option("0.05,0.5,2", "the staleness study's SGD learning rates",
                                metavar="RATE[,RATE...]", group=SCENARIOS_GROUP)
    staleness_steps: int = option(300, "steps of each staleness study run", metavar="N",
                                  group=SCENARIOS_GROUP)
    sparse_steps: int = option(400, "steps of each sparse study run", metavar="N",
                               group=SCENARIOS_GROUP)
    sparse_global_batch: int = option(512, "global batch of the sparse study (the same under "
                                      "every strategy)", metavar="N", group=SCENARIOS_GROUP)
    scaling_workers: str = option("1,2,3,4", "worker counts of the scaling study",
                                  metavar="N[,N...]", group=SCENARIOS_GROUP)
    scaling_steps: int = option(200, "steps of each scaling study run", metavar="N",
                                group=SCENARIOS_GROUP)
    predict: str | None = option(
        None, "run nothing: from the measured run in RUN_DIR (its results.json and "
        "launch/outcome.json; a one-worker run is the short profiling run), predict examples/s "
        "of multiworker, ps and ps-sync at each of --workers on the target cluster below, and "
        "the term that bounds each step (tfdist/bench/predict.py)", metavar="RUN_DIR",
        group=PREDICT_GROUP)
    predict_check: str | None = option(
        None, "run nothing: fit the predictor's costs on the runs DIR/plan.json names, predict "
        "every run under DIR/runs and write DIR/scale.md, scale.json and the plots "
        "(tfdist/bench/scale.py)", metavar="DIR", group=PREDICT_GROUP)
    predict_ps: int = option(1, "ps tasks of the target cluster", metavar="N",
                             group=PREDICT_GROUP)
    predict_link_rate: str | None = option(None, "every host's link rate, as launch.py "
                                           "--link-rate takes it (100mbit, 1gbit)",
                                           metavar="RATE", group=PREDICT_GROUP,
                                           unset="unshaped: no rate bound")
    predict_gradient_dtype: str = option("float32", "the gradients' dtype on the wire",
                                         choices=("float32", "bfloat16"), group=PREDICT_GROUP)
    predict_accumulation: int = option(1, "batches accumulated per step", metavar="N",
                                       group=PREDICT_GROUP)
    predict_shard_state: str = option("off", "multiworker's --shard-state",
                                      choices=("off", "optimizer", "gradients"),
                                      group=PREDICT_GROUP)
    predict_host_cpus: float | None = option(None, "each host's cores (the compute scales as "
                                             "1/C)", metavar="C", group=PREDICT_GROUP,
                                             unset="the measured run's budget")
    predict_latency_us: float = option(0.0, "microseconds each message round costs (a ring "
                                       "has 2(N-1) a step)", metavar="US", group=PREDICT_GROUP)
    predict_ps_own_hosts: bool = option(False, "each ps on a machine of its own (the "
                                        "launcher's simulated cluster puts the chief and "
                                        "every ps on one host)", group=PREDICT_GROUP)
    report_only: bool = option(False, "run nothing: write scenarios.md and the plots again "
                               "from <out>/scenarios.json (a finished suite's figures)",
                               group=SCENARIOS_GROUP)
