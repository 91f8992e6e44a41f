"""TierIndex: slots, LRU eviction, pins, failed writes shrinking the tier, restore after a restart."""

import pytest

from octavo.kv_cache.tier import TierIndex


def key(i: int, group: int = 0):
    return (group, i.to_bytes(32, "little"))


def test_a_reserved_entry_is_found_only_once_its_write_is_committed():
    index = TierIndex(4)
    slot = index.reserve(key(1))
    assert slot == 0 and key(1) in index and index.lookup(key(1)) is None
    assert index.reserve(key(1)) is None  # held already: not offered twice
    index.commit(slot, ok=True)
    assert index.lookup(key(1)) == 0 and index.stats.num_stored == 1
    with pytest.raises(ValueError, match="no write in flight"):
        index.commit(slot, ok=True)


def test_batches_get_neighbouring_slots_and_the_least_recently_used_ready_entry_goes_first():
    index = TierIndex(3)
    slots = [index.reserve(key(i)) for i in range(3)]
    assert slots == [0, 1, 2]
    for s in slots:
        index.commit(s, ok=True)
    index.touch(key(0))  # 1 is now the least recently used
    assert index.reserve(key(9)) == 1
    assert index.lookup(key(1)) is None and index.lookup(key(0)) == 0 and index.stats.num_evicted == 1
    assert not index.check_invariants()


def test_entries_being_written_or_read_are_never_evicted():
    index = TierIndex(2)
    a, b = index.reserve(key(1)), index.reserve(key(2))
    index.commit(a, ok=True)
    index.pin(key(1))  # a load reads it; b is still being written
    assert index.reserve(key(3)) is None and index.stats.num_skipped == 1
    index.unpin(key(1), ok=True)
    assert index.reserve(key(3)) == a  # now it may go
    index.commit(b, ok=True)


def test_a_corrupt_load_drops_the_entry_for_good():
    index = TierIndex(2)
    index.commit(index.reserve(key(1)), ok=True)
    index.pin(key(1))
    index.unpin(key(1), ok=False)
    assert key(1) not in index and index.stats.num_corrupt == 1
    assert index.reserve(key(2)) == 0  # its slot is free again


def test_a_failed_write_shrinks_the_tier_to_what_it_holds_and_only_reuses_written_slots():
    index = TierIndex(8)
    for i in range(3):
        index.commit(index.reserve(key(i)), ok=True)
    index.commit(index.reserve(key(3)), ok=False)  # the disk is full
    assert index.num_slots == 3 and key(3) not in index and index.stats.num_store_failed == 1
    slot = index.reserve(key(4))  # evicts the oldest, reuses its slot: no new space needed
    assert slot == 0 and len(index) == 3
    assert not index.check_invariants()


def test_restore_enters_what_a_previous_run_left_oldest_first_and_skips_what_does_not_fit():
    index = TierIndex(3)
    taken = index.restore([(key(1), 2), (key(2), 0), (key(3), 7), (key(4), 0)])
    assert taken == 2  # slot 7 is past the capacity; slot 0 twice
    assert index.lookup(key(1)) == 2 and index.lookup(key(2)) == 0
    assert index.reserve(key(5)) == 1  # the one free slot
    index.commit(1, ok=True)
    assert index.reserve(key(6)) == 2  # then key(1), the oldest, goes first
    assert not index.check_invariants()


def test_clear_forgets_ready_unpinned_entries():
    index = TierIndex(3)
    for i in range(2):
        index.commit(index.reserve(key(i)), ok=True)
    index.pin(key(0))
    assert index.clear() == 1 and key(0) in index and key(1) not in index
