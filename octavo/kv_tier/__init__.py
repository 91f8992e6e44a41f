"""The second KV tier's storage: where blocks the pool evicts are kept (files on local disk, or host
memory), and what a restart checks before reading them back. The index of what is where is
octavo.kv_cache.tier."""

from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path

from octavo.config import ModelConfig
from octavo.kv_cache.tier import TierIndex
from octavo.kv_tier.disk import DiskTier, TierInUse, TierUnavailable
from octavo.kv_tier.host import HostTier

logger = logging.getLogger("octavo")

__all__ = ["DiskTier", "HostTier", "TierInUse", "TierStore", "TierUnavailable", "open_disk_tier", "open_host_tier", "tier_fingerprint"]

TierStore = DiskTier | HostTier  # what the runner moves blocks through (the same calls)


def tier_fingerprint(model_path: str | Path, model_config: ModelConfig, dtype: str, block_size: int,
                     quantization: str, attention_backend: str, hash_algo: str = "sha256", kv_dtype: str = "float32",
                     activation_dtype: str = "float32") -> dict:
    """What must match for a tier's blocks to be read again: the weights (their files' names,
    sizes and times: a re-converted model counts as another), the model's shape, the KV dtype and
    block size, the quantization and the kernels that computed the KV; and how blocks are hashed
    (another algorithm's keys would never be looked up; sha256 adds no key, so existing tiers
    keep their folder). The KV cache's dtype and the activations' (int8 activations compute other
    K and V) are keys where they are not float32, for the same reason."""
    path = Path(model_path)
    # gguf_source.txt records where a converted GGUF came from (rewritten when the same content is
    # started from another path): not weights; the directory's name carries the content's key
    files = sorted(p for p in (path.rglob("*") if path.is_dir() else [path])
                   if p.is_file() and p.name != "gguf_source.txt")
    digest = hashlib.sha256()
    for f in files:
        st = f.stat()
        digest.update(f"{f.relative_to(path) if path.is_dir() else f.name}:{st.st_size}:{st.st_mtime_ns}\n".encode())
    return {
        "weights": digest.hexdigest()[:32],
        "model": repr(model_config),
        "dtype": dtype,
        "block_size": block_size,
        "quantization": quantization,
        "attention_backend": attention_backend,
    } | ({} if hash_algo == "sha256" else {"hash_algo": hash_algo}) | (
        {} if kv_dtype == "float32" else {"kv_dtype": kv_dtype}) | (
        {} if activation_dtype == "float32" else {"activation_dtype": activation_dtype})


def open_disk_tier(path: str | Path, num_bytes: int, slot_bytes: int, fingerprint: dict) -> tuple[DiskTier, TierIndex]:
    """The tier under `path` with room for `num_bytes` of blocks, and its index holding what a
    previous run left there. TierUnavailable (TierInUse when another engine holds it) when the
    path cannot be used."""
    probe = DiskTier.stride_for(slot_bytes)
    num_slots = num_bytes // probe
    if num_slots < 1:
        raise ValueError(f"kv_offload_size {num_bytes} B holds no block of {slot_bytes} B (with its header {probe} B)")
    disk = DiskTier(path, slot_bytes, num_slots, fingerprint)
    index = TierIndex(num_slots)
    try:
        num_found = index.restore(disk.recover())
    except OSError as exc:
        disk.close()
        raise TierUnavailable(f"cannot read {path}: {exc.strerror or exc}") from None
    free = _free_bytes(Path(path))
    logger.info("KV tier: %d blocks (%.2f GiB) at %s; %d kept from before%s", num_slots, num_slots * probe / 2**30,
                path, num_found, "" if free is None or free >= num_slots * probe else
                f"; the disk has {free / 2**30:.2f} GiB free: the tier stops growing when it fills")
    return disk, index


def open_host_tier(num_bytes: int, slot_bytes: int, allocate) -> tuple[HostTier, TierIndex]:
    """A tier of `num_bytes` in host memory; `allocate(n)` returns a writable buffer of n bytes
    (pinned memory on CUDA)."""
    num_slots = num_bytes // slot_bytes
    if num_slots < 1:
        raise ValueError(f"kv_offload_size {num_bytes} B holds no block of {slot_bytes} B")
    available = _available_memory()
    if available is not None and num_slots * slot_bytes > available:
        raise ValueError(f"kv_offload_size {num_bytes / 2**30:.2f} GiB in host memory is more than the "
                         f"{available / 2**30:.2f} GiB this machine has available: lower it, or use the disk "
                         "(--kv-offload-medium disk)")
    tier = HostTier(slot_bytes, num_slots, allocate(num_slots * slot_bytes))
    logger.info("KV tier: %d blocks (%.2f GiB) in host memory; it starts empty at every start", num_slots,
                num_slots * slot_bytes / 2**30)
    return tier, TierIndex(num_slots)


def _available_memory() -> int | None:
    """Bytes of host memory available now (Linux's MemAvailable), or None where unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _free_bytes(path: Path) -> int | None:
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize
