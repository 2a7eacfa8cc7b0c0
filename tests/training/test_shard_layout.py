"""The sharded state's layout (training.sync.shard_layout): buckets, padding, each worker's
pieces, and variables flattened into shards and back (NumPy stands in for the collectives)."""

import numpy as np
import pytest

from tfdist.training.sync.shard_layout import ShardLayout


def shards_of(layout, values):
    """Each worker's shard of ``values`` (one flat array per variable), by its pieces."""
    out = []
    for rank in range(layout.workers):
        shard = np.zeros(layout.shard_size)
        for p in layout.pieces(rank):
            shard[p.at:p.at + p.length] = values[p.var][p.start:p.stop]
        out.append(shard)
    return out


def gathered(layout, shards):
    """What the all-gather of every bucket gives: each variable whole again."""
    rows = np.stack(shards)  # [workers, shard]
    out = [np.full(s, np.nan) for s in layout.sizes]
    for b in layout.buckets:
        whole = rows[:, b.column:b.column + b.chunk].reshape(-1)[:b.size]
        start = 0
        for seg in b.segments:
            out[seg.var][seg.start:seg.stop] = whole[start:start + seg.length]
            start += seg.length
    return out


@pytest.mark.parametrize("sizes,workers,bucket", [
    ((7850,), 2, None), ((3, 5, 1, 9), 4, None), ((3, 5, 1, 9), 4, 6), ((10, 10), 3, 1),
    ((1,), 4, None), ((100, 2, 2, 100, 7), 3, 50)])
@pytest.mark.parametrize("cut", [False, True])
def test_shards_cover_every_element_once_and_gather_back(sizes, workers, bucket, cut):
    # cut: every variable of rows of 1 element (a bias) may be cut into blocks
    layout = ShardLayout.plan(sizes, workers, bucket, rows=[1] * len(sizes) if cut else None)
    values = [np.arange(s, dtype=float) + 1000 * i for i, s in enumerate(sizes)]
    shards = shards_of(layout, values)
    back = gathered(layout, shards)
    assert all(np.array_equal(a, b) for a, b in zip(back, values))
    held = sum(p.length for r in range(workers) for p in layout.pieces(r))
    assert held == sum(sizes)  # no element twice, none missing
    # Every worker's shard is the same size; padding is less than one chunk per bucket.
    assert all(s.shape == (layout.shard_size,) for s in shards)
    assert all(b.padded == b.chunk * workers and 0 <= b.padded - b.size < workers
               for b in layout.buckets)


def test_buckets_are_made_from_the_last_variable_back_and_split_none_without_rows():
    layout = ShardLayout.plan((4, 4, 4, 20, 1), 2, 5)
    assert [[s.var for s in b.segments] for b in layout.buckets] == [[3, 4], [1, 2], [0]]
    assert [b.column for b in layout.buckets] == [0, 11, 15]
    assert layout.shard_size == 11 + 4 + 2
    one = ShardLayout.plan((4, 4, 4, 20, 1), 2)
    assert [(len(b.segments), b.size, b.chunk) for b in one.buckets] == [(5, 33, 17)]


def test_a_variable_larger_than_a_bucket_is_cut_into_blocks_of_whole_rows():
    # A [4, 6] kernel (rows of 6), then a bias of 6, buckets of 13 elements: the bias
    # alone is a bucket; the kernel, larger than a bucket, is two blocks of 2 rows (12).
    layout = ShardLayout.plan((24, 6), 2, 13, rows=(6, 1))
    assert [[(s.var, s.start, s.stop) for s in b.segments] for b in layout.buckets] == [
        [(1, 0, 6)], [(0, 0, 12)], [(0, 12, 24)]]
    assert [(i, off, seg.start) for i, off, seg in layout.placements(0)] == [(1, 0, 0),
                                                                             (2, 0, 12)]
    # A row wider than a bucket is a bucket of one row; the variable is still cut.
    wide = ShardLayout.plan((30,), 2, 4, rows=(10,))
    assert [b.segments[0].length for b in wide.buckets] == [10, 10, 10]


def test_pieces_name_the_variable_slices_and_where_they_sit():
    layout = ShardLayout.plan((3, 5), 2)  # 8 elements, chunk 4
    assert [(p.var, p.start, p.stop, p.at) for p in layout.pieces(0)] == [(0, 0, 3, 0),
                                                                           (1, 0, 1, 3)]
    assert [(p.var, p.start, p.stop, p.at) for p in layout.pieces(1)] == [(1, 1, 5, 0)]
    assert [(i, off) for i, off, _ in layout.placements(1)] == [(0, 3)]
    uneven = ShardLayout.plan((5,), 4)  # chunk 2, the last worker's chunk all padding but 0
    assert [p.length for r in range(4) for p in uneven.pieces(r)] == [2, 2, 1]
    with pytest.raises(IndexError):
        layout.pieces(2)
