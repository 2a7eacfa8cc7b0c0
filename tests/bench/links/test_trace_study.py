"""``python -m tfdist.cli.tools.trace_study``: a run's link trace as a table and a picture."""

import json
import os

import pytest

from tfdist.bench.links import trace_study as link_trace
from tfdist.cli.tools import trace_study as cli
from tfdist.launcher.machine import linktrace

RATE = 100e6


def _write(run_dir, trace) -> None:
    os.makedirs(os.path.join(run_dir, "launch"), exist_ok=True)
    with open(os.path.join(run_dir, "launch", "link_trace.json"), "w") as f:
        json.dump(trace, f)


def _trace(n=300):
    """host0 sends at the full rate in one sample of three, host1 receives it."""
    samples, sent = [], 0
    for i in range(n + 1):
        samples.append((i * 0.01, {0: {"tx_bytes": sent, "rx_bytes": 0},
                                   1: {"tx_bytes": 0, "rx_bytes": sent}}))
        sent += 125_000 if i % 3 == 0 else 0
    return {**linktrace.record(samples, 0.01), "rate_bits_per_sec": RATE,
            "host_tasks": {"host0": ["chief:0", "ps:0"], "host1": ["worker:0"]},
            "training_seconds": [0.5, 2.5]}


def test_table_has_each_host_and_direction_with_its_figures():
    text = link_trace.table(_trace())
    assert "| host0 (chief:0, ps:0) | out | 0.33 | 0.33 | 0.67 |" in text
    assert "| host1 (worker:0) | in | 0.33 | 0.33 | 0.67 |" in text
    assert "| host1 (worker:0) | out | 0.00 | 0.00 | 1.00 |" in text


def test_window_starts_at_the_training_steps_and_spans_what_was_asked():
    times, use = link_trace.window(_trace(), start=0.2, seconds=0.5)
    assert 49 <= len(times) <= 51 and times[0] == pytest.approx(0.2, abs=0.011)
    assert sum(v >= 0.99 for v in use["host0"]["tx"]) in (16, 17)


def test_main_prints_the_table_and_draws_the_picture(tmp_path, capsys):
    run = str(tmp_path / "run")
    _write(run, _trace())
    png = str(tmp_path / "links.png")
    assert cli.main([run, "--png", png, "--start", "0.5", "--seconds", "1"]) == 0
    assert "host0 (chief:0, ps:0)" in capsys.readouterr().out
    assert os.path.getsize(png) > 5000


@pytest.mark.parametrize("setup,argv_extra,words", [
    (None, [], "no launch/link_trace.json"),
    ({"seconds": [0.0]}, [], "is not a link trace"),
    ("{not json", [], "is not a link trace"),
    (None, ["--seconds", "0"], "the span more than 0"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys, setup, argv_extra, words):
    run = str(tmp_path / "run")
    if isinstance(setup, dict):
        _write(run, setup)
    elif isinstance(setup, str):
        os.makedirs(os.path.join(run, "launch"))
        with open(os.path.join(run, "launch", "link_trace.json"), "w") as f:
            f.write(setup)
    assert cli.main([run, *argv_extra]) == 2
    err = capsys.readouterr().err.strip()
    assert words in err and len(err.splitlines()) == 1
