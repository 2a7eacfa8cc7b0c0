"""Pure: how the trainable variables, flattened, are split over N workers (``--shard-state``).

The variables are laid end to end in buckets (the last variables first, as the
backward pass makes their gradients), each bucket padded with zeros to a
multiple of N and cut into N equal chunks: worker ``r`` owns chunk ``r`` of
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
class Bucket:
    """Variables ``first`` to ``stop - 1`` end to end: ``size`` elements, padded to
    ``padded`` (workers x chunk); each worker's chunk starts at ``column`` in its shard."""

    first: int
    stop: int
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
    def plan(cls, sizes, workers: int, bucket_elements: int | None = None) -> "ShardLayout":
        """Buckets of at least ``bucket_elements`` (None: one bucket of everything), made
        from the last variable back; a variable is never split between buckets."""
        if workers < 1:
            raise ValueError(f"workers={workers}: at least 1")
        sizes = tuple(int(s) for s in sizes)
        limit = sum(sizes) if bucket_elements is None else max(1, int(bucket_elements))
        ranges, stop, total = [], len(sizes), 0
        for i in range(len(sizes) - 1, -1, -1):
            total += sizes[i]
            if total >= limit or i == 0:
                ranges.append((i, stop))
                stop, total = i, 0
        buckets, column = [], 0
        for first, stop in ranges:
            size = sum(sizes[first:stop])
            chunk = -(-size // workers)  # ceil: the last worker's chunk ends in padding
            buckets.append(Bucket(first, stop, size, chunk, column, chunk * workers))
            column += chunk
        return cls(sizes, workers, tuple(buckets))

    @property
    def shard_size(self) -> int:
        """Elements in each worker's shard (padding included): the same on every worker."""
        return sum(b.chunk for b in self.buckets)

    @property
    def total(self) -> int:
        return sum(self.sizes)

    def offset_in_bucket(self, var: int) -> tuple[Bucket, int]:
        """The bucket holding variable ``var`` and where it starts in that bucket."""
        for b in self.buckets:
            if b.first <= var < b.stop:
                return b, sum(self.sizes[b.first:var])
        raise IndexError(f"variable {var} of {len(self.sizes)}")

    def pieces(self, rank: int) -> list[Piece]:
        """What worker ``rank``'s shard holds, in shard order (padding left out)."""
        if not 0 <= rank < self.workers:
            raise IndexError(f"rank {rank} of {self.workers} workers")
        out = []
        for b in self.buckets:
            lo, hi = rank * b.chunk, min((rank + 1) * b.chunk, b.size)
            start = 0
            for var in range(b.first, b.stop):
                end = start + self.sizes[var]
                a, z = max(lo, start), min(hi, end)
                if a < z:
                    out.append(Piece(var, a - start, z - start, b.column + a - lo))
                start = end
        return out
