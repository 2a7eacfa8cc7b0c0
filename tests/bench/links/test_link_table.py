"""The link table (pure): its rows, its runs and the figures behind exposed compute."""

import pytest

from tfdist.bench.links import table as lt
from tfdist.cli.tools import link_table as cli

MBIT100 = 100_000_000


def _outcome(tx, rx=900_000, steps=100):
    return {"link": {"set_bits_per_sec": MBIT100, "measured_bits_per_sec": 0.964 * MBIT100},
            "traffic": {"steps": steps, "hosts": {
                "host0": {"tasks": ["worker:0"], "tx_bytes_per_step": tx,
                          "rx_bytes_per_step": rx},
                "host1": {"tasks": ["worker:1"], "tx_bytes_per_step": rx,
                          "rx_bytes_per_step": tx}}}}


def test_each_row_runs_shaped_then_unshaped_with_its_own_flags(tmp_path):
    rows = [lt.Row("multiworker", 2, "bfloat16", 4), lt.Row("ps", 2, read_ahead=True)]
    runs = lt.plan(rows, str(tmp_path), 200, 128, "100mbit", 300.0, python="py")
    assert [(r.key, shaped) for r, shaped, _ in runs] == [
        ("multiworker-w2-bf16-acc4", True), ("multiworker-w2-bf16-acc4", False),
        ("ps-ahead-w2-f32-acc1", True), ("ps-ahead-w2-f32-acc1", False)]
    shaped_cmd, unshaped_cmd = runs[0][2].cmd, runs[1][2].cmd
    assert "--link-rate" in shaped_cmd and "--link-rate" not in unshaped_cmd
    assert shaped_cmd[shaped_cmd.index("--") + 1:][:-1] == unshaped_cmd[
        unshaped_cmd.index("--") + 1:][:-1]  # the same job, but for its run directory
    assert ["--gradient-accumulation-steps", "4"] == list(
        shaped_cmd[shaped_cmd.index("--gradient-accumulation-steps"):][:2])
    ps_cmd = runs[2][2].cmd
    assert "--ps" in ps_cmd and ps_cmd[ps_cmd.index("--read-ahead") + 1] == "on"
    assert len({r.model_dir for _, _, r in runs}) == 4


def test_exposed_compute_is_what_the_transfer_does_not_explain():
    # 1 MB on the busiest link at 12.5 MB/s: 80 ms. A shaped step of 100 ms and an
    # unshaped one of 50 ms leave 20 ms of the 50 exposed: 0.4.
    row = lt.Row("multiworker", 2)
    shaped = {"examples_per_sec": 1280.0, "global_batch_size": 128}
    unshaped = {"examples_per_sec": 2560.0, "global_batch_size": 128}
    f = lt.figures(row, shaped, _outcome(1_000_000), unshaped)
    assert f["transfer_ms"] == pytest.approx(80.0)
    assert f["step_ms"] == pytest.approx(100.0) and f["compute_ms"] == pytest.approx(50.0)
    assert f["exposed_compute"] == pytest.approx(0.4)
    assert f["fraction"] == pytest.approx(0.8)
    assert f["busiest"] == "host0 tx"


def test_a_step_of_accumulation_counts_all_its_batches():
    row = lt.Row("multiworker", 2, accumulation=4)
    shaped = {"examples_per_sec": 1280.0, "global_batch_size": 128,
              "gradient_accumulation_steps": 4}
    f = lt.figures(row, shaped, _outcome(1_000_000), None)
    assert f["step_ms"] == pytest.approx(400.0)  # 512 examples a step
    assert f["bytes_per_example"] == pytest.approx(1_000_000 / 512)
    assert "exposed_compute" not in f  # no unshaped run to compare with
    assert "| multiworker-w2-f32-acc4 |" in lt.markdown([f], "100mbit")


def test_an_unknown_row_is_one_line_and_exit_2(capsys):
    assert cli.main(["--rows", "ps-w3-f32-acc1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "'ps-w3-f32-acc1' is not a row" in err[0]


def test_the_carried_row_asks_for_it():
    row = lt.Row("multiworker", 2, carry=True)
    assert row.key == "multiworker-carry-w2-f32-acc1"
    assert row.flags()[-2:] == ["--carry-all-reduce", "on"]
    assert row in lt.all_rows() and "--carry-all-reduce" not in lt.Row("multiworker", 2).flags()
