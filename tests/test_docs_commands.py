"""Every command and import string README.md, docs/SCALING.md and docs/API.md show is run here,
so a documented path cannot break unseen (`serve run octavo.ray_serve:build_app` failed for users
while the tests imported another path):

- shell lines: `octavo ...` parsed by the real parser (flags, choices and types); `make TARGET`
  dry-run; `curl` sent to a live server; `serve run IMPORT k=v` resolved with Ray's own importer
  and built with its arguments; `torchrun ... -m octavo.cli ...` parsed; a line of any other kind
  fails the test until it is given a handler here;
- Python blocks: compiled, their imports imported, and those that talk to a server run against a
  live one (its URL and key swapped in); the Python API's block run in a subprocess;
- YAML blocks: Ray Serve's `import_path` resolved and built with its `args`; a container's `args`
  parsed as `octavo` flags;
- inline `octavo ...` spans in the prose: parsed too.
"""

from __future__ import annotations

import contextlib
import io
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.live_server import API_KEY

ROOT = Path(__file__).resolve().parents[1]
DOCS = ("README.md", "docs/SCALING.md", "docs/API.md")
DOC_URL = "http://127.0.0.1:8000"


def blocks(doc: str) -> list[tuple[str, str, int]]:
    """(language, body, line) of each fenced block."""
    text = (ROOT / doc).read_text()
    out = []
    for m in re.finditer(r"^```(\w*)\n(.*?)^```", text, re.S | re.M):
        out.append((m.group(1), m.group(2), text[:m.start()].count("\n") + 1))
    return out


def shell_lines(body: str) -> list[str]:
    """The block's commands: continuations joined, comments and blank lines dropped."""
    joined = re.sub(r"\\\n\s*", " ", body)
    lines, pending = [], ""
    for line in joined.splitlines():
        pending = f"{pending}\n{line}" if pending else line
        try:
            words = shlex.split(pending, comments=True)
        except ValueError:  # a quote still open: the command goes on on the next line
            continue
        if words:
            lines.append(pending.strip())
        pending = ""
    assert not pending, f"an unclosed quote in {body[:80]!r}"
    return lines


def all_cases(kind: str) -> list[tuple[str, int, str]]:
    cases = []
    for doc in DOCS:
        for lang, body, line in blocks(doc):
            if lang == kind == "bash":
                cases += [(doc, line, cmd) for cmd in shell_lines(body)]
            elif lang == kind:
                cases.append((doc, line, body))
    return cases


def parse_octavo(argv: list[str]) -> None:
    from octavo.cli import build_parser

    try:
        build_parser().parse_args(argv)
    except SystemExit as exc:  # argparse's error (2), or --help / --version (0)
        assert exc.code == 0, f"`octavo {' '.join(argv)}` does not parse"


def octavo_argv(words: list[str]) -> list[str] | None:
    """The arguments after `octavo` / `.venv/bin/octavo` / `-m octavo.cli`, else None."""
    for i, word in enumerate(words):
        if word in ("octavo", ".venv/bin/octavo") or (word == "octavo.cli" and i and words[i - 1] == "-m"):
            return words[i + 1:]
    return None


def build_ray_app(import_path: str, args: dict) -> None:
    pytest.importorskip("ray", reason="ray[serve] is not installed (pip install 'octavo[ray]')")
    from ray._common.utils import import_attr

    builder = import_attr(import_path)
    assert callable(builder), import_path
    builder({k: v for k, v in args.items()})  # converts and checks every key, binds the deployments


@pytest.mark.parametrize("doc, line, command", all_cases("bash"))
def test_shell_line(doc, line, command, request, tmp_path):
    words = shlex.split(command, comments=True)
    argv = octavo_argv(words)
    if argv is not None:
        parse_octavo(argv)
    elif words[0] == "make":
        out = subprocess.run(["make", "-n", *words[1:]], cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, (doc, line, out.stderr)
    elif words[0] == "curl":
        server = request.getfixturevalue("live_server")
        words = [w.replace(DOC_URL, server.url) for w in words]
        out = subprocess.run([*words, "-sS", "-w", "\n%{http_code}", "-H", f"Authorization: Bearer {API_KEY}"],
                             capture_output=True, text=True, timeout=300)
        assert out.stdout.rstrip().endswith("200"), (doc, line, out.stdout[-2000:], out.stderr)
    elif words[:2] == ["serve", "run"]:
        build_ray_app(words[2], dict(w.split("=", 1) for w in words[3:]))
    elif words[0] == ".venv/bin/pip" and words[1] == "install":
        pinned = [w for w in words[2:] if not w.startswith("-")]
        makefile = (ROOT / "Makefile").read_text()
        assert all(p in makefile for p in pinned), f"{pinned} is not what make setup installs"
    elif words[0] == "echo" and ">" in words:  # a file the next line reads: written here
        target = Path(words[words.index(">") + 1])
        target.write_text(" ".join(words[1:words.index(">")]) + "\n")
    elif words[0].startswith("tools/") and words[0].endswith(".sh"):  # peer comparisons: they build llama.cpp
        script = ROOT / words[0]
        out = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True, timeout=60)
        assert script.is_file() and out.returncode == 0, (doc, line, out.stderr)
    elif words[0].startswith("LLM("):  # Python in a shell block: the expression must compile
        compile(command.split("#")[0], f"{doc}:{line}", "eval")
    else:
        pytest.fail(f"{doc}:{line}: no handler for `{command}`: add one to this test")


PYTHON_CASES = all_cases("python")


@pytest.mark.parametrize("doc, line, body", PYTHON_CASES)
def test_python_block(doc, line, body, request):
    code = compile(body, f"{doc}:{line}", "exec")  # noqa: F841 (a syntax error fails here)
    for module in re.findall(r"^\s*(?:from|import)\s+([\w.]+)", body, re.M):
        if module.startswith("octavo") or module in ("openai", "anthropic", "hashlib"):
            __import__(module)
    if DOC_URL in body:
        server = request.getfixturevalue("live_server")
        source = body.replace(DOC_URL, server.url)
        source = re.sub(r'api_key="[^"]*"', f'api_key="{API_KEY}"', source)
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            exec(compile(source, f"{doc}:{line}", "exec"), {"__name__": "__docs__"})
        assert out.getvalue().strip(), f"{doc}:{line} printed nothing"
    elif "LLM()" in body:
        run = subprocess.run([sys.executable, "-c", body], cwd=ROOT, capture_output=True, text=True, timeout=600,
                             env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})
        assert run.returncode == 0, run.stderr[-3000:]
        assert run.stdout.strip(), f"{doc}:{line} printed nothing"


@pytest.mark.parametrize("doc, line, body", all_cases("yaml"))
def test_yaml_block(doc, line, body):
    import yaml

    for data in yaml.safe_load_all(body):
        _check_yaml_document(doc, line, data)


def _check_yaml_document(doc: str, line: int, data) -> None:
    if data is None:
        return
    if "applications" in data:
        for app in data["applications"]:
            build_ray_app(app["import_path"], app.get("args") or {})
        return
    containers = [c for spec in _find(data, "containers") for c in spec]
    if data.get("kind") in ("Service", "ConfigMap", "HTTPRoute", "InferencePool", "InferenceModel"):
        return  # no command in it
    assert containers, f"{doc}:{line}: a YAML block of a kind this test does not know ({data.get('kind')})"
    for container in containers:
        parse_octavo([str(a) for a in container["args"]])


def _find(data, key: str) -> list:
    if isinstance(data, dict):
        return ([data[key]] if key in data else []) + [x for v in data.values() for x in _find(v, key)]
    if isinstance(data, list):
        return [x for v in data for x in _find(v, key)]
    return []


@pytest.mark.parametrize("doc", DOCS)
def test_inline_commands_parse(doc):
    text = (ROOT / doc).read_text()
    spans = re.findall(r"`((?:\.venv/bin/)?octavo [^`]+)`", text)
    assert spans or doc == "docs/SCALING.md"
    for span in spans:  # a mention in a sentence: its subcommand and every flag it names exist
        words = shlex.split(span.replace("[MODEL]", "model.gguf").replace("...", ""))
        parser, options = subcommand(octavo_argv(words))
        for word in words:
            if word.startswith("--"):
                assert word.split("=")[0] in options, f"{doc}: `{span}`: {word} is not a flag of it"


def subcommand(argv: list[str]) -> tuple:
    """The deepest subparser `argv` names, and its option strings."""
    import argparse

    from octavo.cli import build_parser

    parser = build_parser()
    for word in argv:
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if not subs or word not in subs[0].choices:
            break
        parser = subs[0].choices[word]
    return parser, {o for a in parser._actions for o in a.option_strings}


@pytest.mark.parametrize("doc", DOCS)
def test_import_strings_resolve(doc):
    """`module:attribute` strings (serve run's, Ray's YAML) and `octavo.x.y` module paths named in
    the prose import."""
    import importlib

    text = (ROOT / doc).read_text()
    for module, attr in set(re.findall(r"\b(octavo(?:\.\w+)+):(\w+)\b", text)):
        assert hasattr(importlib.import_module(module), attr) or attr == "build_app", f"{module}:{attr}"
        if attr == "build_app":
            pytest.importorskip("ray", reason="ray[serve] is not installed")
            from ray._common.utils import import_attr

            assert callable(import_attr(f"{module}:{attr}"))
    for module in set(re.findall(r"`(octavo(?:\.[a-z_]+)+)`", text)):
        try:
            importlib.import_module(module)
        except ModuleNotFoundError:  # an attribute path (octavo.x.Class): its module must import
            parent, _, name = module.rpartition(".")
            assert hasattr(importlib.import_module(parent), name), module
