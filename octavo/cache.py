"""The cache directory and the safe ways to fill it: a lock that dies with its holder, work done in
a temporary folder and renamed into place, and files written whole or not at all.

Several processes (two servers, a server and `make setup`, two checkouts) may fill the same cache
at once, and any of them may be killed at any point. So a builder takes `exclusive(...)` on the
entry's lock file (flock: the kernel releases it when the holder dies, however it dies), looks
again whether the entry appeared meanwhile, removes what earlier killed builders left, builds in
`temporary_folder(...)` and renames the result into place. A reader never sees half an entry.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

logger = logging.getLogger(__name__)

# How long a process waits for another's build (kernels, a model conversion) before giving up;
# a first compile takes ~25 s on two idle cores, minutes on busy ones. OCTAVO_CACHE_WAIT_TIMEOUT overrides it.
DEFAULT_WAIT_TIMEOUT_S = 900.0
_WAIT_LOG_EVERY_S = 30.0


def cache_dir() -> Path:
    """$OCTAVO_CACHE_DIR, else $XDG_CACHE_HOME/octavo, else ~/.cache/octavo."""
    if os.environ.get("OCTAVO_CACHE_DIR"):
        return Path(os.environ["OCTAVO_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "octavo"


def wait_timeout_s() -> float:
    """Seconds to wait for a lock or a build: $OCTAVO_CACHE_WAIT_TIMEOUT, else 900."""
    text = os.environ.get("OCTAVO_CACHE_WAIT_TIMEOUT")
    if not text:
        return DEFAULT_WAIT_TIMEOUT_S
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"OCTAVO_CACHE_WAIT_TIMEOUT must be a number of seconds, got {text!r}") from None
    if not value > 0:
        raise ValueError(f"OCTAVO_CACHE_WAIT_TIMEOUT must be positive, got {text!r}")
    return value


class CacheWaitTimeout(TimeoutError):
    """Another process held a cache entry's lock for longer than the wait allows."""


@contextlib.contextmanager
def exclusive(lock_path: Path, what: str, timeout_s: float | None = None) -> Iterator[None]:
    """Hold an exclusive flock on `lock_path` (created if needed) for the body. While another
    process holds it, log once (and every 30 s) who holds it and for what, and raise
    CacheWaitTimeout after `timeout_s` (default `wait_timeout_s()`). The lock is released when the
    body ends or the process dies; the file itself stays (removing it would race)."""
    timeout_s = wait_timeout_s() if timeout_s is None else timeout_s
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        start = last_log = time.monotonic()
        logged = False
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                pass
            now = time.monotonic()
            holder = _read_holder(fd)
            if now - start >= timeout_s:
                raise CacheWaitTimeout(
                    f"gave up after {timeout_s:.0f} s waiting for {what}: process {holder} still holds {lock_path} "
                    "(if that process is gone from this machine, the cache is on a file system without flock; "
                    "OCTAVO_CACHE_WAIT_TIMEOUT sets the wait)")
            if not logged or now - last_log >= _WAIT_LOG_EVERY_S:
                logger.info("waiting for %s: process %s holds %s (waited %.0f s of at most %.0f s)",
                            what, holder, lock_path, now - start, timeout_s)
                logged, last_log = True, now
            time.sleep(0.2)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)  # who holds it: for the message above, nothing more
        yield
    finally:
        os.close(fd)  # closing the descriptor releases the flock


def _read_holder(fd: int) -> str:
    try:
        text = os.pread(fd, 32, 0).decode(errors="replace").strip()
    except OSError:
        text = ""
    return text or "(unknown)"


def temporary_folder(parent: Path, prefix: str) -> Path:
    """A new empty folder `parent/prefix*` on the same file system as the entry it will become, so
    that the final rename is atomic. Call `remove_leftovers(parent, prefix)` first, under the lock."""
    parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=prefix, dir=parent))


def remove_leftovers(parent: Path, prefix: str) -> int:
    """Remove what builders killed mid-build left (`parent/prefix*`). Only call this while holding
    the entry's lock: temporary folders are only made under it, so any found then are orphans.
    Returns how many were removed."""
    if not parent.is_dir():
        return 0
    removed = 0
    for path in parent.glob(f"{prefix}*"):
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
        removed += 1
    if removed:
        logger.info("removed %d unfinished build(s) left in %s by a killed process", removed, parent)
    return removed


def move_into_place(built: Path, final: Path) -> None:
    """Rename a finished temporary folder to its entry's path (replacing an unusable older one)."""
    if final.exists():
        shutil.rmtree(final) if final.is_dir() else final.unlink()
    os.chmod(built, 0o755)  # mkdtemp made it private; the entry is as readable as the rest of the cache
    os.rename(built, final)


def atomic_write_text(path: Path, text: str) -> None:
    """Write `path` whole or not at all (a temporary file in the same folder, then os.replace)."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as fh:
            fh.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
