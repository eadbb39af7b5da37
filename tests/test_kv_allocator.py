import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from scheduler_svc.kv_allocator import KVExhausted, KVFreeError, KVSlotAllocator


def test_page_size_1_behaves_like_a_slot_stack():
    a = KVSlotAllocator(8)
    assert (a.num_slots, a.num_pages, a.free_slots, a.used_slots) == (8, 8, 8, 0)
    assert a.alloc(3) == [0, 1, 2]
    assert (a.free_slots, a.used_slots, a.used_pages) == (5, 3, 3)
    a.free([1])
    assert a.alloc(2) == [1, 3]  # most recently freed first, then low slots
    assert a.alloc(0) == []
    with pytest.raises(KVExhausted):
        a.alloc(5)
    assert a.free_slots == 4  # a failed alloc takes nothing


def test_double_and_foreign_free_rejected_atomically():
    a = KVSlotAllocator(8)
    s = a.alloc(4)
    a.free(s[:2])
    for bad in ([s[0]], [s[2], s[2]], [-1], [8], [7], [s[2], s[0]]):
        with pytest.raises(ValueError):  # KVFreeError is a ValueError, as before
            a.free(bad)
    assert a.used_slots == 2  # the bad calls freed nothing, not even their valid part
    a.free(np.array(s[2:]))
    assert a.used_slots == 0


def test_pages():
    a = KVSlotAllocator(18, page_size=4)  # the trailing 2 slots are not a page
    assert (a.num_slots, a.num_pages, a.free_pages) == (16, 4, 4)
    s = a.alloc(5)
    assert s == list(range(8))  # two whole pages, in order
    assert (a.used_pages, a.used_slots, a.free_slots) == (2, 8, 8)
    assert a.can_alloc(8) and not a.can_alloc(9)
    with pytest.raises(KVFreeError, match="whole number"):
        a.free(s[:3])
    with pytest.raises(KVFreeError, match="whole pages"):
        a.free(s[1:5])
    with pytest.raises(KVFreeError, match="whole pages"):
        a.free([3, 2, 1, 0])
    a.free(s[4:])
    with pytest.raises(KVFreeError, match="freed twice"):
        a.free(s[4:])
    assert a.alloc(1) == [4, 5, 6, 7]
    assert a.is_allocated([0, 4, 8, 99, -1]).tolist() == [True, True, False, False, False]


@settings(max_examples=60, deadline=None)
@given(page_size=st.sampled_from([1, 2, 4]), num_pages=st.integers(0, 12),
       ops=st.lists(st.tuples(st.booleans(), st.integers(0, 20)), max_size=40))
def test_random_alloc_free_never_leaks(page_size, num_pages, ops):
    a = KVSlotAllocator(num_pages * page_size, page_size)
    held: list[list[int]] = []
    for is_alloc, n in ops:
        if is_alloc:
            try:
                s = a.alloc(n)
            except KVExhausted:
                assert a.pages_for(n) > a.free_pages
                continue
            assert len(s) == a.pages_for(n) * page_size
            assert all(x % page_size == i % page_size for i, x in enumerate(s))
            held.append(s)
        elif held:
            s = held.pop(n % len(held))
            a.free(s)
            if s:
                with pytest.raises(KVFreeError):
                    a.free(s)
        owned = [x for s in held for x in s]
        assert len(set(owned)) == len(owned)
        assert a.used_slots == len(owned) and a.free_slots + a.used_slots == a.num_slots
        assert a.is_allocated(owned).all()
