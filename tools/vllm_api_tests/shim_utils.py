"""Stands in for vLLM's tests/utils.py in the copied tests: RemoteOpenAIServer starts `octavo serve`
on the embedded model, served under the name the test asks for, with the flags Octavo knows
(the others are dropped and logged); the rest of what the tests import from tests.utils is
answered with neutral values."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import anthropic
import httpx
import openai
import pytest

VLLM_PATH = Path(os.environ.get("VLLM_SDIST", "."))
ROCM_EXTRA_ARGS: list[str] = []
EMBEDDED_MAX_MODEL_LEN = 8192  # SmolLM2-135M-Instruct's max_position_embeddings
DROPPED_FLAGS_LOG = Path(os.environ.get("OCTAVO_SHIM_LOG", "/tmp/vllm-shim-flags.log"))


def _octavo_flags() -> dict[str, bool]:
    """Every `octavo serve` option string -> whether it takes a value."""
    from octavo.cli import build_parser

    parser = build_parser()
    serve = next(a for a in parser._subparsers._group_actions[0].choices.items() if a[0] == "serve")[1]  # noqa: SLF001
    flags = {}
    for action in serve._actions:  # noqa: SLF001
        for option in action.option_strings:
            flags[option] = action.nargs != 0
    return flags


def translate(args: list[str]) -> tuple[list[str], list[str]]:
    """(the flags Octavo takes, the ones dropped). vLLM's `--flag=value` is split; an unknown flag
    drops the value after it too (anything not starting with --)."""
    known = _octavo_flags()
    tokens: list[str] = []
    for a in args:
        parts = a.split("=", 1) if a.startswith("--") and "=" in a else [a]
        if parts[0].startswith("--"):  # vLLM takes --max_model_len as --max-model-len
            parts[0] = parts[0].replace("_", "-")
        tokens.extend(parts)
    kept, dropped, i = [], [], 0
    while i < len(tokens):
        flag = tokens[i]
        takes = known.get(flag)
        values = []
        j = i + 1
        while j < len(tokens) and not tokens[j].startswith("--"):
            values.append(tokens[j])
            j += 1
        if takes is None or flag in ("--port", "--host", "--dtype"):
            dropped.append(" ".join([flag, *values]))
        else:
            kept.extend([flag, *(values if takes else [])])
            if not takes and values:
                dropped.append(" ".join(values))
        i = j
    for k in [k + 1 for k, flag in enumerate(kept) if flag == "--max-model-len"]:
        # the embedded model's context is 8192: a longer one is capped, and logged
        if k < len(kept) and kept[k].isdigit() and int(kept[k]) > EMBEDDED_MAX_MODEL_LEN:
            dropped.append(f"--max-model-len {kept[k]} (capped at {EMBEDDED_MAX_MODEL_LEN})")
            kept[k] = str(EMBEDDED_MAX_MODEL_LEN)
    return kept, dropped


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RemoteOpenAIServer:
    DUMMY_API_KEY = "token-abc123"

    def __init__(self, model: str, vllm_serve_args: list[str], *, env_dict: dict[str, str] | None = None,
                 seed: int = 0, auto_port: bool = True, max_wait_seconds: float | None = None, **_: object) -> None:
        kept, dropped = translate(list(vllm_serve_args))
        with open(DROPPED_FLAGS_LOG, "a") as fh:
            fh.write(f"{os.environ.get('PYTEST_CURRENT_TEST', '?')}: {model}: dropped {dropped}\n")
        self.host, self.port = "127.0.0.1", _free_port()
        env = {**os.environ, **(env_dict or {}), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")}
        names = [] if "--served-model-name" in kept else ["--served-model-name", model]
        # a request that sets no max_tokens may generate up to the context length: on two CPU cores
        # that is minutes a test; CPU time, not behaviour, so chats default to 256 new tokens here
        if "--override-generation-config" not in kept:
            names += ["--override-generation-config", '{"max_new_tokens": 256}']
        cmd = [sys.executable, "-m", "octavo.cli", "serve", "--port", str(self.port), *names,
               "--dtype", "float32", "--kv-cache-memory", str(512 << 20), *kept]
        self.log = Path(os.environ.get("OCTAVO_SHIM_SERVER_LOG", "/tmp/vllm-shim-server.log"))
        with open(self.log, "a") as fh:
            fh.write(f"\n==== {' '.join(cmd)}\n")
            fh.flush()
            self.proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        deadline = time.monotonic() + (max_wait_seconds or 240)
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"octavo serve exited ({self.proc.returncode}); flags {kept}; see {self.log}")
            try:
                if httpx.get(f"{self.url_root}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self._shutdown()
        raise RuntimeError(f"octavo serve did not become healthy in time; see {self.log}")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._shutdown()

    def _shutdown(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)

    @property
    def url_root(self) -> str:
        return f"http://{self.host}:{self.port}"

    def url_for(self, *parts: str) -> str:
        path = "/".join(part.strip("/") for part in parts if part)
        return f"{self.url_root}/{path}"

    def get_client(self, **kwargs):
        kwargs.setdefault("timeout", 600)
        return openai.OpenAI(base_url=self.url_for("v1"), api_key=self.DUMMY_API_KEY, max_retries=0, **kwargs)

    def get_async_client(self, **kwargs):
        kwargs.setdefault("timeout", 600)
        return openai.AsyncOpenAI(base_url=self.url_for("v1"), api_key=self.DUMMY_API_KEY, max_retries=0, **kwargs)

    def get_client_anthropic(self, **kwargs):
        kwargs.setdefault("timeout", 600)
        return anthropic.Anthropic(base_url=self.url_for(), api_key=self.DUMMY_API_KEY, max_retries=0, **kwargs)

    def get_async_client_anthropic(self, **kwargs):
        kwargs.setdefault("timeout", 600)
        return anthropic.AsyncAnthropic(base_url=self.url_for(), api_key=self.DUMMY_API_KEY, max_retries=0, **kwargs)


RemoteOpenAIServerCustom = RemoteOpenAIServer


def _not_here(*args, **kwargs):
    return pytest.mark.skip(reason="needs GPUs or hardware this shim does not model")


multi_gpu_only = requires_fp8 = large_gpu_mark = multi_gpu_marks = gpu_tier_mark = _not_here


def single_gpu_only(f=None):
    return f if f is not None else (lambda g: g)


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)
    from vllm_stub import _Thing

    return _Thing(f"tests.utils.{name}")
