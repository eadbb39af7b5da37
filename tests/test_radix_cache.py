import pytest
from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from scheduler_svc.kv_allocator import KVSlotAllocator
from scheduler_svc.radix_cache import RadixCache


def make(num_slots=64, page_size=1):
    a = KVSlotAllocator(num_slots, page_size)
    return a, RadixCache(a)


def cache_seq(cache, keys, extra_key=""):
    """Allocate fresh slots for keys and hand them all to the cache."""
    slots = cache.allocator.alloc(len(keys))
    assert cache.insert(keys, slots, extra_key) == 0
    return slots


def test_split_shares_common_prefix():
    a, c = make()
    s1 = cache_seq(c, list(b"abcd"))
    s2 = a.alloc(4)
    assert c.insert(list(b"abxy"), s2) == 2  # "ab" already cached
    a.free(s2[:2])  # our duplicate "ab" rows are still ours to free
    assert c.cached_slots == 6 and a.used_slots == 6
    root = c._roots[""]
    (ab,) = root.children.values()
    assert ab.keys == list(b"ab") and ab.slots == s1[:2]
    assert sorted(n.keys for n in ab.children.values()) == [list(b"cd"), list(b"xy")]
    r = c.match_prefix(list(b"abxyz"))
    assert (r.slots, r.length, r.node.keys) == (s1[:2] + s2[2:], 4, list(b"xy"))
    r = c.match_prefix(list(b"abc"))  # stops inside "cd": split so the node is exactly the match
    assert (r.slots, r.length, r.node.keys) == (s1[:3], 3, list(b"c"))
    assert c.match_prefix(list(b"q")).length == 0


def test_page_alignment():
    a, c = make(32, page_size=2)
    s = a.alloc(5)
    assert c.insert([1, 2, 3, 4, 5], s) == 0
    assert c.cached_slots == 4  # the partial page stays with the caller
    a.free(s[4:])
    assert c.match_prefix([1, 2, 3]).slots == s[:2]
    s2 = a.alloc(4)
    assert c.insert([1, 2, 3, 9], s2) == 2  # a page differing in its 2nd row is not shared
    a.free(s2[:2])
    assert c.match_prefix([1, 2, 3, 9]).slots == s[:2] + s2[2:]
    s3 = cache_seq(c, [5, 6, 7, 8])
    s4 = a.alloc(4)
    assert c.insert([5, 6, 7, 0], s4) == 2  # same, on a node no match has split yet
    a.free(s4[:2])
    assert c.match_prefix([5, 6, 7, 0]).slots == s3[:2] + s4[2:]
    assert c.evict(100) == 12 and a.used_slots == 0
    with pytest.raises(ValueError):
        RadixCache(a, page_size=3)


def test_drop_prefix_frees_the_prefixs_sequences_and_nothing_shared_or_locked():
    a, c = make(64, page_size=2)
    header = [1, 2, 3, 4]                     # a start every voice shares
    voice, other = [10, 11, 12], [20, 21, 22]  # odd: the prefix's last row shares a page with the text

    def finished(keys):  # a request's rows to the cache, as the policy hands them over
        slots = a.alloc(len(keys))
        a.free(slots[:c.insert(keys, slots)] + slots[len(keys) - len(keys) % 2:])

    for tail in ([30, 31, 32, 33], [40, 41]):
        finished(header + voice + tail)
    finished(header + other + [30, 31, 32, 33])
    finished([9, 9, 9, 9])
    locked = c.match_prefix(header + voice + [50, 51, 52])  # a running request's prefix...
    assert locked.length == 6
    assert c.insert(header + voice + [50], locked.slots + a.alloc(2)) == 6  # ...and rows past it
    c.lock(locked.node)
    before = c.cached_slots
    assert c.drop_prefix(header + [10], shared_rows=4) == 0  # its whole pages lie in the shared start
    assert c.drop_prefix(header + [77, 78]) == 0              # not cached: nothing
    freed = c.drop_prefix(header + voice, shared_rows=4)
    assert freed == 2 + 4 + 2 and c.cached_slots == before - freed == a.used_slots
    assert c.match_prefix(header + voice + [30, 31]).length == 6   # the locked path stays
    assert c.match_prefix(header + other + [30, 31]).length == 8  # the other voice's, untouched
    assert c.match_prefix([9, 9, 9, 9]).length == 4
    c.unlock(locked.node)
    assert c.drop_prefix(header + voice, shared_rows=4) == 2        # now unlocked: it goes too
    assert c.drop_prefix(header + other, shared_rows=4) == 6 + 4    # the last voice takes the start with it
    assert c.cached_slots == a.used_slots == 4 == c.evictable_slots


def test_extra_key_isolation():
    a, c = make()
    s = cache_seq(c, [1, 2, 3], "model-a")
    assert c.match_prefix([1, 2, 3], "model-b").length == 0
    assert c.match_prefix([1, 2, 3]).length == 0
    assert c.match_prefix([1, 2, 3], "model-a").slots == s
    s2 = cache_seq(c, [1, 2, 3], "model-b")  # same keys, own rows
    assert set(s).isdisjoint(s2) and c.cached_slots == 6


def test_lock_blocks_eviction_and_lru_order():
    a, c = make()
    old = cache_seq(c, [1, 2])
    mid = cache_seq(c, [3, 4])
    new = cache_seq(c, [5, 6])
    c.match_prefix([1, 2])  # touch: [3, 4] is now the least recently used
    assert c.evict(1) == 2 and c.match_prefix([3, 4]).length == 0
    r = c.match_prefix([5, 6])
    c.lock(r.node)
    assert (c.locked_slots, c.evictable_slots) == (2, 2)
    assert c.evict(100) == 2
    assert c.match_prefix([5, 6]).slots == new and c.cached_slots == 2
    with pytest.raises(RuntimeError):
        c.reset()
    c.unlock(r.node)
    with pytest.raises(RuntimeError):
        c.unlock(r.node)
    assert c.evictable_slots == 2
    c.reset()
    assert a.used_slots == 0 and c.cached_slots == 0 and c.queried_rows == 0
    del old, mid


def test_evict_parent_after_children_and_ensure_free():
    a, c = make(8)
    cache_seq(c, [1, 2, 3])
    s = a.alloc(4)
    assert c.insert([1, 2, 7, 8], s) == 2
    a.free(s[:2])
    assert a.free_slots == 3
    assert c.ensure_free(6)  # evicts one leaf, then enough
    assert a.free_slots >= 6
    assert c.ensure_free(8) and c.cached_slots == 0  # leaves, then their parent
    assert not c.ensure_free(9)


def test_hit_stats():
    a, c = make()
    cache_seq(c, [1, 2, 3, 4])
    c.match_prefix([1, 2, 9])
    c.match_prefix([5], record_stats=False)
    assert (c.hit_rows, c.queried_rows) == (2, 3) and c.hit_rate == pytest.approx(2 / 3)


# a few common stems plus a random tail over a tiny alphabet: lots of shared prefixes and splits
keys_st = st.tuples(st.sampled_from([[], [0, 1, 0, 1], [0, 1, 2, 2], [2, 2, 2, 2, 1, 0]]),
                    st.lists(st.integers(0, 2), max_size=6)).map(lambda t: t[0] + t[1])
extra_st = st.sampled_from(["", "other-model"])


class CacheMachine(RuleBasedStateMachine):
    """Requests match, lock, allocate, insert/free and unlock in random interleavings with
    evictions; every allocated slot must always have exactly one owner."""

    @initialize(page_size=st.sampled_from([1, 2, 4]), pages=st.integers(4, 24))
    def setup(self, page_size, pages):
        self.ps = page_size
        self.alloc = KVSlotAllocator(pages * page_size, page_size)
        self.cache = RadixCache(self.alloc)
        self.reqs = []
        self.model = {}  # (extra_key, cached prefix) -> slots of its last page
        self.hits = self.queries = 0

    def check_match(self, keys, extra, r):
        assert r.length % self.ps == 0 and len(r.slots) == r.length <= len(keys)
        for end in range(self.ps, r.length + 1, self.ps):
            assert self.model[(extra, tuple(keys[:end]))] == tuple(r.slots[end - self.ps:end])

    @rule(keys=keys_st, extra=extra_st)
    def lookup(self, keys, extra):
        r = self.cache.match_prefix(keys, extra)
        self.hits += r.length
        self.queries += len(keys)
        self.check_match(keys, extra, r)

    @rule(keys=keys_st, extra=extra_st, spare=st.integers(0, 3))
    def start(self, keys, extra, spare):
        r = self.cache.match_prefix(keys, extra)
        self.hits += r.length
        self.queries += len(keys)
        self.check_match(keys, extra, r)
        self.cache.lock(r.node)
        need = len(keys) - r.length + spare
        if not self.cache.ensure_free(need):
            self.cache.unlock(r.node)
            return
        own = self.alloc.alloc(need)
        self.reqs.append(dict(keys=keys, extra=extra, m=r.length, node=r.node,
                              slots=r.slots + own, own=own))

    @rule(keys=keys_st, extra=extra_st)
    def serve(self, keys, extra):  # the common case: a whole request, then cache its rows
        self.start(keys, extra, 0)
        if self.reqs and self.reqs[-1]["keys"] is keys:
            self.finish(len(self.reqs) - 1, True)

    @precondition(lambda self: self.reqs)
    @rule(i=st.integers(0, 100), do_insert=st.booleans())
    def finish(self, i, do_insert):
        q = self.reqs.pop(i % len(self.reqs))
        keys, slots, m, extra = q["keys"], q["slots"], q["m"], q["extra"]
        if do_insert:
            n = len(keys) - len(keys) % self.ps
            p = self.cache.insert(keys, slots, extra)
            assert m <= p <= n  # our locked prefix is still there
            for end in range(p + self.ps, n + 1, self.ps):
                self.model[(extra, tuple(keys[:end]))] = tuple(slots[end - self.ps:end])
            self.alloc.free(slots[m:p] + slots[n:])  # duplicates + partial page / spare tail
            r = self.cache.match_prefix(keys, extra, record_stats=False)
            assert r.length == n and r.slots[:m] == slots[:m] and r.slots[p:] == slots[p:n]
            self.check_match(keys, extra, r)
        else:
            self.alloc.free(q["own"])
        self.cache.unlock(q["node"])

    @rule(n=st.integers(0, 20))
    def evict(self, n):
        before = self.cache.evictable_slots
        freed = self.cache.evict(n)
        assert freed >= min(n, before) and self.cache.evictable_slots == before - freed

    @precondition(lambda self: not self.reqs)
    @rule(go=st.integers(0, 4))
    def reset(self, go):
        if go:  # keep resets rare, or the tree never grows
            return
        self.cache.reset()
        self.model.clear()
        self.hits = self.queries = 0
        assert self.alloc.used_slots == 0

    @invariant()
    def one_owner_per_slot(self):
        if not hasattr(self, "cache"):
            return
        cached = self.cache.owned_slots()
        private = [s for q in self.reqs for s in q["own"]]
        everything = cached + private
        assert len(set(everything)) == len(everything)  # disjoint, no duplicates
        assert self.alloc.used_slots == len(everything)
        assert self.alloc.free_slots + len(everything) == self.alloc.num_slots
        assert self.alloc.is_allocated(everything).all()
        cached_set = set(cached)
        for q in self.reqs:  # locked rows are never evicted
            assert cached_set.issuperset(q["slots"][:q["m"]])

    @invariant()
    def counters_and_locks(self):
        if not hasattr(self, "cache"):
            return
        c = self.cache
        expected = {}
        for q in self.reqs:
            node = q["node"]
            while not node.is_root:
                expected[id(node)] = expected.get(id(node), 0) + 1
                node = node.parent
        locked = 0
        for node in c.iter_nodes():
            assert len(node.keys) == len(node.slots) > 0 and len(node.keys) % self.ps == 0
            assert node.parent.children[c._child_key(node.keys, 0)] is node
            assert node.lock_ref == expected.get(id(node), 0)
            locked += len(node.slots) if node.lock_ref else 0
        assert c.cached_slots == len(c.owned_slots())
        assert (c.locked_slots, c.evictable_slots) == (locked, c.cached_slots - locked)
        assert (c.hit_rows, c.queried_rows) == (self.hits, self.queries)


CacheMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
test_cache_interleavings = CacheMachine.TestCase
