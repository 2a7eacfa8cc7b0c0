"""The launcher's peak-memory hook (launcher/memory.py)."""

import os

from launcher.memory import PeakMemory, vm_hwm_bytes
from launcher.state import JobState, TaskView


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
    assert hook(JobState((TaskView("ps:0", 1), TaskView("worker:0", 2)))) == ()
    # worker:0 restarted as pid 3 with a smaller peak; ps:0 exited (not read again).
    readings[1] = 10_000
    hook(JobState((TaskView("ps:0", 1, exit_code=0), TaskView("worker:0", 3, starts=2))))
    assert hook.peaks == {"ps:0": 300, "worker:0": 900}
    assert hook.describe() == "ps:0 0 MiB, worker:0 0 MiB"
