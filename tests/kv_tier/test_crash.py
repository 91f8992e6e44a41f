"""kill -9 while the tier is being written, then a restart on the same folder: blocks that made it
whole are served, torn ones (and, to be sure some are, every other slot damaged on purpose) fail
their checksum and are recomputed: greedy tokens equal those of an engine without a tier."""

import os
import random
import signal
import subprocess
import sys
import time

from octavo.kv_tier.disk import DATA_FILE, HEADER_BYTES
from octavo.sampling.params import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
ENGINE = dict(num_kv_blocks=24, max_num_batched_tokens=64, dtype="float32", activation_dtype="float32",
              kv_cache_dtype="float32")  # the exact path, as make_llm

WRITER = r"""
import random, sys
from octavo import LLM, SamplingParams
llm = LLM(kv_offload_size=256 << 20, kv_offload_path=sys.argv[1], **eval(sys.argv[2]))
rng = random.Random(0)
print("ready", flush=True)
while True:  # 100-token prompts in a pool of 24 blocks: every request evicts, so the tier is written all along
    prompt = [rng.randrange(1000, 30000) for _ in range(100)]
    llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)
"""


def prompts(n: int) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(1000, 30000) for _ in range(100)] for _ in range(n)]


def test_a_tier_killed_mid_write_serves_no_wrong_token_after_a_restart(tmp_path, make_llm):
    env = dict(os.environ, OMP_NUM_THREADS="1", OCTAVO_ADAPTIVE_THREADS="0")
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path), repr(ENGINE)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)
    data = tmp_path / DATA_FILE
    deadline = time.monotonic() + 600  # model load and ~60 requests; 3x the usual on a busy machine
    try:
        while not (data.exists() and data.stat().st_size > 60 * 4 * 4096 * 45):  # > ~60 blocks written
            assert proc.poll() is None, f"the writer died: {proc.stderr.read()[-2000:]}"
            assert time.monotonic() < deadline, "waited 600 s for the writer to fill its KV tier"
            time.sleep(0.2)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
    stride = -(-(HEADER_BYTES + 737280) // 4096) * 4096  # SmolLM2's float32 block
    with open(data, "r+b") as f:  # damage the bytes of every other slot, as a torn write would
        for slot in range(0, os.fstat(f.fileno()).st_size // stride, 2):
            f.seek(slot * stride + HEADER_BYTES + 1000)
            f.write(b"\x7f" * 16)

    from octavo import LLM

    asked = prompts(24)
    with LLM(kv_offload_size=256 << 20, kv_offload_path=str(tmp_path), **ENGINE) as restarted:
        got = [restarted.generate([p], GREEDY, use_tqdm=False)[0].outputs[0].token_ids for p in asked]
        stats = restarted.engine.get_stats().scheduler
    want = [o.outputs[0].token_ids for o in make_llm(num_kv_blocks=64).generate(asked, GREEDY, use_tqdm=False)]
    assert got == want
    assert stats.tier.num_loaded > 0, stats  # whole blocks from before the kill were served...
    assert stats.tier.num_corrupt > 0, stats  # ...and damaged ones refused
