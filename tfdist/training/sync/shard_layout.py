"""Pure: how the trainable variables, flattened, are split over N workers (``--shard-state``).

The variables are laid end to end in buckets (the last variables first, as the
backward pass makes their gradients; a variable larger than a bucket is cut into
blocks of whole rows, a bucket each, so no collective moves a whole wide kernel
at once), each bucket padded with zeros to a multiple of N and cut into N equal chunks: worker ``r`` owns chunk ``r`` of
every bucket, and its shard is those chunks end to end. A reduce-scatter of a
bucket is then an all-to-all of its ``[N, chunk]`` rows plus a sum (TensorFlow
has no CPU reduce-scatter), and an all-gather of a worker's chunk gives the
bucket back whole.

No TensorFlow here: sizes and offsets only, so the layout is tested on its own
(``tests/training/test_shard_layout.py``).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Segment:
    """Elements ``start`` to ``stop - 1`` of variable ``var`` (flattened) in one bucket:
    the whole variable, or a block of its rows when it is larger than a bucket."""

    var: int
    start: int
    stop: int

    @property
    def length(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True)
class Bucket:
    """``segments`` end to end: ``size`` elements, padded to ``padded`` (workers x
    chunk); each worker's chunk starts at ``column`` in its shard."""

    segments: tuple[Segment, ...]
    size: int
    chunk: int
    column: int
    padded: int


@dataclass(frozen=True)
class Piece:
    """Elements ``start`` to ``stop - 1`` of variable ``var`` (flattened), held at
    ``at`` in one worker's shard."""

    var: int
    start: int
    stop: int
    at: int

    @property
    def length(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True)
class ShardLayout:
    """The variables' sizes (elements), the workers, the buckets; see the module."""

    sizes: tuple[int, ...]
    workers: int
    buckets: tuple[Bucket, ...]

    @classmethod
    def plan(cls, sizes, workers: int, bucket_elements: int | None = None,
             rows=None) -> "ShardLayout":
        """Buckets of at least ``bucket_elements`` (None: one bucket of everything), made
        from the last variable back. A variable larger than a bucket whose row (``rows``:
        elements per first-axis index) is smaller is cut into blocks of whole rows, a
        bucket each, so its reduce-scatter and all-gather move a bucket at a time;
        otherwise a variable is never split between buckets."""
        if workers < 1:
            raise ValueError(f"workers={workers}: at least 1")
        sizes = tuple(int(s) for s in sizes)
        rows = sizes if rows is None else tuple(max(1, int(r)) for r in rows)
        limit = sum(sizes) if bucket_elements is None else max(1, int(bucket_elements))
        groups, current, total = [], [], 0
        for i in range(len(sizes) - 1, -1, -1):
            if sizes[i] > limit and rows[i] < sizes[i]:
                if current:
                    groups.append(current)
                current, total = [], 0
                block = max(1, limit // rows[i]) * rows[i]
                groups += [[Segment(i, s, min(s + block, sizes[i]))]
                           for s in range(0, sizes[i], block)]
                continue
            current.insert(0, Segment(i, 0, sizes[i]))
            total += sizes[i]
            if total >= limit:
                groups.append(current)
                current, total = [], 0
        if current:
            groups.append(current)
        buckets, column = [], 0
        for segments in groups:
            size = sum(s.length for s in segments)
            chunk = -(-size // workers)  # ceil: the last worker's chunk ends in padding
            buckets.append(Bucket(tuple(segments), size, chunk, column, chunk * workers))
            column += chunk
        return cls(sizes, workers, tuple(buckets))

    @property
    def shard_size(self) -> int:
        """Elements in each worker's shard (padding included): the same on every worker."""
        return sum(b.chunk for b in self.buckets)

    @property
    def total(self) -> int:
        return sum(self.sizes)

    def placements(self, var: int) -> list[tuple[int, int, Segment]]:
        """Where variable ``var`` lies: (bucket index, offset in that bucket, segment) for
        each of its segments, in the variable's order."""
        out = []
        for i, b in enumerate(self.buckets):
            offset = 0
            for seg in b.segments:
                if seg.var == var:
                    out.append((i, offset, seg))
                offset += seg.length
        if not out:
            raise IndexError(f"variable {var} of {len(self.sizes)}")
        return sorted(out, key=lambda p: p[2].start)

    def pieces(self, rank: int) -> list[Piece]:
        """What worker ``rank``'s shard holds, in shard order (padding left out)."""
        if not 0 <= rank < self.workers:
            raise IndexError(f"rank {rank} of {self.workers} workers")
        out = []
        for b in self.buckets:
            lo, hi = rank * b.chunk, min((rank + 1) * b.chunk, b.size)
            start = 0
            for seg in b.segments:
                end = start + seg.length
                a, z = max(lo, start), min(hi, end)
                if a < z:
                    out.append(Piece(seg.var, seg.start + a - start, seg.start + z - start,
                                     b.column + a - lo))
                start = end
        return out
