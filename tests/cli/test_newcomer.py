"""A newcomer's first commands (issue 60): --version, a mistyped model or a busy port refused at
once (before torch is imported), --chat-template read and checked at start, the Ray Serve import
string the docs show, make run's PORT and ARGS."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def run_cli(*args: str) -> subprocess.CompletedProcess:
    """`octavo ARGS` in a fresh interpreter; prints whether torch was imported on the way."""
    code = ("import sys\nfrom octavo.cli import main\ntry:\n    rc = main(sys.argv[1:])\nexcept SystemExit as e:\n"
            "    rc = e.code\nprint('TORCH', 'torch' in sys.modules)\nsys.exit(rc)")
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=120, cwd=ROOT)


def test_version():
    import octavo

    out = run_cli("--version")
    assert out.returncode == 0 and out.stdout.startswith(f"octavo {octavo.__version__}"), out


def test_an_unknown_model_is_refused_before_torch_is_imported():
    out = run_cli("serve", "SmolLM2-135M-Instruct-typo")
    assert out.returncode == 2 and "is not a local directory, .gguf file or packaged model" in out.stderr, out
    assert "TORCH False" in out.stdout


def test_a_busy_port_is_refused_before_the_model_loads():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        out = run_cli("serve", "--port", str(busy.getsockname()[1]))
    assert out.returncode == 2 and "cannot listen on 127.0.0.1" in out.stderr, out
    assert "TORCH False" in out.stdout


def test_chat_template_flag(tmp_path):
    from octavo.chat_template.sandbox import chat_template_source
    from octavo.engine_args import EngineArgs

    source = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
    path = tmp_path / "chat.jinja"
    path.write_text(source)
    assert chat_template_source(str(path)) == source == chat_template_source(source)
    with pytest.raises(ValueError, match="does not compile"):
        EngineArgs(chat_template="{% for m in messages %}")
    with pytest.raises(ValueError, match="cannot read"):
        EngineArgs(chat_template=str(tmp_path / "missing.jinja"))


def test_ray_serve_import_string_resolves_as_documented():
    pytest.importorskip("ray", reason="ray[serve] is not installed (pip install 'octavo[ray]')")
    from ray._common.utils import import_attr

    from octavo.ray_serve.app import build_app

    assert import_attr("octavo.ray_serve:build_app") is build_app


def test_make_run_takes_port_and_args():
    out = subprocess.run(["make", "-n", "run", "PORT=8123", "ARGS=--api-key k"], capture_output=True, text=True,
                         cwd=ROOT, timeout=60)
    assert out.returncode == 0 and "octavo serve --port 8123 --api-key k" in out.stdout, out
