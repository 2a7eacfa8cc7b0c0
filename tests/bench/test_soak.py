"""The soak's pure parts (bench/soak.py); the soak itself is not part of CI."""

import random
import sys

import pytest

from bench import soak
from conftest import REPO
from launcher import policy
from launcher.processes import running_with
from strategies import kinds


@pytest.mark.parametrize("strategy", ["ps", "ps-sync", "multiworker"])
def test_faults_come_from_the_launcher_policy_and_land_mid_run(strategy):
    allowed = {f"--{a}={t}" for a, t in policy.survivable_faults(kinds.get(strategy))}
    rng = random.Random(3)
    for _ in range(20):
        faults = soak.pick_faults(rng, kinds.get(strategy), 1200)
        assert 1 <= len(faults) <= 2
        for fault in faults:
            spec, _, step = fault.partition("@step=")
            assert spec in allowed and 100 <= int(step) < 1100


def test_job_command_turns_on_the_recovery_the_kind_allows():
    ps = soak.job_command(kinds.get("ps"), ["--kill=worker:1@step=200"], 1200, "runs/x")
    mw = soak.job_command(kinds.get("multiworker"), [], 1200, "runs/y")
    assert ps[1] == str(REPO / "launch.py") and "--restart-tasks" in ps
    assert ps[ps.index("--ps") + 1] == "1" and "--kill=worker:1@step=200" in ps
    assert "--restart-tasks" not in mw and mw[mw.index("--ps") + 1] == "0"
    assert ps[ps.index("--strategy") + 1] == "ps"


@pytest.mark.parametrize("argv,words", [
    (["--runs", "0"], "--runs=0"),
    (["--strategies", "mirrored"], "no faults to soak"),
    (["--strategies", "ps,horovod"], "unknown --strategy 'horovod'"),
])
def test_bad_input_is_one_line_and_writes_nothing(argv, words, tmp_path, capsys):
    out = tmp_path / "soak"
    assert soak.main([*argv, "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and words in err[0]
    assert not out.exists()


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
def test_the_leftover_scan_sees_a_live_process_and_not_itself(spawn, tmp_path):
    marker = str(tmp_path / "marker-for-the-scan")
    proc = spawn([sys.executable, "-c", "import sys, time; print('up', flush=True); "
                  "time.sleep(60)", marker])
    proc.wait_for_line("^up$", timeout=30)
    found = running_with(marker)
    assert len(found) == 1 and found[0].startswith(f"{proc.proc.pid}: ")
    proc.kill()
    assert running_with(marker) == []
