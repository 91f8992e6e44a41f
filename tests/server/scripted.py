"""A fixed-output stub model for server tests of what a small real model will not do on its own
(tool calls for tool_choice "auto"), and an in-process `octavo serve` app on a free port."""

from __future__ import annotations

import contextlib
import threading
import time

import torch

from tests.live_server import free_port


class ScriptedModel(torch.nn.Module):
    """Answers every request with `script` (token ids), then EOS. It learns where the answer starts
    from each fresh prefill (positions starting at 0), so it serves one request at a time."""

    def __init__(self, script: list[int], vocab_size: int, eos: int) -> None:
        super().__init__()
        self.script, self.vocab_size, self.eos = script, vocab_size, eos
        self.start = 0

    def forward(self, input_ids, positions, kv_caches, meta):  # -> [num_tokens, 1]: each token's position
        if positions.numel() > 1 and int(positions[0]) == 0:
            self.start = int(positions[-1]) + 1
        return positions.to(torch.float32)[:, None]

    def compute_logits(self, hidden):  # [rows, 1] -> [rows, vocab]: the script's next token
        logits = torch.full((hidden.shape[0], self.vocab_size), -30.0)
        for row, pos in enumerate(hidden[:, 0].tolist()):
            i = int(pos) + 1 - self.start
            logits[row, self.script[i] if 0 <= i < len(self.script) else self.eos] = 0.0
        return logits


def scripted_engine(smol_dir, tokenizer, text: str):
    from octavo.engine import LLMEngine
    from octavo.engine_args import EngineArgs
    from octavo.models.registry import load_model_config

    model_config = load_model_config(smol_dir)
    script = tokenizer.encode(text, add_special_tokens=False)
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    model = ScriptedModel(script, model_config.vocab_size, eos)
    config = EngineArgs(kv_cache_memory=64 << 20, dtype="float32", enable_prefix_caching=False).to_config(model_config)
    return LLMEngine(config, model, tokenizer, 0)


@contextlib.contextmanager
def serve_in_thread(engine, **limits):
    """An OpenAI server app over `engine`, served by uvicorn on a thread; yields its base URL."""
    import uvicorn

    from octavo.metrics import EngineMetrics
    from octavo.server.app import OpenAIServer, ServerLimits, build_app
    from octavo.server.async_engine import AsyncEngine

    async_engine = AsyncEngine(lambda: engine, EngineMetrics("scripted"), 60.0)
    async_engine.start()  # builds (here: takes) the engine on its thread
    server = OpenAIServer(async_engine, "scripted", None, ServerLimits(**limits))
    port = free_port()
    http = uvicorn.Server(uvicorn.Config(build_app(server), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=http.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not http.started and time.monotonic() < deadline:
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        http.should_exit = True
        thread.join(30)
