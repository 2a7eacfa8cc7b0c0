"""The benchmark's flags as one frozen object (``bench/cli.py`` builds it once)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BenchConfig:
    # Every run's work (both suites; the scenarios' uniform accuracy runs).
    model: str = "cnn"
    epochs: int = 3
    steps: int | None = None  # overrides epochs
    global_batch_size: int = 128
    seed: int = 42
    steps_per_execution: int = 10
    eval_every: int = 234
    log_every: int = 200
    workers: str = "2"  # worker counts for multiworker and ps, e.g. "1,2,4"
    repeats: int = 2
    only: str | None = None  # a comma-separated subset of common.KINDS
    target: float = 0.99
    data_dir: str | None = None
    out: str = "results"
    run_timeout: float = 900.0
    suite: str = "default"  # or "scenarios"
    # --suite scenarios only.
    scenarios: str | None = None
    short_steps: int = 200
    short_scenarios: str = "uniform,slow,links,more"
    accuracy_steps: int = 160
    accuracy_eval_every: int = 40
    scenario_target: float = 0.97
    peers: bool = True
    peer_repeats: int = 2
    staleness_workers: str = "1,2,4"
    staleness_lrs: str = "0.05,0.5,2"
    staleness_steps: int = 300
    sparse_steps: int = 400
    sparse_global_batch: int = 512
    scaling_workers: str = "1,2,3,4"
    scaling_steps: int = 200
    report_only: bool = False
