"""`octavo generate`: the main job runs end to end on the embedded model; bad input exits 2 clearly."""

import json
import os
import subprocess
import sys

from octavo.cli import DEFAULT_CHATS


def run(*args):
    env = {**os.environ, "OMP_NUM_THREADS": "2"}
    return subprocess.run([sys.executable, "-m", "octavo.cli", *args], capture_output=True, text=True, env=env, timeout=300)


def test_generate_answers_chat_prompts_as_json():
    # The default path (int8 activations on an AVX2 CPU) asked the demo's own question: the embedded
    # Q4_1 model's greedy answer leads its runner-up by >= 1.4 nats at each of its first six tokens
    # on both paths. The bare "What is the capital of France?" is a 0.08-nat tie at the first token
    # ('The' vs 'L'), which int8's rounding tips to "L'Etoile, ..." on an AVX-512 machine.
    out = run("generate", "--prompt", DEFAULT_CHATS[0], "--max-tokens", "12", "--json",
              "--kv-cache-memory", str(64 << 20))
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    (answer,) = result["answers"]
    assert "Paris" in answer["text"] and answer["finish_reason"] in ("stop", "length")
    assert 0 < result["output_tokens"] <= 12
    assert "KV cache:" in out.stderr and "max concurrency at max_model_len" in out.stderr


def test_missing_model_is_a_clear_error():
    out = run("generate", "/no/such/model")
    assert out.returncode == 2
    assert "is not a local directory, .gguf file or packaged model" in out.stderr and "Traceback" not in out.stderr
