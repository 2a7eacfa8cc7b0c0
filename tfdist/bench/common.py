"""What both suites share: a planned run, running it in fresh processes, and the machine.

``bench/suites/default.py`` (every strategy on the same work) and
``bench/suites/scenarios.py`` (which strategy when) plan lists of :class:`Run` and
hand each to :func:`run_one`; neither imports the other.
"""

from __future__ import annotations

import os
import platform
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass

from tfdist import protocol
from tfdist.launcher import plan as plans
from tfdist.strategies import kinds as strategy_kinds

# The checkout (or install) root: train.py and launch.py sit there.
# (tfdist/bench/common.py: three levels up.)
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TRAIN = os.path.join(ROOT, "train.py")
LAUNCH = os.path.join(ROOT, "launch.py")
BASELINE = "none"
# Benchmark configurations: every strategy kind, plus the baseline on synthetic data.
KINDS = (BASELINE, "synthetic",
         *(k for k in strategy_kinds.names(include_auto=False) if k != BASELINE))


class BenchError(ValueError):
    pass


@dataclass(frozen=True)
class Run:
    name: str  # unique: also the folder under <out>/runs/
    kind: str  # a KINDS entry: a strategy kind's name, or "synthetic"
    workers: int
    cmd: tuple[str, ...]
    model_dir: str
    config: str  # the table row: repeats of one configuration share it

    @property
    def results_file(self) -> str:
        """The record the run leaves in its model dir."""
        return "results.json"

    def load_results(self, path: str) -> dict:
        # Through a typed record: a file of another schema fails here, loudly.
        return protocol.Results.load(path).to_dict()

    @property
    def outcome_file(self) -> str:
        """What ``launch.py`` did (bytes per host, peak memory); none for a single process."""
        return os.path.join(self.model_dir, "launch", "outcome.json")


def load_outcomes(runs: list[Run]) -> dict[str, dict]:
    """Each cluster run's launch outcome that could be read: {run name: record}."""
    out = {}
    for run in runs:
        try:
            out[run.name] = protocol.LaunchOutcome.load(run.outcome_file).__dict__
        except (OSError, ValueError, TypeError):
            continue
    return out


def parse_workers(text: str, flag: str = "--workers") -> list[int]:
    """Sorted distinct worker counts from ``flag``'s comma-separated value."""
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        values = []
    if not values or any(v < 1 for v in values):
        raise BenchError(
            f"{flag} {text!r} is not a comma-separated list of positive integers; "
            f"e.g. {flag} 2 or {flag} 1,2,4"
        )
    return sorted(set(values))


def parse_only(text: str | None) -> tuple[str, ...]:
    if not text:
        return KINDS
    kinds = tuple(k.strip() for k in text.split(","))
    bad = [k for k in kinds if k not in KINDS]
    if bad:
        raise BenchError(f"--only {text!r} names {bad}; allowed: {', '.join(KINDS)}")
    if BASELINE not in kinds:
        raise BenchError(f"--only {text!r} leaves out 'none', the baseline every ratio needs")
    return kinds


def hosts_for(kind, workers: int, ps: int) -> int:
    """Simulated hosts for a run with ``--hosts``: one per computing task, one more
    for the tasks that only coordinate or serve (as ``launcher.plan.place_tasks``)."""
    names = plans.member_names(kind, workers, ps)
    busy = [n for n in names if n.partition(":")[0] in kind.computing_roles]
    return len(busy) + (1 if len(names) > len(busy) else 0)


def cluster_cores(kind, workers: int) -> dict[str, int]:
    """Every task of a ``launch.py`` cluster of ``kind`` with ``workers`` workers, and the
    cores it may use at full speed on this machine (``launch.py --slow``'s fraction is
    of them: a task pinned to one core, or one that only serves on all of them)."""
    total = os.cpu_count() or 1
    names = plans.member_names(kind, workers, kind.min_ps)
    shares = plans.share_cores(kind, names, total)
    return {name: shares[name].cores(total) for name in names}


def cluster_prefix(python: str, kind, workers: int, timeout: float, slow: str | None = None,
                   link_rate: str | None = None, program: str | None = None) -> list[str]:
    """``launch.py`` and its flags for a cluster of ``kind`` (up to the ``--``): ``slow``
    a ``--slow`` spec; ``link_rate``: simulated hosts with links shaped to it."""
    cmd = [python, LAUNCH, "--strategy", kind.name, "--workers", str(workers),
           "--timeout", str(timeout)]
    if kind.min_ps:
        cmd += ["--ps", str(kind.min_ps)]
    if slow:
        cmd += ["--slow", slow]
    hosts = hosts_for(kind, workers, kind.min_ps)
    # One computing task alone (multiworker, 1 worker) sends nothing: no link to shape.
    if link_rate and hosts > 1:
        cmd += ["--hosts", str(hosts), "--link-rate", link_rate]
    if program:
        # A tutorial ps server never exits by itself: a short wait, then SIGTERM.
        cmd += ["--program", program, "--grace", "3"]
    return [*cmd, "--"]


def cell(value, spec: str, missing: str = "–") -> str:
    """A table cell: a number formatted with ``spec``, else ``missing``."""
    return format(value, spec) if isinstance(value, (int, float)) else missing


def group_by_config(runs: list) -> dict[str, list]:
    """Runs grouped by their ``config`` (repeats of one configuration), in plan order."""
    groups: dict[str, list] = {}
    for run in runs:
        groups.setdefault(run.config, []).append(run)
    return groups


def time_to_target(curve: list[dict], target: float) -> float | None:
    """Seconds (startup included, evaluation excluded) to first reach ``target``."""
    for point in curve:
        if point["test_accuracy"] >= target:
            return point["seconds"]
    return None


def machine_description() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            names = [l.split(":", 1)[1].strip() for l in f if l.startswith("model name")]
        if names:
            cpu = names[0]
    except OSError:
        pass
    gpus = "no GPU"
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
        if out.returncode == 0 and out.stdout.strip():
            gpus = ", ".join(out.stdout.split("\n")[:-1])
    except (OSError, subprocess.TimeoutExpired):
        pass
    return f"{os.cpu_count()} CPU cores ({cpu}), {gpus}, {platform.system()} {platform.release()}"


def run_all(runs: list, timeout: float) -> dict[str, dict]:
    """Every planned run in turn, each in fresh processes; {name: results} of those that finished."""
    print(f"[bench] {len(runs)} runs: {', '.join(r.name for r in runs)}", flush=True)
    results = {}
    for run in runs:
        r = run_one(run, timeout, log=lambda m: print(m, flush=True))
        if r is not None:
            results[run.name] = r
    return results


def run_one(run: Run, timeout: float, log=print) -> dict | None:
    """Run one configuration in fresh processes; its results record, or None."""
    # The bench owns <out>/runs/: a stale run there would be resumed, not measured.
    shutil.rmtree(run.model_dir, ignore_errors=True)
    log_path = run.model_dir + ".log"
    os.makedirs(os.path.dirname(log_path), exist_ok=True)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("TF_CONFIG", None)  # the single-process runs must not join a cluster
    started = time.perf_counter()
    with open(log_path, "w") as out:
        proc = subprocess.Popen(run.cmd, stdout=out, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            _stop(proc)
            code = "timeout"
    seconds = time.perf_counter() - started
    path = os.path.join(run.model_dir, run.results_file)
    if code != 0 or not os.path.exists(path):
        log(f"[bench] {run.name}: FAILED (exit {code}) after {seconds:.0f}s; log: {log_path}")
        return None
    results = run.load_results(path)
    # Every compiled metric of the task (MNIST: accuracy; ctr: auc).
    metrics = ", ".join(f"test {k} {v:.4f}" for k, v in (results.get("test_metrics") or {}).items()
                        if isinstance(v, (int, float)))
    log(f"[bench] {run.name}: {metrics or 'no test metric'}, "
        f"{results['examples_per_sec']:,.0f} examples/s, {seconds:.0f}s")
    return results


def _stop(proc: subprocess.Popen, grace: float = 10.0) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=grace)
            return
        except subprocess.TimeoutExpired:
            continue


