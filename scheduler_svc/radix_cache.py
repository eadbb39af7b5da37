"""Radix (prefix) cache of KV rows, owned by the scheduler.

A sequence is a list of 64-bit row keys (scheduler_svc/row_keys.py); each row's
K/V lives in one KV slot. The tree is compressed: a node holds a run of keys and
the slot of each of those rows, so a long unshared prompt is one node, not one
node per row. One sub-tree per `extra_key` (model / codec identity), so requests
whose rows mean different things never share KV even when their keys collide.

With page_size P > 1 only whole pages are cached and matched: every node holds a
multiple of P rows, and each P-row run maps to one allocator page, so eviction
hands back whole pages.

Ownership of slots (every allocated slot has exactly one owner):
  * slots from allocator.alloc() belong to the request that asked for them;
  * slots returned by match_prefix() belong to the cache; the request may read
    them only while it holds lock(result.node), and must never free them;
  * insert(keys, slots) -> p, with L = len(keys) rounded down to whole pages:
      - rows [p, L): ownership moves to the cache; the caller must not free them;
      - rows [0, p): were already cached; the cache keeps its own slots. Where the
        caller passed its own private slots for those rows (duplicates computed
        before someone else inserted the same prefix), it must free them: with
        m = the length of the caller's own earlier match, free slots[m:p];
      - rows [L, ...) (a partial last page, spare tail): still the caller's;
  * evict() and reset() hand cache-owned slots back to the allocator.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field
from typing import Iterator, NamedTuple, Sequence

import numpy as np

from scheduler_svc.kv_allocator import KVSlotAllocator

__all__ = ["RadixCache", "RadixNode", "MatchResult"]


@dataclass(eq=False)
class RadixNode:
    keys: list[int] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)
    parent: RadixNode | None = None
    children: dict = field(default_factory=dict)  # first page of the child's keys -> child
    lock_ref: int = 0  # locks held on this node or any descendant
    last_access: int = 0

    @property
    def is_root(self) -> bool:
        return self.parent is None


class MatchResult(NamedTuple):
    slots: list[int]   # KV slot of each matched row (cache-owned)
    node: RadixNode    # deepest matched node; lock() it while using the slots
    length: int        # matched rows (a multiple of page_size)


def _as_list(x: Sequence[int] | np.ndarray) -> list[int]:
    return x.tolist() if isinstance(x, np.ndarray) else [int(v) for v in x]


class RadixCache:
    def __init__(self, allocator: KVSlotAllocator, page_size: int | None = None):
        page_size = allocator.page_size if page_size is None else page_size
        if page_size < 1 or page_size % allocator.page_size:
            raise ValueError(f"cache page_size {page_size} must be a multiple of the allocator's "
                             f"page_size {allocator.page_size} (eviction frees whole pages)")
        self.allocator = allocator
        self.page_size = page_size
        self._clock = itertools.count(1)  # logical time: deterministic LRU order
        self._roots: dict[str, RadixNode] = {}
        self.locked_slots = 0
        self.reset()

    def reset(self) -> None:
        """Free every cached slot to the allocator and empty the tree. Nothing may be locked."""
        if self.locked_slots:
            raise RuntimeError(f"reset() with {self.locked_slots} locked rows still in use")
        for n in self.iter_nodes():
            self.allocator.free(n.slots)
        self._roots = {}
        self.cached_slots = 0
        self.evictable_slots = 0
        self.locked_slots = 0
        self.hit_rows = 0
        self.queried_rows = 0

    # -- helpers --------------------------------------------------------------
    def _root(self, extra_key: str) -> RadixNode:
        root = self._roots.get(extra_key)
        if root is None:
            root = self._roots[extra_key] = RadixNode(lock_ref=1)  # root: never evictable
        return root

    def _child_key(self, keys: list[int], i: int):
        return keys[i] if self.page_size == 1 else tuple(keys[i:i + self.page_size])

    def _common_len(self, a: list[int], b: list[int], start: int, end: int) -> int:
        n = min(len(a), end - start)
        i = 0
        while i < n and a[i] == b[start + i]:
            i += 1
        return i - i % self.page_size  # only whole pages are shared

    def _split(self, node: RadixNode, m: int) -> RadixNode:
        # A new sequence diverges inside node's run (or a match stops there): cut the
        # run at m so the shared part becomes its own node. The shared part can then be
        # locked / kept on its own while the two tails are evicted independently.
        head = RadixNode(node.keys[:m], node.slots[:m], node.parent, {},
                         node.lock_ref, node.last_access)
        node.parent.children[self._child_key(node.keys, 0)] = head
        node.keys, node.slots, node.parent = node.keys[m:], node.slots[m:], head
        head.children[self._child_key(node.keys, 0)] = node
        return head

    def _walk(self, node: RadixNode) -> Iterator[RadixNode]:
        stack = [node]
        while stack:
            n = stack.pop()
            yield n
            stack.extend(n.children.values())

    def iter_nodes(self) -> Iterator[RadixNode]:
        """Every non-root node (for audits and tests)."""
        for root in self._roots.values():
            for n in self._walk(root):
                if not n.is_root:
                    yield n

    def owned_slots(self) -> list[int]:
        return [s for n in self.iter_nodes() for s in n.slots]

    @property
    def hit_rate(self) -> float:
        return self.hit_rows / self.queried_rows if self.queried_rows else 0.0

    # -- public API -----------------------------------------------------------
    def match_prefix(self, keys: Sequence[int] | np.ndarray, extra_key: str = "",
                     *, record_stats: bool = True) -> MatchResult:
        keys = _as_list(keys)
        n = len(keys) - len(keys) % self.page_size
        node, now, i, slots = self._root(extra_key), next(self._clock), 0, []
        node.last_access = now
        while i < n:
            child = node.children.get(self._child_key(keys, i))
            if child is None:
                break
            child.last_access = now
            m = self._common_len(child.keys, keys, i, n)
            if m < len(child.keys):
                child = self._split(child, m)  # so the returned node covers exactly the matched rows
            slots += child.slots
            i += m
            node = child
        if record_stats:
            self.hit_rows += i
            self.queried_rows += len(keys)
        return MatchResult(slots, node, i)

    def insert(self, keys: Sequence[int] | np.ndarray, slots: Sequence[int] | np.ndarray,
               extra_key: str = "") -> int:
        """Cache rows [0, L) (L = whole pages of keys); returns how many leading rows were
        already cached. See the module docstring for who owns which slots afterwards."""
        keys, slots = _as_list(keys), _as_list(slots)
        if len(slots) < len(keys):
            raise ValueError(f"insert: {len(keys)} keys but {len(slots)} slots")
        n = len(keys) - len(keys) % self.page_size
        node, now, i = self._root(extra_key), next(self._clock), 0
        node.last_access = now
        while i < n:
            child = node.children.get(self._child_key(keys, i))
            if child is None:  # the rest is new: one leaf takes ownership of its slots
                leaf = RadixNode(keys[i:n], slots[i:n], node, {}, 0, now)
                node.children[self._child_key(keys, i)] = leaf
                self.cached_slots += n - i
                self.evictable_slots += n - i
                break
            child.last_access = now
            m = self._common_len(child.keys, keys, i, n)
            if m < len(child.keys):
                child = self._split(child, m)
            i += m
            node = child
        return i

    def lock(self, node: RadixNode) -> None:
        """Pin the rows root->node: they will not be evicted until unlock(node)."""
        while not node.is_root:
            if node.lock_ref == 0:
                self.evictable_slots -= len(node.slots)
                self.locked_slots += len(node.slots)
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: RadixNode) -> None:
        while not node.is_root:
            if node.lock_ref <= 0:
                raise RuntimeError("unlock() without a matching lock()")
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self.evictable_slots += len(node.slots)
                self.locked_slots -= len(node.slots)
            node = node.parent

    def evict(self, num_slots: int) -> int:
        """Free least-recently-used unlocked rows until at least num_slots are freed (or
        nothing evictable is left). Returns how many slots went back to the allocator.

        Only leaves are evicted: an inner node is the prefix of every sequence below it,
        and a suffix's KV is useless without its prefix's, so a prefix goes only after all
        its extensions. Removing a leaf can make its parent a leaf, which then competes."""
        if num_slots <= 0:
            return 0
        heap = [(n.last_access, id(n), n) for n in self.iter_nodes()
                if not n.children and n.lock_ref == 0]
        heapq.heapify(heap)
        freed = 0
        while heap and freed < num_slots:
            _, _, node = heapq.heappop(heap)
            freed += self._remove(node)
            parent = node.parent
            if not parent.is_root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, (parent.last_access, id(parent), parent))
        return freed

    def drop_prefix(self, keys: Sequence[int] | np.ndarray, extra_key: str = "", shared_rows: int = 0) -> int:
        """Free the cached rows of every sequence that starts with keys' whole pages: a prefix no
        request will ask for again (a deleted voice's), whose sequences LRU would keep until the KV
        runs short. Locked rows stay; so do rows on the prefix's path that another sequence goes
        through. Nothing goes when the whole pages are not all cached, or lie within [0, shared_rows)
        (a start other prefixes share). Returns how many slots went back to the allocator."""
        keys = _as_list(keys)
        n = len(keys) - len(keys) % self.page_size
        if n <= shared_rows:
            return 0
        match = self.match_prefix(keys[:n], extra_key, record_stats=False)
        if match.length < n:
            return 0
        top, freed = match.node, 0
        below = list(self._walk(top))
        for node in reversed(below):  # children before their parent
            if not node.children and node.lock_ref == 0:
                freed += self._remove(node)
        node = top.parent
        while not node.is_root and not node.children and node.lock_ref == 0:
            freed += self._remove(node)
            node = node.parent
        return freed

    def _remove(self, node: RadixNode) -> int:
        """Hand an unlocked leaf's slots back and take it out of the tree."""
        self.allocator.free(node.slots)
        self.cached_slots -= len(node.slots)
        self.evictable_slots -= len(node.slots)
        del node.parent.children[self._child_key(node.keys, 0)]
        return len(node.slots)

    def ensure_free(self, num_slots: int) -> bool:
        """Evict until allocator.alloc(num_slots) can succeed; False if it cannot. Once the
        cache fills the KV every admission and new decode page lands here, and each evict()
        walks the whole tree (a quarter of the scheduler core's time at c256 on the H200):
        so evict a 1/64 of the capacity at once, at least what is short."""
        short = self.allocator.pages_for(num_slots) * self.allocator.page_size - self.allocator.free_slots
        if short > 0:
            self.evict(max(short, self.allocator.num_slots // 64))
        return self.allocator.can_alloc(num_slots)
