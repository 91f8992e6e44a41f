"""What a prefix-cache miss costs against reading the same KV back from the second tier's disk.

    .venv/bin/python tools/tier_cost.py [--tokens 512 2048]

For each prompt length: the prefill time of a fresh random prompt on the embedded model (pool
cleared first), and for its full blocks' KV bytes: a write + fsync, a cold read (page cache
dropped for the file with posix_fadvise), a warm read and a crc32 over them. One process, side by
side; medians of --repeats.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import tempfile
import time
import zlib

from octavo import LLM, SamplingParams


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def disk_costs(num_bytes: int, folder: str) -> dict[str, float]:
    data = os.urandom(num_bytes)
    fd = os.open(os.path.join(folder, "blocks.bin"), os.O_RDWR | os.O_CREAT | os.O_TRUNC)
    try:
        out = {"write+fsync": timed(lambda: (os.pwrite(fd, data, 0), os.fsync(fd)))}
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        out["cold read"] = timed(lambda: os.pread(fd, num_bytes, 0))
        out["warm read"] = timed(lambda: os.pread(fd, num_bytes, 0))
        out["crc32"] = timed(lambda: zlib.crc32(data))
    finally:
        os.close(fd)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[512, 2048])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    llm = LLM(kv_cache_memory=512 << 20)
    cfg = llm.engine.config
    block_bytes = cfg.model_config.kv_bytes_per_block(cfg.cache.block_size, cfg.cache.cache_dtype)
    rng = random.Random(0)
    with tempfile.TemporaryDirectory() as folder:
        for n in args.tokens:
            prefill, disk = [], []
            for _ in range(args.repeats):
                prompt = [rng.randrange(1000, 30000) for _ in range(n)]
                llm.reset_prefix_cache()
                prefill.append(timed(lambda: llm.generate([prompt], SamplingParams(max_tokens=1), use_tqdm=False)))
                disk.append(disk_costs((n // cfg.cache.block_size) * block_bytes, folder))
            nbytes = (n // cfg.cache.block_size) * block_bytes
            line = f"{n} tokens: prefill {statistics.median(prefill) * 1e3:.0f} ms; KV {nbytes / 2**20:.1f} MiB"
            for key in disk[0]:
                line += f"; {key} {statistics.median(d[key] for d in disk) * 1e3:.1f} ms"
            print(line, flush=True)


if __name__ == "__main__":
    main()
