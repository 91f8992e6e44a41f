"""The second tier in host memory: blocks written into slots come back as written; a slot that
holds another key (or nothing) fails its read, as a bad checksum does on disk."""

import pytest

from octavo.kv_tier import HostTier

KEY_A, KEY_B = (0, b"a" * 32), (1, b"b" * 32)


def test_blocks_come_back_as_written_and_a_slot_holding_another_key_fails_its_read():
    tier = HostTier(slot_bytes=16, num_slots=4)
    tier.submit_writes([2, 0], [KEY_A, KEY_B], [memoryview(bytes(range(16))), memoryview(b"x" * 16)])
    assert sorted(tier.take_finished_writes()) == [(0, True), (2, True)] and tier.take_finished_writes() == []
    out = [bytearray(16) for _ in range(3)]
    ok = tier.submit_reads([2, 0, 1], [KEY_A, KEY_A, KEY_A], [memoryview(b) for b in out]).result()
    assert ok == [True, False, False]  # slot 0 holds KEY_B, slot 1 nothing
    assert out[0] == bytes(range(16)) and out[1] == bytearray(16)
    tier.submit_writes([2], [KEY_B], [memoryview(b"y" * 16)])  # the slot reused for another block
    assert tier.submit_reads([2], [KEY_A], [memoryview(out[0])]).result() == [False]
    assert tier.recover() == [] and tier.measure_round_trip() > 0


def test_it_uses_the_buffer_it_is_given_and_refuses_a_short_one_or_work_after_close():
    buffer = bytearray(64)
    tier = HostTier(slot_bytes=16, num_slots=4, buffer=buffer)
    tier.submit_writes([3], [KEY_A], [memoryview(b"z" * 16)])
    assert buffer[48:] == b"z" * 16
    with pytest.raises(ValueError, match="buffer holds 32 B"):
        HostTier(slot_bytes=16, num_slots=4, buffer=bytearray(32))
    with pytest.raises(IndexError):
        tier.submit_writes([4], [KEY_A], [memoryview(b"z" * 16)])
    tier.close()
    with pytest.raises(RuntimeError, match="closed"):
        tier.submit_reads([3], [KEY_A], [memoryview(bytearray(16))])
