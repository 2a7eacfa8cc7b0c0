"""How near each data-parallel kind comes to its link's limit, and where the rest goes.

    python -m tfdist.cli.tools.link_table --out results/links/link_table

Every row is one job run twice, interleaved: on simulated hosts with links
shaped to ``--link-rate`` (each computing task on a host of its own, the ps
and its chief on one more), and on unshaped links (the same processes,
where the cores are the bound). From the two runs' records:

* **fraction** of the link limit (``bench.links``: the examples/s at which
  the busiest link would be busy all the time);
* the **time breakdown** of a shaped step: ``transfer`` (the busiest link's
  bytes per step at the set rate), ``compute`` (the unshaped step), and
  **exposed compute** = (shaped step - transfer) / unshaped step: 1 when
  compute and transfers take turns, 0 when the transfers hide all compute
  (an all-reduce that ends inside its step cannot hide the forward pass:
  hiding the whole backward pass leaves about 0.35 of the step;
  ``--carry-all-reduce on`` hides the first layers' forward pass too).

Rows: ``multiworker`` and ``ps`` (``ps`` also with ``--read-ahead on``, ``multiworker``
with ``--carry-all-reduce on``),
float32 and bfloat16 gradients, gradient accumulation x1 and x4, 2 and 4
workers (``--rows`` picks some). A step of accumulation x4 is 4 global
batches: its examples/s and its link limit count them.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass

from tfdist.bench import link_limit
from tfdist.bench.common import Run, cell, cluster_prefix, machine_description, run_one
from tfdist.strategies import kinds as strategy_kinds

LINK_RATE = "100mbit"


@dataclass(frozen=True)
class Row:
    """One configuration: a kind, its workers and the flags that make the row."""

    kind: str
    workers: int
    dtype: str = "float32"
    accumulation: int = 1
    read_ahead: bool = False
    carry: bool = False  # multiworker: --carry-all-reduce on

    @property
    def key(self) -> str:
        return (f"{self.kind}{'-ahead' if self.read_ahead else ''}"
                f"{'-carry' if self.carry else ''}-w{self.workers}-"
                f"{'bf16' if self.dtype == 'bfloat16' else 'f32'}-acc{self.accumulation}")

    def flags(self) -> list[str]:
        out = ["--gradient-dtype", self.dtype]
        if self.accumulation > 1:
            out += ["--gradient-accumulation-steps", str(self.accumulation)]
        if self.read_ahead:
            out += ["--read-ahead", "on"]
        if self.carry:
            out += ["--carry-all-reduce", "on"]
        return out


def all_rows() -> list[Row]:
    rows = []
    for kind in ("multiworker", "ps"):
        for workers in (2, 4):
            for dtype in ("float32", "bfloat16"):
                for accumulation in (1, 4):
                    rows.append(Row(kind, workers, dtype, accumulation))
    rows += [Row("ps", 2, "float32", 1, True), Row("ps", 2, "bfloat16", 1, True),
             Row("multiworker", 2, "float32", 1, carry=True)]
    return rows


def plan(rows: list[Row], out: str, steps: int, batch: int, link_rate: str, timeout: float,
         python: str = sys.executable) -> list[tuple[Row, bool, Run]]:
    """(row, shaped, run) for each row: the shaped run, then the unshaped one (pure)."""
    runs = []
    for row in rows:
        kind = strategy_kinds.get(row.kind)
        for shaped in (True, False):
            name = f"{row.key}-{'shaped' if shaped else 'unshaped'}"
            model_dir = os.path.join(out, "runs", name)
            prefix = cluster_prefix(python, kind, row.workers, timeout,
                                    link_rate=link_rate if shaped else None)
            cmd = [*prefix, "--model", "cnn", "--steps", str(steps), "--global-batch-size",
                   str(batch), "--eval-every", "0", "--log-every", str(steps),
                   *row.flags(), "--model-dir", model_dir]
            runs.append((row, shaped, Run(name, row.kind, row.workers, tuple(cmd), model_dir,
                                          row.key)))
    return runs


def figures(row: Row, shaped: dict, outcome: dict | None, unshaped: dict | None) -> dict:
    """A row's figures from its shaped run's results and launch outcome and its unshaped
    run's results (pure)."""
    link = link_limit.figures(shaped, outcome) or {}
    examples = shaped["global_batch_size"] * (shaped.get("gradient_accumulation_steps") or 1)
    step = examples / shaped["examples_per_sec"]
    out = {"row": row.key, "kind": row.kind, "workers": row.workers, "dtype": row.dtype,
           "accumulation": row.accumulation, "read_ahead": row.read_ahead, "carry": row.carry,
           "examples_per_sec": shaped["examples_per_sec"], "step_ms": step * 1e3,
           "test_accuracy": shaped.get("test_accuracy"),
           "staleness_mean": (shaped.get("staleness") or {}).get("mean")}
    if link:
        transfer = link["bytes_per_step"] / (link["link_bits_per_sec"] / 8)
        out.update(busiest=f"{link['host']} {link['direction']}",
                   bytes_per_step=link["bytes_per_step"],
                   bytes_per_example=link["bytes_per_step"] / examples,
                   transfer_ms=transfer * 1e3, fraction=link["fraction"])
    if unshaped:
        compute = examples / unshaped["examples_per_sec"]
        out.update(unshaped_examples_per_sec=unshaped["examples_per_sec"],
                   compute_ms=compute * 1e3)
        if link:
            out["exposed_compute"] = (step - transfer) / compute
    return out


def markdown(table: list[dict], link_rate: str) -> str:
    head = ("| row | examples/s | busiest link | kB per example | shaped step ms | transfer ms "
            "| unshaped step ms | exposed compute | fraction of link limit | staleness mean "
            "| test accuracy |\n" + "|---" * 11 + "|\n")
    lines = []
    for r in table:
        per_example = r.get("bytes_per_example")
        cells = [cell(r.get(key), spec, "") for key, spec in (
            ("transfer_ms", ".1f"), ("compute_ms", ".1f"), ("exposed_compute", ".2f"),
            ("fraction", ".2f"), ("staleness_mean", ".2f"), ("test_accuracy", ".4f"))]
        lines.append(
            f"| {r['row']} | {r['examples_per_sec']:,.0f} | {r.get('busiest', '')} "
            f"| {cell(per_example and per_example / 1e3, '.2f', '')} | {r['step_ms']:.1f} | "
            + " | ".join(cells) + " |")
    return (f"Links shaped to {link_rate} each way; {machine_description()}.\n\n"
            + head + "\n".join(lines) + "\n")


@dataclass(frozen=True)
class LinkTableConfig:
    """The study's flags (``tfdist/cli/tools/link_table.py``), checked."""
    out: str = "results/links/link_table"
    rows: tuple[str, ...] = ()  # empty: every row
    steps: int = 200
    global_batch_size: int = 128
    link_rate: str = LINK_RATE
    run_timeout: float = 600.0


def run(config: LinkTableConfig) -> int:
    """Every row's two runs, then ``link_table.json`` and ``.md``; 1 if a row has no shaped run."""
    rows = [r for r in all_rows() if not config.rows or r.key in config.rows]
    runs = plan(rows, config.out, config.steps, config.global_batch_size, config.link_rate,
                config.run_timeout)
    done: dict[tuple[str, bool], tuple[dict, dict | None]] = {}
    for row, shaped, one in runs:
        results = run_one(one, config.run_timeout + 60, log=lambda m: print(m, flush=True))
        if results is not None:
            outcome = None
            if os.path.exists(one.outcome_file):
                with open(one.outcome_file) as fh:
                    outcome = json.load(fh)
            done[(row.key, shaped)] = (results, outcome)
    table = []
    for row in rows:
        if (row.key, True) not in done:
            continue
        shaped, outcome = done[(row.key, True)]
        unshaped = done.get((row.key, False), (None, None))[0]
        table.append(figures(row, shaped, outcome, unshaped))
    os.makedirs(config.out, exist_ok=True)
    with open(os.path.join(config.out, "link_table.json"), "w") as fh:
        json.dump({"link_rate": config.link_rate, "load_average": os.getloadavg(),
                   "rows": table}, fh, indent=1)
    text = markdown(table, config.link_rate)
    with open(os.path.join(config.out, "link_table.md"), "w") as fh:
        fh.write(text)
    print(text)
    return 0 if len(table) == len(rows) else 1
