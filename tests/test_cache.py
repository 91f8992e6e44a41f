"""octavo.cache: the lock dies with its holder, a wait has a deadline that names what it waited
for, leftovers of killed builders are removed, files are written whole or not at all."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from octavo.cache import CacheWaitTimeout, atomic_write_text, exclusive, move_into_place, remove_leftovers, temporary_folder

HOLD = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from octavo.cache import exclusive
    with exclusive(Path(sys.argv[1]), "a test entry", 30):
        print("held", flush=True)
        time.sleep(600)
""")


def _hold_in_child(lock: Path) -> subprocess.Popen:
    child = subprocess.Popen([sys.executable, "-c", HOLD, str(lock)], stdout=subprocess.PIPE, text=True,
                             env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert child.stdout.readline().strip() == "held", "the child never took the lock"
    return child


def test_a_killed_holder_releases_the_lock_at_once(tmp_path):
    lock = tmp_path / "entry.lock"
    child = _hold_in_child(lock)
    with pytest.raises(CacheWaitTimeout) as caught:
        with exclusive(lock, "the test entry", timeout_s=0.5):
            pass
    # the message says what was waited for, who holds it and where
    assert "the test entry" in str(caught.value) and str(child.pid) in str(caught.value) and str(lock) in str(caught.value)
    child.send_signal(signal.SIGKILL)
    child.wait()
    start = time.monotonic()
    with exclusive(lock, "the test entry", timeout_s=30):
        waited = time.monotonic() - start
    assert waited < 5, f"the lock of a killed holder was still held {waited:.1f} s later"


def test_the_lock_excludes_within_one_process_too(tmp_path):
    lock = tmp_path / "entry.lock"
    with exclusive(lock, "outer"):
        with pytest.raises(CacheWaitTimeout):
            with exclusive(lock, "inner", timeout_s=0.3):
                pass


def test_leftovers_of_killed_builders_are_removed_and_the_result_moved_in(tmp_path):
    stale = temporary_folder(tmp_path, ".build-x-")
    (stale / "half.o").write_bytes(b"\0" * 10)
    other = tmp_path / "keep-me"
    other.mkdir()
    assert remove_leftovers(tmp_path, ".build-x-") == 1
    assert not stale.exists() and other.is_dir()
    built = temporary_folder(tmp_path, ".build-x-")
    (built / "lib.so").write_text("new")
    final = tmp_path / "x"
    final.mkdir()
    (final / "lib.so").write_text("old, unusable")
    move_into_place(built, final)
    assert (final / "lib.so").read_text() == "new" and not built.exists()
    assert final.stat().st_mode & 0o755 == 0o755


def test_atomic_write_leaves_the_old_text_or_the_new_one(tmp_path):
    path = tmp_path / "record.txt"
    atomic_write_text(path, "first")
    atomic_write_text(path, "second")
    assert path.read_text() == "second"
    assert [p.name for p in tmp_path.iterdir()] == ["record.txt"]  # no temporary file left behind
