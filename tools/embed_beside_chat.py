"""Chats' TPOT with embedding requests beside them, on one `octavo serve`: 16 streamed greedy
completions (ignore_eos, so each run does the same work) alone, then the same 16 while 64
embedding requests are kept in flight; alternated `--rounds` times, medians compared.

    OMP_NUM_THREADS=2 .venv/bin/python tools/embed_beside_chat.py [--url URL] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from octavo.bench.serve import _one  # noqa: E402
from octavo.simulator.workload import SimRequest  # noqa: E402
from tests.live_server import start_server, stop_server  # noqa: E402

TEXT = ("The lighthouse keeper climbed the spiral stairs every evening at dusk, counting the steps out of habit. "
        "There were one hundred and twelve of them, worn smooth in the middle by a century of boots. ")


async def chats(client: httpx.AsyncClient, url: str, num: int, output_len: int) -> list[float]:
    """The TPOT (s) of each of `num` concurrent streamed completions."""
    work = [SimRequest(0.0, (), output_len, prompt_text=f"Story {i}: {TEXT}") for i in range(num)]
    records = await asyncio.gather(*(_one(client, f"{url}/v1/completions", None, w, {}) for w in work))
    bad = [r.error for r in records if not r.ok]
    if bad:
        raise SystemExit(f"chat requests failed: {bad[:3]}")
    return [r.tpot for r in records if r.tpot is not None]


async def embeddings_until(client: httpx.AsyncClient, url: str, num: int, done: asyncio.Event, counts: list[int]) -> None:
    async def worker(k: int) -> None:
        i = 0
        while not done.is_set():
            # base64, as the openai SDK asks by default (the float list's JSON is ~5x the bytes)
            r = await client.post(f"{url}/v1/embeddings", json={"input": f"Document {k}-{i}: {TEXT}",
                                                                "encoding_format": "base64"})
            r.raise_for_status()
            counts[0] += 1
            i += 1

    await asyncio.gather(*(worker(k) for k in range(num)))


async def round_pair(url: str, num_chats: int, num_embed: int, output_len: int) -> tuple[float, float, float]:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=httpx.Timeout(None, connect=30.0), limits=limits) as client:
        alone = statistics.median(await chats(client, url, num_chats, output_len))
        done, counts = asyncio.Event(), [0]
        background = asyncio.create_task(embeddings_until(client, url, num_embed, done, counts))
        await asyncio.sleep(0.5)  # the embeddings are in flight before the chats start
        start = time.perf_counter()
        first = counts[0]
        beside = statistics.median(await chats(client, url, num_chats, output_len))
        elapsed, num_done = time.perf_counter() - start, counts[0] - first
        done.set()
        await background
        return alone, beside, num_done / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default=None, help="a running server (default: start `octavo serve` on the embedded model)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--chats", type=int, default=16)
    parser.add_argument("--embeddings", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--serve-flags", default="", help="extra flags for the started server")
    args = parser.parse_args()
    server = None
    url = args.url
    if url is None:
        log = Path(tempfile.mkdtemp()) / "server.log"
        server = start_server(log, ["--max-num-seqs", "96", "--log-interval", "1000", *args.serve_flags.split()])
        url = server.url
    try:
        asyncio.run(round_pair(url, 4, 4, 8))  # warm-up
        rows = [asyncio.run(round_pair(url, args.chats, args.embeddings, args.output_len)) for _ in range(args.rounds)]
    finally:
        if server is not None:
            stop_server(server)
    for k, (alone, beside, rate) in enumerate(rows):
        print(f"round {k}: TPOT alone {alone * 1e3:.1f} ms, beside {args.embeddings} embedding requests "
              f"{beside * 1e3:.1f} ms ({beside / alone:.2f}x); {rate:.1f} embeddings/s finished meanwhile")
    alone = statistics.median(r[0] for r in rows)
    beside = statistics.median(r[1] for r in rows)
    print(f"median: TPOT alone {alone * 1e3:.1f} ms, beside embeddings {beside * 1e3:.1f} ms: {beside / alone:.2f}x "
          f"(target <= 1.30x)")


if __name__ == "__main__":
    main()
