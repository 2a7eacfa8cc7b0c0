"""The launcher's memory module: the peak-memory hook and --memory-limit (launcher/machine/memory.py)."""

import os
import subprocess
import sys

import pytest

from tfdist.launcher.machine import cgroups
from tfdist.launcher.machine.memory import (MIN_LIMIT, MemoryLimitError, MemoryLimits, PeakMemory, parse_limits,
                             parse_size)
from tfdist.linux import vm_hwm_bytes
from tfdist.launcher.engine.api import Placement
from tfdist.launcher.engine.local import child_setup
from tfdist.launcher.state import JobState, MemberView


def test_vm_hwm_reads_this_process_and_none_for_a_gone_one(tmp_path):
    own = vm_hwm_bytes(os.getpid())
    assert own is not None and own > 10 * 2**20  # a Python with pytest loaded
    assert vm_hwm_bytes(2**22 + 12345) is None  # above pid_max's default: no such process
    fake = tmp_path / "77"
    fake.mkdir()
    (fake / "status").write_text("Name:\tx\nVmPeak:\t  900 kB\nVmHWM:\t    512 kB\nVmRSS:\t 100 kB\n")
    assert vm_hwm_bytes(77, proc=str(tmp_path)) == 512 * 1024


def test_peaks_keep_each_names_largest_over_restarts_and_skip_exited_tasks():
    readings = {1: 300, 2: 900, 3: 200}
    hook = PeakMemory(read=readings.get)
    assert hook(JobState((MemberView("ps:0", 1), MemberView("worker:0", 2)))) == ()
    # worker:0 restarted as pid 3 with a smaller peak; ps:0 exited (not read again).
    readings[1] = 10_000
    hook(JobState((MemberView("ps:0", 1, exit_code=0), MemberView("worker:0", 3, starts=2))))
    assert hook.peaks == {"ps:0": 300, "worker:0": 900}
    assert hook.describe() == "ps:0 0 MiB, worker:0 0 MiB"


# --- limits (--memory-limit) ---------------------------------------------------------------

ROLES = {"chief": ["chief:0"], "worker": ["worker:0", "worker:1"], "ps": ["ps:0", "ps:1"]}


def test_sizes_and_limits_parse_per_role():
    assert parse_size("1200M") == 1200 << 20 and parse_size("1.5G") == 3 << 29
    assert parse_size("800mib") == 800 << 20 and parse_size("1073741824") == 1 << 30
    assert parse_limits(["ps=1G", "worker=2G"], ROLES) == {
        "ps:0": 1 << 30, "ps:1": 1 << 30, "worker:0": 2 << 30, "worker:1": 2 << 30}
    assert parse_limits(None, ROLES) == {}


@pytest.mark.parametrize("spec,says", [
    ("ps", "use ROLE=SIZE with a role of this job (chief, worker, ps)"),
    ("evaluator=1G", "use ROLE=SIZE with a role of this job"),
    ("ps=lots", "'lots' is not a size; use e.g. 1200M"),
    ("ps=100M", "below the 256 MiB a TensorFlow task needs"),
])
def test_bad_limits_are_one_line(spec, says):
    with pytest.raises(MemoryLimitError, match=says.replace("(", r"\(").replace(")", r"\)")):
        parse_limits([spec], ROLES)


MEMORY_PROBLEM = cgroups.memory_problem(cgroups.cgroup_root("memory"))


@pytest.mark.skipif(MEMORY_PROBLEM is not None, reason=f"no memory cgroup: {MEMORY_PROBLEM}")
def test_a_limited_process_is_killed_past_its_limit_and_counted_and_the_cgroup_removed():
    limits = MemoryLimits({"ps:0": MIN_LIMIT}, log=lambda m: None)
    path = limits.cgroup_for("ps:0")
    try:
        with open(f"{path}/memory.limit_in_bytes") as f:
            assert int(f.read()) == MIN_LIMIT
        # Holds 512 MiB, twice its limit: the kernel ends it.
        touch = "x = bytearray(512 << 20); x[::4096] = b'1' * (len(x) // 4096)"
        proc = subprocess.run([sys.executable, "-c", touch],
                              preexec_fn=child_setup(Placement(memory_cgroup=path)), timeout=60)
        assert proc.returncode == -9
        assert limits.oom_killed() == {"ps:0": 1}
    finally:
        limits.close()
    assert not os.path.exists(path)
