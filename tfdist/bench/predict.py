"""The predictor: examples/s of each strategy on a cluster not run, from one step measured.

    python bench.py --predict RUN_DIR --workers 1,2,4,16,1024 --predict-ps 2 \
        --predict-link-rate 1gbit

A *profile* is what a measured run says about one worker's step apart from
the cluster it ran on: its compute (forward, backward and update at its
per-worker batch, on the CPU budget it had), the model's parameters, and two
costs of moving bytes. A *target* is the cluster asked about: workers, ps
tasks, link rate, gradient dtype, accumulation, ``--shard-state``, each
host's cores and each message's latency. For each strategy the step is
built from:

* **compute**: the profile's, scaled by the batch (linear) and the host's
  cores (compute over a quota of C cores takes 1/C as long: ``--host-cpus``);
* the **traffic model** (``launcher/machine/traffic.py``, within 5 % of
  every measured host in ``results/links``): the bytes each host sends and
  receives per step, in frames, over the link rate;
* the **CPU of moving bytes**: gRPC's copies and the TCP stack's, per byte
  sent or received, on the same CPU budget as the compute (on unshaped
  links between simulated hosts it is all that communication costs), and
  what the all-reduce adds per byte (its sums and chunk copies);
* **latency**: per message round (a ring all-reduce has 2(N-1), a ps step 2);
* **overlap**: the fraction of compute the all-reduce can run under (its
  buckets start during the backward pass); under ``ps`` and ``ps-sync`` a
  worker reads, computes and pushes one after the other.

Per strategy (N workers, k ps, W the weights' bytes, G the gradients'):

* ``multiworker``: a worker's step is compute + its byte CPU + what of the
  ring's 2(N-1)/N G (each way) and 2(N-1) latencies the overlap does not hide;
  ``--shard-state optimizer|gradients`` moves (N-1)/N (G + W) instead, with two
  collectives' latencies, and updates 1/N of the weights.
* ``ps`` (async): a worker's cycle is read W, compute, push G; N workers
  give N cycles' worth of steps unless the ps hosts' links (each step's W out
  and G in, spread over the ps hosts) or their CPU bound them first: the
  ps fan-in.
* ``ps-sync`` (K = N): an update is a chain: every worker waits for the same
  token, reads W (the N reads share the ps host's link out), computes, pushes
  G (the N pushes share its link in), and ps:0 averages and applies the N
  gradients and hands out the next tokens (``sync_seconds`` of its CPU) while
  every worker waits; the reads run partly under the forward pass (the
  overlap's share). The ps host's CPU (its bytes, the dispatch, the sync) is a
  floor under the chain. BytePS's communication optimum
  for n workers and k CPU servers, 2n(n-1)M / ((n^2 + kn - 2k) B), is given
  beside it as the bound a synchronous design with k servers could reach.

The bounding term named for each prediction is the largest part of the step:
``compute``, ``link`` (a worker's own link: its transfers), ``ps fan-in``
(the ps hosts' links or CPU, shared by every worker) or ``all-reduce ring``
(the ring's 2(N-1) message latencies).

``profile_of(run_dir)`` reads a run's records (``results.json``,
``launch/outcome.json``) and inverts the same model: the compute is the
measured step less what the model says the run's communication cost.
"""

from __future__ import annotations

import json
import math
import os
import sys
from dataclasses import dataclass, replace

from tfdist.launcher.machine import traffic as trafficlib
from tfdist.strategies import kinds

STRATEGIES = ("multiworker", "ps", "ps-sync")
# The costs a run's records do not give apart: the overlap (0.36: 1 - the exposed
# compute of results/links' link table) and the ps link's use (0.7, the same
# table) measured before; the others fitted on results/scale's runs
# (bench/scale.py, plan.json: which runs, and which points were left out).
CALIBRATION = {"cpu_per_byte": 0.0, "hidden": 0.36, "dispatch_seconds": 0.0,
               "kernel_per_byte": 0.0, "ring_cpu_per_byte": 0.0, "ps_link_use": 0.7,
               "sync_seconds": 0.0}
TERMS = ("compute", "link", "ps fan-in", "all-reduce ring", "shared machine")
SHARDED = ("optimizer", "gradients")


def all_reduces(strategy: str) -> bool:
    """Whether ``strategy``'s workers all-reduce (the kind's loop is ``sync``)."""
    return kinds.get(strategy).trainer == "sync"


class PredictError(ValueError):
    """A profile or target the model cannot answer; its message is one line."""


@dataclass(frozen=True)
class Profile:
    """One worker's step, apart from the cluster (see the module)."""

    task: str
    params: int
    per_worker_batch: int
    compute_seconds: float  # a step's compute at per_worker_batch on `cores`
    cores: float  # the CPU budget the compute was measured on
    # CPU-seconds (on one core) per byte a host sends or receives: gRPC's
    # serialization and the TCP stack's copies, charged to the same budget.
    cpu_per_byte: float = 0.0
    # What the all-reduce adds per byte (its chunks' sums and extra copies).
    ring_cpu_per_byte: float = 0.0
    # Fraction of the compute the all-reduce can run under (buckets during
    # the backward pass); results/links measured 1 - exposed compute.
    hidden: float = 0.0
    # The share of the ps host's link async ps workers keep busy at most: their
    # reads collide (results/links' link table: 0.69-0.73 of the link limit
    # with 2 and 4 workers, float32).
    ps_link_use: float = 1.0
    # CPU-seconds (on one core) the ps chief spends per step dispatching it.
    dispatch_seconds: float = 0.0
    # CPU-seconds per byte crossing a link that no host's budget is charged
    # for: the kernel's softirq work on the simulated hosts' virtual links. It
    # slows a step only when the hosts' budgets leave the machine no core free.
    kernel_per_byte: float = 0.0
    # CPU-seconds (on one core) ps:0 spends per ps-sync update while the workers
    # wait: dequeuing and averaging the K gradients, applying them, the tokens.
    sync_seconds: float = 0.0


@dataclass(frozen=True)
class Target:
    """The cluster asked about."""

    workers: int
    ps: int = 1
    link_bits_per_sec: float | None = None  # None: unshaped (no rate bound)
    gradient_dtype: str = "float32"
    accumulation: int = 1
    shard_state: str = "off"
    cores: float | None = None  # each host's; None: the profile's
    latency: float = 0.0  # seconds per message round
    # The launcher puts the chief and every ps on one simulated host; a real
    # cluster gives each ps a machine of its own.
    ps_own_hosts: bool = False
    per_worker_batch: int | None = None  # None: the profile's
    # Simulated hosts share one machine of this many cores (launch.py --hosts
    # --host-cpus); None: a real cluster, every host its own machine.
    machine_cores: float | None = None


@dataclass(frozen=True)
class Prediction:
    strategy: str
    examples_per_sec: float
    step_seconds: float  # per global step (ps: per step of one worker)
    bound: str  # one of TERMS
    terms: dict  # each term's seconds per step
    byteps_seconds: float | None = None


def check(target: Target, strategy: str) -> None:
    """The target refused in one line where the model (or the library) cannot honour it."""
    if target.workers < 1 or target.ps < 1 or target.accumulation < 1:
        raise PredictError(f"workers {target.workers}, ps {target.ps}, accumulation "
                           f"{target.accumulation}: each must be at least 1")
    if target.gradient_dtype not in trafficlib.DTYPE_BYTES:
        raise PredictError(f"gradient dtype {target.gradient_dtype!r}; allowed: "
                           f"{', '.join(trafficlib.DTYPE_BYTES)}")
    if target.shard_state not in ("off", *SHARDED):
        raise PredictError(f"--shard-state {target.shard_state!r} cannot be predicted; allowed: "
                           f"off, {', '.join(SHARDED)} (weights: its re-gathers are not modelled)")
    if target.shard_state != "off" and not all_reduces(strategy):
        raise PredictError(f"--shard-state {target.shard_state} is multiworker's only; "
                           f"{strategy} holds its state on the ps tasks")


def byteps_seconds(n: int, k: int, size_bytes: float, bytes_per_sec: float) -> float:
    """BytePS's communication optimum: n workers and k CPU servers, each link B,
    a synchronous update of M bytes: 2n(n-1)M / ((n^2 + kn - 2k) B)."""
    if n < 2:
        return 0.0
    return 2 * n * (n - 1) * size_bytes / ((n * n + k * n - 2 * k) * bytes_per_sec)


def _link_seconds(size_bytes: float, target: Target) -> float:
    """A transfer's time on one link, in frames as tc meters them."""
    if not target.link_bits_per_sec:
        return 0.0
    return size_bytes * trafficlib.FRAME_OVERHEAD / (target.link_bits_per_sec / 8)


def _compute(profile: Profile, target: Target) -> float:
    batch = target.per_worker_batch or profile.per_worker_batch
    cores = target.cores or profile.cores
    return (profile.compute_seconds * batch / profile.per_worker_batch
            * profile.cores / cores * target.accumulation)


def _host_cpu(profile: Profile, target: Target, size_bytes: float) -> float:
    """The CPU-seconds a host's budget spends moving ``size_bytes`` (both ways)."""
    return profile.cpu_per_byte * size_bytes / (target.cores or profile.cores)


def _sizes(profile: Profile, target: Target) -> tuple[float, float]:
    """(weights, gradients) in bytes on the wire."""
    return (4.0 * profile.params,
            float(trafficlib.DTYPE_BYTES[target.gradient_dtype] * profile.params))


def _multiworker(profile: Profile, target: Target) -> Prediction:
    n, (w, g) = target.workers, _sizes(profile, target)
    compute = _compute(profile, target)
    if target.shard_state in SHARDED:
        # ZeRO-1/2: the optimizer updates 1/N of the weights; its share of the
        # step is not measured apart, so the compute is kept whole (an upper bound).
        each_way, rounds = (n - 1) / n * (g + w), 4 * (n - 1)
    else:
        each_way, rounds = 2 * (n - 1) / n * g, 2 * (n - 1)
    link = _link_seconds(each_way, target)
    ring = rounds * target.latency if n > 1 else 0.0
    cpu = ((profile.cpu_per_byte + profile.ring_cpu_per_byte) * 2 * each_way
           / (target.cores or profile.cores))
    exposed = max(0.0, link + ring - profile.hidden * compute)
    step = compute + cpu + exposed
    terms = {"compute": compute + cpu, "link": link, "all-reduce ring": ring}
    cores = target.cores or profile.cores
    return _prediction("multiworker", n, profile, target, step, terms,
                       demand=n * (compute + cpu) * cores, moved=n * each_way)


def _ps_hosts(target: Target) -> int:
    return target.ps if target.ps_own_hosts else 1


def _ps(profile: Profile, target: Target) -> Prediction:
    """Async: N read-compute-push cycles against the ps hosts' links and CPU."""
    n, (w, g) = target.workers, _sizes(profile, target)
    compute = _compute(profile, target)
    cycle_link = _link_seconds(w + g, target) + 2 * target.latency
    cycle = compute + _host_cpu(profile, target, w + g) + cycle_link
    hosts = _ps_hosts(target)
    # Each step moves W out of and G into the ps hosts, spread over them; both
    # directions at once, so the busier one bounds. The chief dispatching
    # the step and the ps serving its bytes share their host's budget.
    fan_link = _link_seconds(max(w, g) / hosts, target) / profile.ps_link_use
    fan_cpu = (_host_cpu(profile, target, (w + g) / hosts)
               + profile.dispatch_seconds / (target.cores or profile.cores))
    fan_in = max(fan_link, fan_cpu)
    step = max(cycle / n, fan_in)
    terms = {"compute": (compute + _host_cpu(profile, target, w + g)) / n,
             "link": cycle_link / n, "ps fan-in": fan_in}
    # The workers' cycles bound unless the fan-in is slower: then it does,
    # whichever of the cycle's parts is larger.
    bound = "ps fan-in" if fan_in >= cycle / n else max(("compute", "link"), key=terms.get)
    # One step's CPU on every host: a worker's cycle, the ps's bytes, the chief's dispatch.
    cores = target.cores or profile.cores
    demand = (compute + 2 * _host_cpu(profile, target, w + g)) * cores + profile.dispatch_seconds
    return _prediction("ps", 1, profile, target, step, terms, bound, demand=demand, moved=w + g)


def _ps_sync(profile: Profile, target: Target) -> Prediction:
    """K = N: one update is a chain (token, reads, compute, pushes, aggregation), not
    the workers' compute overlapping the ps host's transfers."""
    n, (w, g) = target.workers, _sizes(profile, target)
    compute = _compute(profile, target)
    cores = target.cores or profile.cores
    names = ([f"worker:{i}" for i in range(n)] + [f"ps:{j}" for j in range(target.ps)])
    host_of = {name: i for i, name in enumerate(names[:n])}
    host_of.update({f"ps:{j}": n + (j if target.ps_own_hosts else 0) for j in range(target.ps)})
    flows = trafficlib.predict("ps-sync", host_of, profile.params, target.gradient_dtype)
    busiest = max((h for i, h in flows.items() if i >= n), key=lambda h: h["tx"] + h["rx"])
    # Every worker waits for the same update's token, so the N reads start together
    # and share the ps host's link out, then the N pushes share its link in: the
    # last worker's step holds both whole. The reads run partly under the forward
    # pass (each layer's weights are read as it needs them): the overlap's share.
    fan_link = _link_seconds(busiest["tx"] + busiest["rx"], target) + 2 * target.latency
    exposed = max(0.0, fan_link - profile.hidden * compute)
    # ps:0 dequeues and averages the N gradients, applies them and hands out the
    # tokens while every worker waits: CPU on the ps host's budget, per update.
    sync = profile.sync_seconds / cores
    fan_cpu = (_host_cpu(profile, target, busiest["tx"] + busiest["rx"])
               + (profile.dispatch_seconds + profile.sync_seconds) / cores)
    worker_cpu = _host_cpu(profile, target, w + g)
    # The ps host's CPU is a floor too: its bytes, the chief's dispatch, the sync.
    step = max(compute + worker_cpu + exposed + sync, fan_cpu)
    terms = {"compute": compute + worker_cpu, "link": _link_seconds(w + g, target),
             "ps fan-in": max(exposed + sync, fan_cpu)}
    demand = (n * (compute + worker_cpu) * cores + profile.dispatch_seconds
              + profile.sync_seconds + profile.cpu_per_byte * (busiest["tx"] + busiest["rx"]))
    moved = sum(h["tx"] for h in flows.values())
    out = _prediction("ps-sync", n, profile, target, step, terms, demand=demand, moved=moved)
    if target.link_bits_per_sec:
        out = replace(out, byteps_seconds=byteps_seconds(
            n, target.ps, g, target.link_bits_per_sec / 8 / trafficlib.FRAME_OVERHEAD))
    return out


def _prediction(strategy: str, replicas: int, profile: Profile, target: Target,
                step: float, terms: dict, bound: str | None = None, *, demand: float = 0.0,
                moved: float = 0.0) -> Prediction:
    """The step's examples/s; on one shared machine, no shorter than the CPU every
    host and the kernel need per step (``demand`` CPU-seconds, ``moved`` bytes) over
    its cores."""
    batch = target.per_worker_batch or profile.per_worker_batch
    examples = replicas * batch * target.accumulation
    bound = bound or max(terms, key=terms.get)
    if target.machine_cores:
        machine = (demand + profile.kernel_per_byte * moved) / target.machine_cores
        terms = {**terms, "shared machine": machine}
        if machine > step:
            step, bound = machine, "shared machine"
    return Prediction(strategy, examples / step if step > 0 else math.inf, step, bound, terms)


_MODELS = {"multiworker": _multiworker, "ps": _ps, "ps-sync": _ps_sync}


def predict(profile: Profile, target: Target, strategy: str) -> Prediction:
    """Examples/s of ``strategy`` on ``target`` and the term bounding its step (pure)."""
    if strategy not in _MODELS:
        raise PredictError(f"no model for strategy {strategy!r}; allowed: {', '.join(STRATEGIES)}")
    check(target, strategy)
    return _MODELS[strategy](profile, target)


def predict_all(profile: Profile, target: Target) -> list[Prediction]:
    """Every strategy the target allows (``--shard-state`` leaves multiworker alone)."""
    return [predict(profile, target, s) for s in STRATEGIES
            if target.shard_state == "off" or all_reduces(s)]


# --- from a measured run ------------------------------------------------------------------------

@dataclass(frozen=True)
class Measured:
    """What one run's records say: its cluster as a target, and its rate."""

    strategy: str
    target: Target
    examples_per_sec: float
    params: int
    task: str


def read_run(run_dir: str) -> Measured:
    """A run directory's records (``results.json``, ``launch/outcome.json`` or
    ``outcome.json`` beside it) as the target it ran on and its examples/s."""
    results = _load(os.path.join(run_dir, "results.json"))
    if results is None:
        raise PredictError(f"{run_dir}: no results.json; give a run directory (--model-dir of "
                           "a finished run)")
    outcome = (_load(os.path.join(run_dir, "launch", "outcome.json"))
               or _load(os.path.join(run_dir, "outcome.json")) or {})
    strategy, n = results["strategy"], results["num_workers"]
    if kinds.get(strategy).single_process:
        strategy, n = STRATEGIES[0], 1  # one process: the one-worker all-reduce's step
    cpus = outcome.get("host_cpus") or {}
    cores = min((h["cores"] for h in cpus.values()), default=None)
    link = (outcome.get("link") or {}).get("set_bits_per_sec")
    # An asynchronous (ps) worker runs whole steps of the global batch.
    per_worker = results["global_batch_size"] // (1 if kinds.get(strategy).asynchronous else n)
    target = Target(workers=n, ps=max(1, results.get("num_ps") or 1), link_bits_per_sec=link,
                    gradient_dtype=results.get("gradient_dtype") or "float32",
                    accumulation=results.get("gradient_accumulation_steps") or 1,
                    shard_state=results.get("shard_state") or "off", cores=cores,
                    per_worker_batch=per_worker,
                    # Budgeted simulated hosts share the machine the run was on; the
                    # records do not name its cores, so this one's are taken.
                    machine_cores=float(os.cpu_count() or 1) if cpus else None)
    return Measured(strategy, target, results["examples_per_sec"], results["trainable_params"],
                    results["task"])


def _load(path: str) -> dict | None:
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        return None


def profile_of(run: Measured, cores_default: float = 1.0, **costs) -> Profile:
    """The profile whose prediction of ``run`` is exactly its measured rate:
    the compute solved from the model (bisection; the step grows with it)."""
    cores = run.target.cores or cores_default
    base = Profile(run.task, run.params, run.target.per_worker_batch or 1, 0.0, cores, **costs)

    def rate(compute: float) -> float:
        return predict(replace(base, compute_seconds=compute), run.target,
                       run.strategy).examples_per_sec

    lo, hi = 0.0, 1.0
    while rate(hi) > run.examples_per_sec:
        hi *= 2
        if hi > 1e6:
            raise PredictError(f"the run's {run.examples_per_sec:.0f} examples/s is slower than "
                               "any compute explains")
    if rate(lo) < run.examples_per_sec:
        raise PredictError(f"the run's {run.examples_per_sec:.0f} examples/s is faster than its "
                           "communication alone allows: the costs given are too high")
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if rate(mid) > run.examples_per_sec else (lo, mid)
    return replace(base, compute_seconds=(lo + hi) / 2)


def error(predicted: float, measured: float) -> float:
    """Relative error of a prediction against its measurement."""
    return predicted / measured - 1.0


def median(values: list[float]) -> float:
    s = sorted(values)
    if not s:
        return math.nan
    mid = len(s) // 2
    return s[mid] if len(s) % 2 else (s[mid - 1] + s[mid]) / 2


# --- the command (bench.py --predict) ------------------------------------------------------------

def target_of(config, workers: int) -> Target:
    """The target cluster of ``bench.py --predict``'s flags at ``workers``."""
    from tfdist.launcher.machine.network import parse_rate
    from tfdist.launcher.plan import LaunchError

    try:
        rate = parse_rate(config.predict_link_rate) if config.predict_link_rate else None
    except LaunchError as err:
        raise PredictError(str(err).replace("--link-rate", "--predict-link-rate")) from None
    return Target(workers, ps=config.predict_ps, link_bits_per_sec=rate,
                  gradient_dtype=config.predict_gradient_dtype,
                  accumulation=config.predict_accumulation,
                  shard_state=config.predict_shard_state, cores=config.predict_host_cpus,
                  latency=config.predict_latency_us * 1e-6,
                  ps_own_hosts=config.predict_ps_own_hosts)


def table(profile: Profile, targets: list[Target]) -> list[str]:
    """The predictions as a markdown table (pure): one row per worker count and strategy."""
    lines = ["| workers | strategy | examples/s | step, ms | bound | compute, ms | link, ms "
             "| ps fan-in, ms | ring latency, ms | BytePS optimum, ms |",
             "|---|---|---|---|---|---|---|---|---|---|"]

    def ms(value) -> str:
        return "" if value is None else f"{value * 1e3:.2f}"

    for t in targets:
        for p in predict_all(profile, t):
            lines.append(f"| {t.workers} | {p.strategy} | {p.examples_per_sec:,.0f} "
                         f"| {ms(p.step_seconds)} | {p.bound} | {ms(p.terms.get('compute'))} "
                         f"| {ms(p.terms.get('link'))} | {ms(p.terms.get('ps fan-in'))} "
                         f"| {ms(p.terms.get('all-reduce ring'))} | {ms(p.byteps_seconds)} |")
    return lines


def report(config, out=print) -> int:
    """``bench.py --predict RUN_DIR``: the profile read from the run, then the table; the
    exit code (2 and one line on stderr on bad input)."""
    from tfdist.bench.common import BenchError, parse_workers

    try:
        targets = [target_of(config, n) for n in parse_workers(config.workers, "--workers")]
        profile = profile_of(read_run(config.predict), **CALIBRATION)
        lines = table(profile, targets)
    except (PredictError, BenchError) as err:
        print(f"error: --predict: {err}", file=sys.stderr)
        return 2
    out(f"profile from {config.predict}: {profile.task}, {profile.params:,} parameters, "
        f"{profile.compute_seconds * 1e3:.2f} ms of compute per step at {profile.per_worker_batch} "
        f"examples per worker on {profile.cores:g} cores; predicted, not measured, below")
    for line in lines:
        out(line)
    return 0
