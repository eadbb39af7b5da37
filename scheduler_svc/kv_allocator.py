"""KV slot allocator. The scheduler decides where every row's K/V lives; the
worker only owns the tensors.

A *slot* is one KV position (one row). A *page* is `page_size` consecutive
slots starting at a multiple of `page_size`; page p holds slots
[p*page_size, (p+1)*page_size). Allocation hands out whole pages: `alloc(n)`
returns the slots of ceil(n / page_size) pages, page after page, so a request's
slot list may be longer than n (the tail is room for its next rows). `free`
takes whole pages back and rejects double frees and slots it never handed out.
With page_size 1 this is a plain slot allocator (low slots first, the most
recently freed slot is reused first).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

__all__ = ["KVExhausted", "KVFreeError", "KVSlotAllocator"]


class KVExhausted(RuntimeError):
    pass


class KVFreeError(ValueError):
    """free() was given a slot that is not allocated (double free or foreign slot), or a partial page."""


class KVSlotAllocator:
    def __init__(self, num_slots: int, page_size: int = 1):
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        if num_slots < 0:
            raise ValueError(f"num_slots must be >= 0, got {num_slots}")
        self.page_size = page_size
        self.num_pages = num_slots // page_size  # a trailing partial page is never used
        self.num_slots = self.num_pages * page_size
        self.reset()

    def reset(self) -> None:
        """Forget every allocation (all pages free)."""
        self._free_pages = list(range(self.num_pages - 1, -1, -1))  # stack: pop() hands out low pages first
        self._page_used = np.zeros(self.num_pages, dtype=bool)
        self._offsets = np.arange(self.page_size, dtype=np.int64)

    # -- counts ---------------------------------------------------------------
    @property
    def free_pages(self) -> int:
        return len(self._free_pages)

    @property
    def used_pages(self) -> int:
        return self.num_pages - len(self._free_pages)

    @property
    def free_slots(self) -> int:
        return len(self._free_pages) * self.page_size

    @property
    def used_slots(self) -> int:
        return self.used_pages * self.page_size

    def pages_for(self, n: int) -> int:
        return -(-n // self.page_size)

    def can_alloc(self, n: int) -> bool:
        return self.pages_for(n) <= len(self._free_pages)

    def is_allocated(self, slots: Sequence[int] | np.ndarray) -> np.ndarray:
        """Per slot: is its page currently handed out? (out-of-range slots -> False)."""
        s = np.asarray(slots, dtype=np.int64).reshape(-1)
        ok = (s >= 0) & (s < self.num_slots)
        out = np.zeros(s.shape, dtype=bool)
        out[ok] = self._page_used[s[ok] // self.page_size]
        return out

    # -- alloc / free -----------------------------------------------------------
    def alloc(self, n: int) -> list[int]:
        """Slots of ceil(n / page_size) fresh pages, in page order (len is a multiple of page_size)."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} slots")
        k = self.pages_for(n)
        if k > len(self._free_pages):
            raise KVExhausted(f"need {n} KV slots ({k} pages of {self.page_size}), {self.free_slots} free")
        if k == 0:
            return []
        pages = self._free_pages[-k:][::-1]
        del self._free_pages[-k:]
        idx = np.asarray(pages, dtype=np.int64)
        self._page_used[idx] = True
        if self.page_size == 1:
            return pages
        return (idx[:, None] * self.page_size + self._offsets).reshape(-1).tolist()

    def free(self, slots: Sequence[int] | np.ndarray) -> None:
        """Return whole pages. Validates everything before changing state, so a bad call frees nothing."""
        s = np.asarray(slots, dtype=np.int64).reshape(-1)
        if s.size == 0:
            return
        ps = self.page_size
        if s.size % ps:
            raise KVFreeError(f"free() got {s.size} slots, not a whole number of {ps}-slot pages")
        bad = s[(s < 0) | (s >= self.num_slots)]
        if bad.size:
            raise KVFreeError(f"KV slot {int(bad[0])} is outside the pool of {self.num_slots} slots")
        rows = s.reshape(-1, ps)
        pages = rows[:, 0] // ps
        if ps > 1 and not (rows == (pages * ps)[:, None] + self._offsets).all():
            raise KVFreeError("free() slots are not whole pages in order (page-aligned, consecutive)")
        if np.unique(pages).size != pages.size:
            raise KVFreeError("KV slots freed twice in the same free() call")
        used = self._page_used[pages]
        if not used.all():
            p = int(pages[~used][0])
            raise KVFreeError(f"KV slot {p * ps} freed twice or never allocated")
        self._page_used[pages] = False
        self._free_pages.extend(pages.tolist())
