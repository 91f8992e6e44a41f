"""`octavo serve` as a user starts it, with no --activation-dtype: the start-up log says which
activations auto chose and why (kernels/activation_rule.py on this CPU and file), the weights line
names the kernel that runs, and the greedy text is that of an offline engine given the chosen flag
explicitly (the default is one of the two tested paths, not a third)."""

from __future__ import annotations

import re

import openai

from octavo.cpu_features import cpu_flags
from octavo.kernels import cpu
from octavo.kernels.activation_rule import activation_rule
from octavo.models.loader import quantized_file_bytes
from octavo.sampling.params import SamplingParams
from tests.live_server import MODEL, start_server, stop_server

PROMPT = "The three primary colours are"


def test_the_default_serves_the_path_its_start_up_line_names(tmp_path, smol_dir, make_llm):
    expected = activation_rule(quantized_file_bytes(smol_dir, "auto"), cpu_flags())[0] if cpu.load() is not None else "float32"
    server = start_server(tmp_path / "serve.log", ["--kv-cache-memory", str(64 << 20), "--max-model-len", "512"],
                          exact=False)
    try:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)
        text = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0).choices[0].text
        log = server.log_text()
    finally:
        stop_server(server)
    chosen = re.search(r"activation dtype auto: (\w+) \((.+)\)", log)
    assert chosen, f"no 'activation dtype auto' line in the start-up log:\n{log[-3000:]}"
    assert chosen.group(1) == expected
    assert "MB of quantized weights" in chosen.group(2) or expected == "float32"
    weights = next(line for line in log.splitlines() if re.search(r"octavo: weights: \d", line))
    assert ("int8 activations" in weights) == (expected == "int8"), weights
    assert "a decode step reads" in weights
    offline = make_llm(weights="int8" if expected == "int8" else "quantized")
    want = offline.generate(PROMPT, SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)[0].outputs[0].text
    assert text == want
