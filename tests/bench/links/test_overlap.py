"""The overlap reader: per step, the backward pass and each bucket's all-reduce, from a trace."""

from tfdist.bench.links import overlap

BW = "while/body/_1/gradient_tape/while/cnn/{}:Op"
C0 = "while/body/_1/while/adam/CollectiveReduceV2:CollectiveReduceV2"
C1 = "while/body/_1/while/adam/CollectiveReduceV2_1:CollectiveReduceV2"


def _step(t):
    # Backward 0-60 ms; bucket 1 (last layers) 20-80 while it runs, bucket 2 after.
    return [(t, t + 20, BW.format("dense")), (t + 20, t + 60, BW.format("conv")),
            (t + 20, t + 80, C0), (t + 81, t + 90, C1), (t + 95, t + 99, "forward:Conv2D")]


def test_each_step_is_read_with_its_buckets_in_issue_order():
    rows = overlap.steps(sorted(_step(0) + _step(100)))
    assert len(rows) == 2
    for row in rows:
        assert row["backward"] == [0.0, 60.0]
        assert row["buckets"] == [[20.0, 80.0], [81.0, 90.0]]
        assert row["overlapped_ms"] == 40.0 and row["transfer_ms"] == 69.0


def test_one_bucket_after_the_backward_pass_overlaps_nothing():
    evs = [(0, 60, BW.format("conv")), (61, 130, C0)]
    (row,) = overlap.steps(evs)
    assert row["buckets"] == [[61.0, 130.0]] and row["overlapped_ms"] == 0.0


def test_bucket_numbers():
    assert overlap._bucket(C0) == 0 and overlap._bucket(C1) == 1
    assert overlap._bucket(BW.format("x")) is None
