"""``--link-trace``: every simulated host's link sampled each 10 ms (the record, its
figures and the sampling thread; a real job's trace is checked in test_link_bytes)."""

import threading

import pytest

from tfdist import protocol
from tfdist.launcher.machine import linktrace
from tfdist.launcher.machine import network
from tfdist.launcher.plan import LaunchError

RATE = 100e6  # 12,500,000 bytes/s: 125,000 bytes in a 10 ms sample is the full rate

NET_DEV = """Inter-|   Receive                                                |  Transmit
 face |bytes    packets errs drop fifo frame compressed multicast|bytes    packets errs drop fifo colls carrier compressed
   vh0: {r0} 0 0 0 0 0 0 0 {t0} 0 0 0 0 0 0 0
   vh1: {r1} 0 0 0 0 0 0 0 {t1} 0 0 0 0 0 0 0
"""


def _counters(h0_sent, h0_received, h1_sent=0, h1_received=0):
    # The bridge end's rx is what the host sent (network.host_counters).
    return {0: {"tx_bytes": h0_sent, "rx_bytes": h0_received},
            1: {"tx_bytes": h1_sent, "rx_bytes": h1_received}}


def _trace(sent, received=None, step=0.01, **extra):
    """A two-host trace whose host0 sent ``sent[i]`` bytes in sample i."""
    received = received or [0] * len(sent)
    samples, a, b = [(100.0, _counters(0, 0))], 0, 0
    for i, (s, r) in enumerate(zip(sent, received)):
        a, b = a + s, b + r
        samples.append((100.0 + (i + 1) * step, _counters(a, b)))
    return {**linktrace.record(samples, step), "rate_bits_per_sec": RATE, **extra}


def test_record_keeps_each_hosts_bytes_per_sample_and_times_from_the_first():
    samples = [(50.0, _counters(10, 20, 1, 2)), (50.01, _counters(110, 20, 1, 2)),
               (50.025, _counters(160, 70, 5, 2))]
    rec = linktrace.record(samples, 0.01)
    assert rec["seconds"] == [0.0, 0.01, 0.025]
    assert rec["hosts"]["host0"] == {"tx_bytes": [100, 50], "rx_bytes": [0, 50]}
    assert rec["hosts"]["host1"] == {"tx_bytes": [0, 4], "rx_bytes": [0, 0]}
    assert rec["truncated"] is False and "error" not in rec


def test_use_is_bytes_over_the_rate_for_each_samples_own_span():
    trace = _trace([125_000, 62_500, 0])
    use = linktrace.utilisation(trace, RATE)
    assert use["host0"]["tx"] == pytest.approx([1.0, 0.5, 0.0])
    # A late sample (15 ms) carries more bytes at the same use.
    late = {**trace, "seconds": [0.0, 0.01, 0.025, 0.035]}
    late["hosts"]["host0"]["tx_bytes"][1] = 187_500
    assert linktrace.utilisation(late, RATE)["host0"]["tx"][1] == pytest.approx(1.0)


def test_summary_counts_full_and_idle_samples_over_the_training_steps():
    # Start-up (idle), then training: full, idle, half, full; then idle again.
    sent = [0, 0, 125_000, 0, 62_500, 125_000, 0, 0]
    trace = _trace(sent, training_seconds=[0.025, 0.065])
    f = linktrace.summary(trace, RATE)["host0"]["tx"]
    assert f == {"mean": pytest.approx(0.625), "full": 0.5, "idle": 0.25}
    # Without the tasks' events, the window runs from the first to the last busy sample.
    bare = _trace(sent)
    assert linktrace.busy_window(linktrace.utilisation(bare, RATE)) == (2, 6)
    assert linktrace.summary(bare, RATE)["host0"]["tx"]["mean"] == pytest.approx(0.625)


def test_a_sample_microseconds_long_counts_for_its_time_not_as_a_whole_one():
    samples = [(0.0, _counters(0, 0)), (0.01, _counters(0, 0)), (0.0101, _counters(10_000, 0)),
               (0.0201, _counters(10_000, 0))]
    trace = {**linktrace.record(samples, 0.01), "training_seconds": [0.0, 0.03]}
    assert linktrace.utilisation(trace, RATE)["host0"]["tx"][1] == pytest.approx(8.0)
    f = linktrace.summary(trace, RATE)["host0"]["tx"]
    assert f["mean"] == pytest.approx(10_000 * 8 / (RATE * 0.0201), abs=1e-3)
    assert f["full"] == pytest.approx(0.0001 / 0.0201, abs=1e-3)
    assert f["idle"] == pytest.approx(0.02 / 0.0201, abs=1e-3)


def test_training_span_runs_from_the_first_step_to_the_last_progress_report():
    events = [(protocol.STARTED, 110.0), (protocol.PROGRESS, 120.0), (protocol.STARTED, 111.0),
              (protocol.PROGRESS, 130.5), (protocol.CHECKPOINT, 140.0)]
    assert linktrace.training_span(events, wall_start=100.0) == [10.0, 30.5]
    assert linktrace.training_span([(protocol.STARTED, 110.0)], 100.0) is None
    assert linktrace.training_span([], 100.0) is None


def test_the_thread_samples_until_stopped_and_a_last_sample_closes_the_record():
    reads, enough = [0], threading.Event()

    def read():
        reads[0] += 1
        if reads[0] >= 6:
            enough.set()
        n = reads[0] * 1000
        return NET_DEV.format(r0=n, t0=2 * n, r1=0, t1=0)

    trace = linktrace.LinkTrace(2, read=read, interval=0.001).start()
    assert enough.wait(10), "the sampling thread did not read six times"
    rec = trace.stop()
    assert len(rec["seconds"]) == reads[0] and reads[0] >= 7  # the last one taken by stop()
    # host0 sent (its bridge end's rx) 1,000 bytes between any two reads.
    assert set(rec["hosts"]["host0"]["tx_bytes"]) == {1000}
    assert sum(rec["hosts"]["host0"]["rx_bytes"]) == 2000 * (reads[0] - 1)
    assert rec["seconds"] == sorted(rec["seconds"]) and rec["wall_start"] > 0


def test_sampling_stops_at_its_limit_and_says_so():
    clock = iter(range(1000))
    trace = linktrace.LinkTrace(2, read=lambda: NET_DEV.format(r0=0, t0=0, r1=0, t1=0),
                                interval=0.0, max_seconds=5, clock=lambda: float(next(clock)))
    trace.start()
    trace._thread.join(10)  # pylint: disable=protected-access
    rec = trace.stop()
    assert rec["truncated"] is True and 2 <= len(rec["seconds"]) <= 7


def test_a_host_gone_mid_trace_keeps_what_was_read():
    texts = iter([NET_DEV.format(r0=0, t0=0, r1=0, t1=0), NET_DEV.format(r0=5, t0=0, r1=0, t1=0)])

    def read():
        return next(texts, "Inter-|\n face |\n")  # then the veths are gone

    trace = linktrace.LinkTrace(2, read=read, interval=0.001).start()
    trace._thread.join(10)  # pylint: disable=protected-access
    rec = trace.stop()
    assert rec["hosts"]["host0"]["tx_bytes"] == [5] and "KeyError" in rec["error"]


def test_link_trace_without_a_shaped_link_is_one_line():
    with pytest.raises(LaunchError, match="--link-trace.*--link-rate RATE"):
        network.check_hosts_mode(2, "auto", None, lambda: None, link_trace=True)
    with pytest.raises(LaunchError, match="--link-trace"):
        network.check_hosts_mode(0, "auto", None, lambda: None, link_trace=True)
    network.check_hosts_mode(2, "auto", "100mbit", lambda: None, link_trace=True)


def test_launcher_line_names_each_hosts_tasks_and_use():
    trace = _trace([125_000, 0], received=[0, 62_500])
    line = linktrace.describe(linktrace.summary(trace, RATE), 12.5,
                              {"host0": ["chief:0", "ps:0"], "host1": ["worker:0"]})
    assert line.startswith("[launch] link trace: 12.5 s")
    assert "host0 (chief:0, ps:0) out 0.50 in 0.25" in line and "host1 (worker:0)" in line
