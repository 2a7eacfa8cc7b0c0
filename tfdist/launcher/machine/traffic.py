"""The traffic model: bytes each simulated host should send and receive per step (pure).

Every strategy moves the model's weights or its gradients over the network
each step; on a slow link those bytes bound the step rate. The model below
(``docs/performance.md``, "Bytes per step") lists who sends what to whom per
step, as flows between tasks, and adds up the flows that cross from one host
to another (tasks on the same host talk over its loopback, which no link
carries). Figures are payload bytes: TCP/IP and Ethernet headers (~4.6 % on a
1,500-byte MTU), the acknowledgements flowing back and gRPC's framing come on
top, so a measurement should exceed the model by some 5 to 10 %.

A *step* is what ``results.json`` counts: one global step (multiworker, ps),
one applied update of K gradients (ps-sync).
"""

from __future__ import annotations

from collections import defaultdict

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}

# What the interface counters add to a payload: a full-size TCP segment on a
# 1,500-byte MTU carries 1,448 bytes (timestamps on) in a 1,514-byte frame
# (Ethernet 14, IP 20, TCP 32). The counters (and tc) count frames; the
# model's payload times this is what they should read.
FRAME_OVERHEAD = 1514 / 1448


def member_flows(trainer: str, names: list[str], params: int, gradient_dtype: str = "float32",
               shares: dict[str, float] | None = None) -> dict[tuple[str, str], float]:
    """``{(sender, receiver): payload bytes per step}`` for the tasks ``names``.

    ``trainer`` is the strategy kind's loop (``StrategyKind.trainer``):
    ``sync`` (multiworker: a ring all-reduce among every computing task),
    ``ps`` (async: one worker's step reads every weight from the ps and pushes
    its gradients to them) or ``ps-sync`` (each update: every worker reads
    the weights once and queues one flat gradient on ps:0; the update
    applies K of them, the other N - K are computed, sent and dropped).
    ``params``: trainable parameters (float32 weights). ``shares`` (ps): each
    worker's fraction of the steps, when known (``results.json``'s
    ``steps_per_worker``); else an even split.
    """
    if gradient_dtype not in DTYPE_BYTES:
        raise ValueError(f"gradient dtype {gradient_dtype!r}; allowed: {', '.join(DTYPE_BYTES)}")
    weights = 4.0 * params
    grads = float(DTYPE_BYTES[gradient_dtype] * params)
    workers = [n for n in names if n.partition(":")[0] in ("worker", "chief")]
    ps = [n for n in names if n.startswith("ps:")]
    if trainer not in _FLOWS:
        raise ValueError(f"no traffic model for trainer {trainer!r}")
    flows: dict[tuple[str, str], float] = defaultdict(float)
    _FLOWS[trainer](flows, workers, ps, weights, grads, shares)
    return dict(flows)


def _ring_flows(flows, workers, ps, weights, grads, shares) -> None:
    """multiworker: a ring all-reduce, reduce-scatter then all-gather, each
    N - 1 rounds of 1/N of the tensor, every worker sending to its successor."""
    n = len(workers)
    if n > 1:
        for i, w in enumerate(workers):
            flows[(w, workers[(i + 1) % n])] += 2 * (n - 1) / n * grads


def _async_ps_flows(flows, workers, ps, weights, grads, shares) -> None:
    """ps: any one worker runs a step, on average 1/N of them; the variables
    are split over the ps tasks (about evenly by size)."""
    workers = [w for w in workers if w.startswith("worker:")]  # the chief only schedules
    for w in workers:
        share = (shares.get(w, 0.0) if shares else 1.0 / len(workers)) / len(ps)
        for p in ps:
            flows[(p, w)] += weights * share
            flows[(w, p)] += grads * share


def _sync_ps_flows(flows, workers, ps, weights, grads, shares) -> None:
    """ps-sync: every worker reads the weights once per update and queues one
    flat gradient on ps:0, which averages K and applies each part where its
    variable lives (float32 again after the aggregator's cast back)."""
    workers = [w for w in workers if w.startswith("worker:")]
    for w in workers:
        for p in ps:
            flows[(p, w)] += weights / len(ps)
        flows[(w, ps[0])] += grads
    for p in ps[1:]:
        flows[(ps[0], p)] += weights / len(ps)


# The traffic model of each training loop (StrategyKind.trainer).
_FLOWS = {"sync": _ring_flows, "ps": _async_ps_flows, "ps-sync": _sync_ps_flows}

# Loops whose step moves its bytes in two phases that cannot overlap on a
# host's link: a synchronous ps update's weights go out only after every
# gradient of the update before came in. The others keep both directions
# busy at once: the ring sends and receives in every round, and async ps
# workers read while others push.
_SERIAL = frozenset({"ps-sync"})


def serial(trainer: str | None) -> bool:
    """Whether ``trainer``'s bytes in and out of a host cross its link one after the other."""
    return trainer in _SERIAL


def host_bytes_per_step(flows: dict[tuple[str, str], float],
                        host_of: dict[str, int]) -> dict[int, dict[str, float]]:
    """``{host: {"tx": bytes, "rx": bytes}}`` per step: the flows that cross hosts."""
    out = {h: {"tx": 0.0, "rx": 0.0} for h in sorted(set(host_of.values()))}
    for (src, dst), size in flows.items():
        if host_of[src] == host_of[dst]:
            continue
        out[host_of[src]]["tx"] += size
        out[host_of[dst]]["rx"] += size
    return out


def predict(trainer: str, host_of: dict[str, int], params: int, gradient_dtype: str = "float32",
            shares: dict[str, float] | None = None) -> dict[int, dict[str, float]]:
    """Payload bytes per step each host sends (tx) and receives (rx)."""
    flows = member_flows(trainer, list(host_of), params, gradient_dtype, shares)
    return host_bytes_per_step(flows, host_of)


# --- what the launcher measured ---------------------------------------------------------------

def measured_record(before: dict[int, dict[str, int]], after: dict[int, dict[str, int]],
                    steps: int | None, host_of: dict[str, int],
                    trainer: str | None = None, shares: dict[str, float] | None = None) -> dict:
    """The outcome record's ``traffic``: each host's bytes over the job, and per step.

    ``before``/``after``: ``SimulatedHosts.counters()`` at the job's start and
    end; ``steps``: the chief's steps this run (``None``: no results);
    ``shares`` (ps): each worker's fraction of those steps.
    """
    hosts = {}
    for h in sorted(after):
        tx = after[h]["tx_bytes"] - before[h]["tx_bytes"]
        rx = after[h]["rx_bytes"] - before[h]["rx_bytes"]
        hosts[f"host{h}"] = {
            "tasks": [n for n, i in host_of.items() if i == h],
            "tx_bytes": tx, "rx_bytes": rx,
            "tx_bytes_per_step": round(tx / steps) if steps else None,
            "rx_bytes_per_step": round(rx / steps) if steps else None,
        }
        # Over the job, where read: TCP's segments and retransmissions, the
        # shapers' drops (what keeps a busy link below its rate).
        for key in LOSS_COUNTERS:
            if key in after[h] and key in before[h]:
                hosts[f"host{h}"][key] = after[h][key] - before[h][key]
    return {"steps": steps, "trainer": trainer, "worker_shares": shares, "hosts": hosts}


LOSS_COUNTERS = ("tcp_segments_sent", "tcp_segments_retransmitted", "shaper_drops_tx",
                 "shaper_drops_rx")


def describe(record: dict) -> str:
    """One line: each host's MB sent/received per step (or over the job without steps)."""
    steps = record.get("steps")
    parts = []
    for name, h in record["hosts"].items():
        if steps:
            parts.append(f"{name} {h['tx_bytes_per_step'] / 1e6:.3f} / "
                         f"{h['rx_bytes_per_step'] / 1e6:.3f}")
        else:
            parts.append(f"{name} {h['tx_bytes'] / 1e6:.1f} / {h['rx_bytes'] / 1e6:.1f}")
    what = (f"MB sent / received per step over {steps} steps" if steps
            else "MB sent / received over the job (no step count: no results.json)")
    line = f"[launch] traffic: {what}: " + "; ".join(parts)
    hosts = record["hosts"].values()
    if all("tcp_segments_retransmitted" in h for h in hosts):
        sent = sum(h["tcp_segments_sent"] for h in hosts)
        again = sum(h["tcp_segments_retransmitted"] for h in hosts)
        drops = sum(h.get("shaper_drops_tx", 0) + h.get("shaper_drops_rx", 0) for h in hosts)
        line += (f"; TCP retransmitted {again:,} of {sent:,} segments"
                 f" ({again / sent:.2%})" if sent else "") + f", shapers dropped {drops:,} packets"
    return line


def compare(record: dict, params: int, gradient_dtype: str = "float32",
            overhead: float = FRAME_OVERHEAD) -> dict[str, dict]:
    """Measured against predicted per step, per host: ``{host: {tx, rx, tx_model, rx_model}}``;
    the model's payload in frames (``overhead``), as the counters count it."""
    host_of = {t: int(name[4:]) for name, h in record["hosts"].items() for t in h["tasks"]}
    model = predict(record["trainer"], host_of, params, gradient_dtype,
                    record.get("worker_shares"))
    return {name: {"tx": h["tx_bytes_per_step"], "rx": h["rx_bytes_per_step"],
                   "tx_model": round(model[int(name[4:])]["tx"] * overhead),
                   "rx_model": round(model[int(name[4:])]["rx"] * overhead)}
            for name, h in record["hosts"].items()}
