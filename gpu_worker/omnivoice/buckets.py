"""The fixed shapes a graphed packed step runs in: (rows, documents) buckets, and the filler that
pads a step up to its bucket.

A step of r rows in s documents runs in the smallest bucket (R, S) with S > s and
R >= r + (S - s): the S - s filler documents share the R - r rows left over (at least one each,
evenly otherwise, so no filler document costs more attention than the real ones need). A
filler row is MASK in every codebook at its position inside its filler document; the real rows
come first, so their hidden states are the output's first r rows. Documents never attend across
each other, so filler changes no real row's attention; what it does change is the GEMMs' row
count (on the GPU a row's result may then move by rounding; on the CPU, at multiples of
model.ROW_MULTIPLE, it does not).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# Rows: a step pays for its bucket's padding rows as for real ones, so the buckets stay within
# 1.25x apart to 2,048 rows (one O1 canvas with guidance is ~340 rows: bucket 384, not 512),
# 256 to 2,560, 512 to 16,384 (32 O1 canvases in flight, ~9,000 rows, pad ~3% on average) and
# 1,024 apart above. Each bucket is a graph per document bucket, captured at start-up.
ROW_BUCKETS = (256, 320, 384, 448, 512, 640, 768, 896, 1024, 1280, 1536, 1792, 2048, 2304, 2560, 3072, 3584,
               4096) + tuple(range(4608, 16385, 512)) + tuple(range(17408, 32769, 1024))
# Documents: a flashinfer plan in a CUDA graph has a fixed document count; the last bucket holds
# every document a step may carry (two per canvas) plus one filler.
DOC_BUCKETS = (4, 16, 64)
ROW_ALIGN = 256


@dataclass(frozen=True)
class Bucket:
    rows: int
    docs: int


class Buckets:
    def __init__(self, max_packed_rows: int, max_batch: int):
        self.max_docs = 2 * max_batch + 1
        self.docs = [b for b in DOC_BUCKETS if b < self.max_docs] + [self.max_docs]
        top = -(-(max_packed_rows + self.max_docs) // ROW_ALIGN) * ROW_ALIGN
        self.rows = [b for b in ROW_BUCKETS if b < top] + [top]

    def pick(self, rows: int, docs: int) -> Bucket | None:
        """The bucket of a step of `rows` rows in `docs` documents, or None (no bucket holds it)."""
        s = next((b for b in self.docs if b > docs), None)
        if s is None:
            return None
        r = next((b for b in self.rows if b >= rows + s - docs), None)
        return None if r is None else Bucket(r, s)

    def all(self) -> list[Bucket]:
        """Every bucket, largest first (captured in this order, smaller graphs reuse its memory)."""
        return [Bucket(r, s) for r in reversed(self.rows) for s in reversed(self.docs) if s <= r]


def filler_lens(rows: int, docs: int, bucket: Bucket) -> list[int]:
    """Rows of each filler document that pads `rows` rows in `docs` documents to `bucket`."""
    n, left = bucket.docs - docs, bucket.rows - rows
    if n < 1 or left < n:
        raise ValueError(f"{rows} rows in {docs} documents do not fit bucket {bucket}")
    return [left // n + (i < left % n) for i in range(n)]


def padded_layout(doc_lens: list[int], positions: np.ndarray, bucket: Bucket) -> tuple[list[int], np.ndarray]:
    """(document rows, positions [R]) of a step padded to `bucket`: the real documents, then the
    filler documents, each with positions from 0."""
    filler = filler_lens(int(sum(doc_lens)), len(doc_lens), bucket)
    return [*doc_lens, *filler], np.concatenate([np.asarray(positions, dtype=np.int64)] +
                                                [np.arange(n, dtype=np.int64) for n in filler])
