"""DiskTier: blocks written and read back in runs, every load checked (header, key, crc32), the
fingerprint and lock that guard a folder, and a full disk that fails writes, never requests."""

import os
import subprocess
import sys

import pytest

from octavo.kv_tier.disk import (
    DATA_FILE,
    FINGERPRINT_FILE,
    HEADER_BYTES,
    LOCK_FILE,
    DiskTier,
    TierInUse,
    TierUnavailable,
    pack_header,
    unpack_header,
)

SLOT = 5000  # not a multiple of the page: the stride pads
FP = {"model": "test", "dtype": "float32"}


def key(i, group=0):
    return (group, bytes([i]) * 32)


def block(i):
    return bytes((i * 7 + j) % 251 for j in range(SLOT))


def write(tier, slots, keys, datas):
    tier.submit_writes(slots, keys, [memoryview(bytearray(d)) for d in datas])
    tier.flush()
    return dict(tier.take_finished_writes())


def read(tier, slots, keys):
    bufs = [bytearray(SLOT) for _ in slots]
    ok = tier.submit_reads(slots, keys, [memoryview(b) for b in bufs]).result(timeout=60)
    return ok, [bytes(b) for b in bufs]


def test_header_round_trip_and_a_flipped_byte_is_refused():
    raw = pack_header(key(3, group=2), seq=41, data_crc=1234)
    assert len(raw) == HEADER_BYTES and unpack_header(raw) == (key(3, group=2), 41, 1234)
    bad = bytearray(raw)
    bad[20] ^= 1
    assert unpack_header(bytes(bad)) is None and unpack_header(bytes(HEADER_BYTES)) is None


@pytest.mark.parametrize("direct", [True, False])
def test_blocks_come_back_whole_and_a_neighbouring_run_is_one_write(tmp_path, direct):
    tier = DiskTier(tmp_path, SLOT, 8, FP, direct=direct)
    if not direct:
        assert tier.is_direct is False
    assert tier.stride == 8192
    done = write(tier, [3, 2, 4, 7], [key(i) for i in (3, 2, 4, 7)], [block(i) for i in (3, 2, 4, 7)])
    assert done == {3: True, 2: True, 4: True, 7: True}
    assert tier.num_bytes_written == 4 * tier.stride
    ok, got = read(tier, [4, 7, 2], [key(4), key(7), key(2)])
    assert ok == [True, True, True] and got == [block(4), block(7), block(2)]
    ok, _ = read(tier, [4, 5], [key(9), key(5)])  # another key in slot 4; slot 5 never written
    assert ok == [False, False]
    tier.close()


def test_a_corrupted_block_or_header_fails_its_load_and_a_restart_finds_only_sound_headers(tmp_path):
    tier = DiskTier(tmp_path, SLOT, 4, FP)
    write(tier, [0, 1, 2], [key(0), key(1), key(2)], [block(0), block(1), block(2)])
    tier.close()
    with open(tmp_path / DATA_FILE, "r+b") as f:  # a torn block in slot 1, a torn header in slot 2
        f.seek(tier.stride + HEADER_BYTES + 100)
        f.write(b"\xff" * 10)
        f.seek(2 * tier.stride + 9)
        f.write(b"\x00")
    again = DiskTier(tmp_path, SLOT, 4, FP)
    assert again.recover() == [(key(0), 0), (key(1), 1)]  # oldest first; slot 2's header is gone
    ok, got = read(again, [0, 1], [key(0), key(1)])
    assert ok == [True, False] and got[0] == block(0)
    again.close()


def test_another_fingerprint_wipes_the_folder_and_says_so(tmp_path, caplog):
    tier = DiskTier(tmp_path, SLOT, 4, FP)
    write(tier, [0], [key(0)], [block(0)])
    tier.close()
    other = DiskTier(tmp_path, SLOT, 4, dict(FP, dtype="bfloat16"))
    assert other.recover() == []
    assert "written by another model or setting (differs in: dtype)" in caplog.text
    other.close()
    same = DiskTier(tmp_path, SLOT, 4, dict(FP, dtype="bfloat16"))
    assert same.recover() == []  # wiped, not hidden
    same.close()


def test_a_folder_in_use_by_another_process_is_refused_and_an_unwritable_one_too(tmp_path):
    tier = DiskTier(tmp_path, SLOT, 4, FP)
    with pytest.raises(TierInUse, match="in use by another engine in this process") as held:
        DiskTier(tmp_path, SLOT, 4, FP)
    assert held.value.holder == os.getpid()
    tier.close()
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    with pytest.raises(TierUnavailable, match="cannot use"):
        DiskTier(blocker / "tier", SLOT, 4, FP)


FULL_DISK = r"""
import logging, resource, signal, sys
logging.basicConfig()
from octavo.kv_tier.disk import DiskTier
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
tier = DiskTier(sys.argv[1], 5000, 64, {"model": "test"})
resource.setrlimit(resource.RLIMIT_FSIZE, (3 * 8192, 3 * 8192))  # the disk is full after 3 slots
tier.submit_writes(list(range(6)), [(0, bytes([i]) * 32) for i in range(6)], [memoryview(bytearray(5000)) for _ in range(6)])
tier.flush()
print(sorted(tier.take_finished_writes()))
tier.close()
"""


def test_a_full_disk_fails_writes_with_a_warning_not_an_exception(tmp_path):
    out = subprocess.run([sys.executable, "-c", FULL_DISK, str(tmp_path)], capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert out.returncode == 0, out.stderr
    # one run of six slots, cut short after three: those three are whole and kept
    assert out.stdout.strip() == str([(i, i < 3) for i in range(6)])
    assert "a write failed" in out.stderr


def test_writes_queued_past_the_bound_wait_for_the_writer_and_all_land(tmp_path):
    tier = DiskTier(tmp_path, SLOT, 64, FP, max_queued_bytes=2 * SLOT)
    for i in range(12):  # one block at a time, two may queue: the caller waits for the rest
        tier.submit_writes([i], [key(i)], [memoryview(bytearray(block(i)))])
    tier.flush()
    assert sorted(tier.take_finished_writes()) == [(i, True) for i in range(12)]
    assert tier._queued_bytes == 0
    ok, got = read(tier, list(range(12)), [key(i) for i in range(12)])
    assert all(ok) and got == [block(i) for i in range(12)]
    tier.close()


def test_a_callers_buffer_is_free_to_reuse_once_its_write_is_submitted(tmp_path):
    """The block is laid out (copied, checksummed) on the caller's thread, so the runner's host
    copy can go at once, and the background thread only writes."""
    tier = DiskTier(tmp_path, SLOT, 8, FP)
    source = bytearray(block(1))
    tier.submit_writes([0], [key(1)], [memoryview(source)])
    source[:] = block(2)  # reused before the write has landed
    tier.flush()
    assert tier.take_finished_writes() == [(0, True)]
    ok, got = read(tier, [0], [key(1)])
    assert ok == [True] and got == [block(1)]
    tier.close()


# the tier's files, and the fixed names it once wrote through (its fingerprint's temporary file and
# its start-up probe: a link planted as either had its target truncated and overwritten)
@pytest.mark.parametrize("name", [LOCK_FILE, FINGERPRINT_FILE, DATA_FILE, "fingerprint.tmp", "probe.bin"])
def test_links_planted_under_the_tiers_names_are_never_followed(tmp_path, name):
    """A shared folder where someone planted links to a file of ours under the tier's names: the
    tier refuses the folder, replaces the link or leaves it be; the target is untouched."""
    folder, precious = tmp_path / "tier", tmp_path / "precious.txt"
    folder.mkdir(mode=0o700)
    precious.write_text("keep me")
    (folder / name).symlink_to(precious)
    try:
        tier = DiskTier(folder, SLOT, 4, FP)
    except TierUnavailable as exc:
        assert "symbolic link" in str(exc) or "Too many levels" in str(exc)
    else:
        write(tier, [0], [key(0)], [block(0)])
        tier.measure_round_trip()
        tier.close()
        if name == FINGERPRINT_FILE:
            assert not (folder / name).is_symlink()  # replaced by the real fingerprint
    assert precious.read_text() == "keep me"


def test_a_folder_every_user_may_write_or_another_users_is_refused(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    with pytest.raises(TierUnavailable, match="every user may write to it"):
        DiskTier(shared, SLOT, 4, FP)
    if os.geteuid() != 0:
        pytest.skip("giving a folder to another user needs root")
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o700)
    os.chown(theirs, 65534, 65534)
    with pytest.raises(TierUnavailable, match="belongs to user 65534"):
        DiskTier(theirs, SLOT, 4, FP)
