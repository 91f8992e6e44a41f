"""The second KV tier on local disk: one file of fixed-size slots, each a checksummed header and one
pool block's KV, written and read by a background thread in runs of neighbouring slots.

Layout of `DIR/blocks.bin` (slot i at i * stride; stride = header + block bytes, rounded up to
4 KiB so every slot starts on a page):

    | header (64 B) | block bytes (slot_bytes) | pad | header | block bytes | pad | ...
    header = magic "OCTKVT01", block hash (32 B), KV group (u32), write sequence (u64),
             crc32 of the block bytes, crc32 of the header fields before it, zero padding

A batch of stores lands in neighbouring slots (the index hands out the lowest free slots first),
so one write moves a run of many blocks (up to 32 MiB, laid out in a page-aligned buffer, with
O_DIRECT where the filesystem has it): transfers of megabytes, not of one block's pages. The
caller lays the run out (copies and crc32s) on its own thread, between steps; the background
thread only issues the writes and reads: on a 2-core machine a thread computing beside the
forward slows it by more than its own time (the forward's threads wait for each other).

What makes it safe to keep across restarts and crashes:
  * `DIR/fingerprint.json` names the model, dtype, block size, quantization and KV layout that
    wrote it; a tier written under another fingerprint is wiped at start (logged), never read;
  * a header whose own checksum fails is an empty slot at start; a block whose bytes do not match
    the header's checksum (torn by a kill -9 mid-write, or reused after a crash) fails its load,
    which the scheduler then drops and recomputes: never served;
  * `DIR/lock` is held (flock) while a server uses the tier: a second server on the same path runs
    without it rather than interleave writes;
  * a write that fails (a full disk) is reported per slot: the index shrinks, no request fails.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import mmap
import os
import struct
import threading
import time
import zlib
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger("octavo")

MAGIC = b"OCTKVT01"
FORMAT_VERSION = 1
_FIELDS = struct.Struct("<8s32sIQI")  # magic, block hash, group, sequence, data crc32
HEADER_BYTES = 64
PAGE_BYTES = 4096
BOUNCE_BYTES = 32 << 20  # the page-aligned buffer a run of slots goes through (so runs are at most this)
MAX_IMAGES = 8  # such buffers holding runs waiting to be written (with max_queued_bytes, what bounds the queue)
DATA_FILE, FINGERPRINT_FILE, LOCK_FILE = "blocks.bin", "fingerprint.json", "lock"

TierKey = tuple[int, bytes]


class TierUnavailable(RuntimeError):
    """The tier cannot be used (path not writable, a full disk, a folder not this user's, held by
    another engine): the engine runs without it, or refuses to start if asked to
    (`kv_offload_required`)."""


class TierInUse(TierUnavailable):
    """Another engine holds the folder's lock: `holder` is its process id (this process's own
    when a forgotten engine of this program still holds it)."""

    def __init__(self, path: Path, holder: int | None) -> None:
        self.path, self.holder = path, holder
        if holder == os.getpid():
            what = ("another engine in this process (close it first: llm.close(), `with LLM(...) as llm:`, or "
                    "`del llm`)")
        else:
            what = f"another Octavo process ({'pid ' + str(holder) if holder else 'unknown pid'})"
        super().__init__(f"{path} is in use by {what}")


def _reason(exc: OSError, name: str | None = None) -> str:
    if exc.errno == errno.ELOOP and name is not None:
        return f"{name} there is a symbolic link (refused: a tier's files are never opened through links)"
    if exc.errno == errno.ENOSPC:
        return "the disk is full"
    return exc.strerror or str(exc)


def _open_own_folder(path: Path) -> int:
    """A descriptor of the tier's folder (made if missing, private), after checking it is a folder
    this user owns that not every user can write to: in a shared folder another user could
    plant files under the tier's names (links fail O_NOFOLLOW; a file of theirs would receive our
    KV). TierUnavailable otherwise."""
    try:
        path.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except OSError as exc:
        raise TierUnavailable(f"cannot use {path}: {_reason(exc)}") from None
    st = os.fstat(fd)
    problem = None
    if st.st_uid != os.geteuid():
        problem = f"it belongs to user {st.st_uid}, not to this process's user {os.geteuid()}"
    elif st.st_mode & 0o002:
        problem = f"every user may write to it (mode {st.st_mode & 0o777:o}); make it private: chmod o-w"
    if problem is not None:
        os.close(fd)
        raise TierUnavailable(f"cannot use {path}: {problem}")
    return fd


def pack_header(key: TierKey, seq: int, data_crc: int) -> bytes:
    group, block_hash = key
    fields = _FIELDS.pack(MAGIC, block_hash, group, seq, data_crc)
    return (fields + struct.pack("<I", zlib.crc32(fields))).ljust(HEADER_BYTES, b"\0")


def unpack_header(raw: bytes) -> tuple[TierKey, int, int] | None:
    """(key, sequence, data crc32) of a sound header, else None (empty, torn or foreign)."""
    if len(raw) < _FIELDS.size + 4 or raw[:8] != MAGIC:
        return None
    fields = raw[: _FIELDS.size]
    (crc,) = struct.unpack_from("<I", raw, _FIELDS.size)
    if zlib.crc32(fields) != crc:
        return None
    _, block_hash, group, seq, data_crc = _FIELDS.unpack(fields)
    return (group, block_hash), seq, data_crc


@dataclass(slots=True)
class _Job:
    slots: list[int]
    keys: list[TierKey]
    buffers: list[memoryview]  # a read: one block's bytes per slot
    future: Future
    image: mmap.mmap | None = None  # a write: its run of neighbouring slots, laid out as in the file


class DiskTier:
    """Slots of `slot_bytes` in one file under `path`; at most `num_slots` of them."""

    durable = True  # what it holds at shutdown is served again after a restart

    def __init__(self, path: str | Path, slot_bytes: int, num_slots: int, fingerprint: dict,
                 max_queued_bytes: int = 256 << 20, direct: bool = True) -> None:
        """`max_queued_bytes`: host copies of blocks waiting to be written; a caller that would
        queue more waits for the writer (a disk slower than the evictions slows steps rather than
        growing memory). `direct`: read and write with O_DIRECT where the filesystem allows it
        (the page cache neither doubles the tier in memory nor costs the CPU its copies: a fresh
        file's buffered writes took 1.1 s of CPU per 362 MiB here, O_DIRECT 0.016 s)."""
        if slot_bytes < 1 or num_slots < 1:
            raise ValueError(f"a disk tier needs slot_bytes and num_slots >= 1, got {slot_bytes}, {num_slots}")
        self.path = Path(path)
        self.slot_bytes, self.num_slots = slot_bytes, num_slots
        self.stride = self.stride_for(slot_bytes)
        self._bounce = mmap.mmap(-1, max(1, BOUNCE_BYTES // self.stride) * self.stride)  # page-aligned
        self._images: list[mmap.mmap] = []  # free page-aligned buffers for runs being written
        self._num_images = 0
        self._dir_fd = _open_own_folder(self.path)
        try:
            self._lock_fd = os.open(LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600, dir_fd=self._dir_fd)
        except OSError as exc:
            os.close(self._dir_fd)
            raise TierUnavailable(f"cannot use {self.path}: {_reason(exc, LOCK_FILE)}") from None
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = os.pread(self._lock_fd, 32, 0).decode(errors="replace").strip()
            os.close(self._lock_fd)
            os.close(self._dir_fd)
            raise TierInUse(self.path, int(holder) if holder.isdigit() else None) from None
        try:
            os.ftruncate(self._lock_fd, 0)
            os.pwrite(self._lock_fd, f"{os.getpid()}\n".encode(), 0)  # who holds it, for the message above
            self._check_fingerprint(dict(fingerprint, format=FORMAT_VERSION, slot_bytes=slot_bytes))
            self._fd, self.is_direct = self._open_data(direct)
        except OSError as exc:
            os.close(self._lock_fd)
            os.close(self._dir_fd)
            raise TierUnavailable(f"cannot use {self.path}: {_reason(exc)}") from None
        self._seq = 0
        self._writes: deque[_Job] = deque()
        self._reads: deque[_Job] = deque()
        self._done_writes: list[tuple[int, bool]] = []
        self.max_queued_bytes = max(max_queued_bytes, slot_bytes)
        self._queued_bytes = 0
        self.num_write_waits = 0  # times a caller waited for the writer to catch up
        self._cond = threading.Condition()
        self._closed = False
        self._busy = False
        self._warned_full = False
        self.num_bytes_written = self.num_bytes_read = 0
        self._thread = threading.Thread(target=self._serve, name="octavo-kv-tier", daemon=True)
        self._thread.start()

    def _open(self, name: str, flags: int) -> int:
        """A file of the folder, never through a symbolic link (O_NOFOLLOW: a link planted in a
        shared folder under one of the tier's names fails the open instead of redirecting it)."""
        return os.open(name, flags | os.O_NOFOLLOW, 0o600, dir_fd=self._dir_fd)

    def _open_data(self, direct: bool) -> tuple[int, bool]:
        if direct and hasattr(os, "O_DIRECT"):
            try:
                return self._open(DATA_FILE, os.O_RDWR | os.O_CREAT | os.O_DIRECT), True
            except OSError as exc:
                if exc.errno != errno.EINVAL:  # EINVAL: this filesystem has no O_DIRECT (tmpfs)
                    raise
        return self._open(DATA_FILE, os.O_RDWR | os.O_CREAT), False

    @staticmethod
    def stride_for(slot_bytes: int) -> int:
        """Bytes one slot takes in the file: header and block, rounded up to a page."""
        return -(-(HEADER_BYTES + slot_bytes) // PAGE_BYTES) * PAGE_BYTES

    def _check_fingerprint(self, fingerprint: dict) -> None:
        """Wipe the tier when another model or setting wrote it (logged); record ours (written to
        a new file of a random name, then renamed over the old: a planted link is replaced, never
        followed)."""
        try:
            fd = self._open(FINGERPRINT_FILE, os.O_RDONLY)
            with os.fdopen(fd, "rb") as fh:
                found = json.loads(fh.read(1 << 20))
        except (OSError, ValueError):
            found = None
        if found != fingerprint:
            has_data = DATA_FILE in os.listdir(self._dir_fd)
            if found is not None or has_data:
                differ = sorted(k for k in set(fingerprint) | set(found or {}) if (found or {}).get(k) != fingerprint.get(k))
                logger.warning("KV tier at %s was written by another model or setting (differs in: %s): "
                               "its blocks are never read; wiping it", self.path, ", ".join(differ) or "unreadable")
            if has_data:
                os.unlink(DATA_FILE, dir_fd=self._dir_fd)
            tmp = f".{FINGERPRINT_FILE}.{os.getpid()}.{os.urandom(6).hex()}"
            fd = self._open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
            try:
                with os.fdopen(fd, "w") as fh:
                    fh.write(json.dumps(fingerprint, sort_keys=True))
                os.replace(tmp, FINGERPRINT_FILE, src_dir_fd=self._dir_fd, dst_dir_fd=self._dir_fd)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(tmp, dir_fd=self._dir_fd)
                raise

    # ---- start-up ----------------------------------------------------------------------------

    def recover(self) -> list[tuple[TierKey, int]]:
        """(key, slot) of every slot with a sound header, oldest write first. Block bytes are not
        read here: each load checks them."""
        found = []
        size = os.fstat(self._fd).st_size
        fd = self._open(DATA_FILE, os.O_RDONLY)  # buffered: headers are small reads
        try:
            for slot in range(min(self.num_slots, size // self.stride)):
                parsed = unpack_header(os.pread(fd, HEADER_BYTES, slot * self.stride))
                if parsed is not None:
                    key, seq, _ = parsed
                    found.append((seq, slot, key))
        finally:
            os.close(fd)
        found.sort()
        self._seq = found[-1][0] + 1 if found else 0
        return [(key, slot) for _, slot, key in found]

    def measure_round_trip(self, num_blocks: int = 8) -> float:
        """Seconds to move one block out and back: writing `num_blocks` blocks to a scratch file
        in the folder, then reading them back cold (flushed and dropped from the page cache first,
        untimed). What a swap costs per block, measured on this disk at start."""
        data = os.urandom(num_blocks * self.slot_bytes)
        probe = f"probe.{os.getpid()}.{os.urandom(6).hex()}.bin"
        try:
            fd = self._open(probe, os.O_RDWR | os.O_CREAT | os.O_EXCL)
        except OSError as exc:
            raise TierUnavailable(f"cannot use {self.path}: {_reason(exc)}") from None
        try:
            start = time.perf_counter()
            written = os.pwrite(fd, data, 0)
            elapsed = time.perf_counter() - start
            if written < len(data):
                raise OSError(errno.ENOSPC, f"{written} of {len(data)} bytes written")
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            start = time.perf_counter()
            os.pread(fd, len(data), 0)
            elapsed += time.perf_counter() - start
        except OSError as exc:  # a full disk, a read-only or failing one: the tier cannot be used
            raise TierUnavailable(f"cannot use {self.path}: its probe write failed: {_reason(exc)}") from None
        finally:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(probe, dir_fd=self._dir_fd)
        return elapsed / num_blocks

    # ---- the runner's calls ------------------------------------------------------------------

    def submit_writes(self, slots: list[int], keys: list[TierKey], buffers: list[memoryview]) -> None:
        """Write each buffer (one block's bytes; free to reuse when this returns) to its slot: laid
        out here with its header, written by the background thread. Reports come from
        `take_finished_writes`. Waits first while more than max_queued_bytes are queued."""
        if not len(slots) == len(keys) == len(buffers):
            raise ValueError("slots, keys and buffers must be as many")
        for run in self._runs(slots):
            image = self._take_image(len(run) * self.slot_bytes)
            with memoryview(image) as view:
                for j, i in enumerate(run):
                    base = j * self.stride
                    data = view[base + HEADER_BYTES : base + HEADER_BYTES + self.slot_bytes]
                    data[:] = buffers[i]
                    view[base : base + HEADER_BYTES] = pack_header(keys[i], self._seq, zlib.crc32(data))
                    data.release()
                    self._seq += 1
            self._submit(self._writes, [slots[i] for i in run], [keys[i] for i in run], [], image)

    def _take_image(self, num_bytes: int) -> mmap.mmap:
        """A free page-aligned buffer for one run, once the queue has room for `num_bytes`."""
        def room() -> bool:
            under = self._queued_bytes + num_bytes <= self.max_queued_bytes or not self._queued_bytes
            return under and bool(self._images or self._num_images < MAX_IMAGES)

        with self._cond:
            if not room():
                self.num_write_waits += 1
                self._cond.wait_for(room)
            self._queued_bytes += num_bytes
            if self._images:
                return self._images.pop()
            self._num_images += 1
        return mmap.mmap(-1, len(self._bounce))

    def submit_reads(self, slots: list[int], keys: list[TierKey], buffers: list[memoryview]) -> Future:
        """Read each slot into its buffer; the future's result is, per slot, whether the header
        names `key` and the bytes match its checksum (reads go before queued writes)."""
        return self._submit(self._reads, slots, keys, buffers)

    def take_finished_writes(self) -> list[tuple[int, bool]]:
        """(slot, written) of every write finished since the last call."""
        with self._cond:
            done, self._done_writes = self._done_writes, []
        return done

    def flush(self) -> None:
        """Wait until every queued read and write is done."""
        with self._cond:
            self._cond.wait_for(lambda: not self._writes and not self._reads and not self._busy)

    def close(self) -> None:
        """Finish queued work, stop the thread, release the lock."""
        if self._closed:
            return
        self.flush()
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join()
        os.close(self._fd)
        os.close(self._lock_fd)
        os.close(self._dir_fd)
        self._bounce.close()
        for image in self._images:
            image.close()

    def _submit(self, queue: deque, slots, keys, buffers, image: mmap.mmap | None = None) -> Future:
        if image is None and not len(slots) == len(keys) == len(buffers):
            raise ValueError("slots, keys and buffers must be as many")
        future: Future = Future()
        with self._cond:
            if self._closed:
                raise RuntimeError("the KV tier is closed")
            queue.append(_Job(list(slots), list(keys), list(buffers), future, image))
            self._cond.notify_all()
        return future

    # ---- the thread --------------------------------------------------------------------------

    def _serve(self) -> None:
        with contextlib.suppress(OSError, AttributeError):  # Linux: a thread's own nice value
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._reads or self._writes or self._closed)
                if self._closed and not self._reads and not self._writes:
                    return
                job, is_read = (self._reads.popleft(), True) if self._reads else (self._writes.popleft(), False)
                self._busy = True
            try:
                result = self._do_read(job) if is_read else self._do_write(job)
                job.future.set_result(result)
            except BaseException as exc:  # a bug, not an I/O error: fail the job, keep serving
                logger.exception("KV tier %s failed", "read" if is_read else "write")
                result = [False] * len(job.slots)
                job.future.set_exception(exc)
            with self._cond:
                if not is_read:
                    self._done_writes.extend(zip(job.slots, result))
                    self._queued_bytes -= len(job.slots) * self.slot_bytes
                    self._images.append(job.image)
                self._busy = False
                self._cond.notify_all()

    def _runs(self, slots: list[int]) -> list[list[int]]:
        """Positions in `slots` grouped into runs of consecutive slots (in slot order), each run
        at most what the bounce buffer holds."""
        most = len(self._bounce) // self.stride
        order = sorted(range(len(slots)), key=lambda i: slots[i])
        runs: list[list[int]] = []
        for i in order:
            if runs and slots[i] == slots[runs[-1][-1]] + 1 and len(runs[-1]) < most:
                runs[-1].append(i)
            else:
                runs.append([i])
        return runs

    def _do_write(self, job: _Job) -> list[bool]:
        """One run of neighbouring slots, laid out by submit_writes: one write."""
        size = len(job.slots) * self.stride
        try:
            with memoryview(job.image) as view:
                written = os.pwrite(self._fd, view[:size], job.slots[0] * self.stride)
        except OSError as exc:
            self._warn_write("the disk is full" if exc.errno == errno.ENOSPC else (exc.strerror or str(exc)))
            return [False] * len(job.slots)
        self.num_bytes_written += written
        if written < size:
            self._warn_write(f"{written} of {size} bytes written: the disk is full")
        return [i < written // self.stride for i in range(len(job.slots))]  # a short write keeps its whole slots

    def _warn_write(self, what: str) -> None:
        if not self._warned_full:
            self._warned_full = True
            logger.warning("KV tier at %s: a write failed (%s); the tier keeps what it holds and takes no more",
                           self.path, what)

    def _do_read(self, job: _Job) -> list[bool]:
        """Each run: one read into the bounce buffer; a slot whose header names the job's key and
        whose block matches the header's crc32 is copied out to the caller's buffer."""
        ok = [False] * len(job.slots)
        view = memoryview(self._bounce)
        for run in self._runs(job.slots):
            try:
                got = os.preadv(self._fd, [view[: len(run) * self.stride]], job.slots[run[0]] * self.stride)
            except OSError as exc:
                logger.warning("KV tier at %s: a read failed (%s); those blocks are recomputed", self.path, exc)
                continue
            self.num_bytes_read += got
            for j, i in enumerate(run[: got // self.stride]):
                base = j * self.stride
                parsed = unpack_header(bytes(view[base : base + HEADER_BYTES]))
                data = view[base + HEADER_BYTES : base + HEADER_BYTES + self.slot_bytes]
                if parsed is not None and parsed[0] == job.keys[i] and zlib.crc32(data) == parsed[2]:
                    job.buffers[i][:] = data
                    ok[i] = True
        return ok

