"""``python -m tfdist.cli.tools.xla``: examples/s with and without ``jit_compile=True``, the
same model under each strategy, the runs interleaved.

The task is this module's (``tfdist.bench.xla:WITH_XLA`` / ``:WITHOUT_XLA``): an
MLP on planted in-memory data, compiled with or without XLA, nothing else
different. Each round runs every strategy twice, without and with XLA, in the
order of the round (the second round the other way round), so a slower minute of
a shared host falls on both; a cell's figure is the better of its runs (only
interference slows a run). Under ``multiworker`` XLA compiles each replica's
forward and backward pass (the all-reduce and the update outside it), under
``ps``/``ps-sync`` the same on the weights' values read from the ps (the row
``ps-read-ahead``: ``ps`` with ``--read-ahead on``, those reads made during the
step before), under ``none`` the whole step (``StrategyKind.jit_compiles``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass

from tfdist import protocol

FEATURES, CLASSES, TRAIN, TEST = 256, 10, 16384, 1024
CLUSTER = {"none": [], "multiworker": ["--workers", "2"], "ps": ["--workers", "2", "--ps", "1"],
           "ps-sync": ["--workers", "2", "--ps", "1"],
           "ps-read-ahead": ["--workers", "2", "--ps", "1"]}
# A row that is a strategy with a flag: ps with each step's weights read during the one
# before (the read XLA waits for is then off the step's path).
ROW_FLAGS = {"ps-read-ahead": ("ps", ["--read-ahead", "on"])}


class Mlp:
    """Three 512-wide Dense layers with LayerNormalization: elementwise work XLA fuses."""

    def __init__(self, jit: bool):
        self.jit = jit

    def build_model(self):
        import keras

        keras.utils.set_random_seed(0)
        x = keras.Input((FEATURES,))
        h = x
        for _ in range(3):
            h = keras.layers.Dense(512, activation="gelu")(h)
            h = keras.layers.LayerNormalization()(h)
        model = keras.Model(x, keras.layers.Dense(CLASSES)(h))
        model.compile(optimizer=keras.optimizers.Adam(1e-3), metrics=["accuracy"],
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      jit_compile=self.jit)
        return model

    def dataset(self, split):
        import numpy as np

        rng = np.random.default_rng(0 if split == "train" else 1)
        n = TRAIN if split == "train" else TEST
        x = rng.normal(size=(n, FEATURES)).astype("float32")
        planted = np.random.default_rng(2).normal(size=(FEATURES, CLASSES))
        return x, (x @ planted).argmax(axis=1).astype("int32")


WITH_XLA, WITHOUT_XLA = Mlp(True), Mlp(False)


def command(repo: str, strategy: str, jit: bool, steps: int, batch: int, model_dir: str):
    train = ["--task", "tfdist.bench.xla:" + ("WITH_XLA" if jit else "WITHOUT_XLA"),
             "--steps", str(steps), "--global-batch-size", str(batch), "--log-every",
             str(steps), "--steps-per-execution", "10", "--model-dir", model_dir]
    if strategy == "none":
        return [sys.executable, os.path.join(repo, "train.py"), "--strategy", "none", *train]
    kind, flags = ROW_FLAGS.get(strategy, (strategy, []))
    return [sys.executable, os.path.join(repo, "launch.py"), "--strategy", kind,
            *CLUSTER[strategy], "--", *train, *flags]


def run_one(repo, strategy, jit, steps, batch, timeout) -> dict:
    with tempfile.TemporaryDirectory(prefix="xla-bench-") as model_dir:
        proc = subprocess.run(command(repo, strategy, jit, steps, batch, model_dir), cwd=repo,
                              capture_output=True, text=True, timeout=timeout)
        if proc.returncode != 0:
            last = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
            raise SystemExit(f"{strategy} jit={jit} failed (exit {proc.returncode}): {last}")
        r = protocol.Results.load(os.path.join(model_dir, "results.json"))
    return {"examples_per_sec": r.examples_per_sec, "test_accuracy": r.test_accuracy}


def table(runs: dict) -> str:
    """Markdown: per strategy, every run's examples/s without and with XLA, the better of
    each, their ratio and the test accuracy."""
    lines = ["| strategy | without XLA: examples/s (runs) | with XLA: examples/s (runs) "
             "| with / without | test accuracy without / with |", "|---|---|---|---|---|"]
    for strategy, cells in runs.items():
        best = {jit: max(r["examples_per_sec"] for r in cells[jit]) for jit in cells}
        each = {jit: ", ".join(f"{r['examples_per_sec']:,.0f}" for r in cells[jit])
                for jit in cells}
        acc = {jit: cells[jit][-1]["test_accuracy"] for jit in cells}
        lines.append(f"| `{strategy}` | **{best['off']:,.0f}** ({each['off']}) | "
                     f"**{best['on']:,.0f}** ({each['on']}) | {best['on'] / best['off']:.2f}x | "
                     f"{acc['off']:.3f} / {acc['on']:.3f} |")
    return "\n".join(lines)


@dataclass(frozen=True)
class XlaConfig:
    """The study's flags (``tfdist/cli/tools/xla.py``)."""

    strategies: tuple[str, ...]
    steps: int = 300
    global_batch_size: int = 256
    rounds: int = 2
    timeout: float = 600
    out: str | None = None


def run(config: XlaConfig) -> int:
    """Every round's runs, interleaved; the table printed (and every figure in ``out``)."""
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    runs = {s: {"off": [], "on": []} for s in config.strategies}
    for round_ in range(config.rounds):
        order = ("off", "on") if round_ % 2 == 0 else ("on", "off")
        for strategy in config.strategies:
            for jit in order:
                got = run_one(repo, strategy, jit == "on", config.steps,
                              config.global_batch_size, config.timeout)
                runs[strategy][jit].append(got)
                print(f"round {round_ + 1} {strategy} jit={jit}: "
                      f"{got['examples_per_sec']:,.0f} examples/s", flush=True)
    print(table(runs))
    if config.out:
        with open(config.out, "w") as f:
            json.dump(runs, f, indent=1)
    return 0
