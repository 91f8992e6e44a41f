"""Run vLLM's own OpenAI-server (and Anthropic) tests against `octavo serve`.

    .venv/bin/python tools/vllm_api_tests/run.py [--sdist DIR] [-k EXPR] [files...]

The tests come from vLLM's source distribution on PyPI (0.33.0; downloaded once into the cache
directory, or --sdist DIR of an unpacked one). Only the end-to-end tests are run: those that talk
to a server through RemoteOpenAIServer; the rest test vLLM's own classes. A workspace is built
with the tests copied as they are, tests/utils.py replaced by shim_utils.py (the server is
`octavo serve` on the embedded model under the test's model name) and `vllm` by vllm_stub.py.
Results: a table per file and outcome, and every test's outcome and first error line in
results.json (beside --out, default /tmp/vllm-shim/results.json). classify.py names each test's
kind (OpenAI's behaviour, a vLLM extension, or not applicable here, with the reason).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
VERSION = "0.33.0"
SDIST_URL = ("https://files.pythonhosted.org/packages/f7/25/aa5684e9c59d6fc75f78926b7f15e8d9adc7de2d9e6e7575b80776ad8169/"
             f"vllm-{VERSION}.tar.gz")
CONFTEST = '''
import sys
sys.path.insert(0, {here!r})
import vllm_stub
vllm_stub.install()
pytest_plugins = ["pytest_asyncio"]
'''


def sdist_dir(given: str | None) -> Path:
    if given:
        return Path(given)
    sys.path.insert(0, str(ROOT))
    from octavo.cache import cache_dir

    base = cache_dir() / "vllm-sdist"
    unpacked = base / f"vllm-{VERSION}"
    if not (unpacked / "tests").is_dir():
        base.mkdir(parents=True, exist_ok=True)
        archive = base / f"vllm-{VERSION}.tar.gz"
        print(f"downloading vLLM {VERSION}'s source distribution from PyPI ...", flush=True)
        urllib.request.urlretrieve(SDIST_URL, archive)
        with tarfile.open(archive) as tar:
            tar.extractall(base, members=[m for m in tar.getmembers() if "/tests/" in m.name or "/examples/" in m.name],
                           filter="data")
    return unpacked


def build_workspace(sdist: Path, work: Path) -> list[Path]:
    if work.exists():
        shutil.rmtree(work)
    tests = work / "tests"
    for part in ("entrypoints/openai", "entrypoints/anthropic", "entrypoints/serve"):
        shutil.copytree(sdist / "tests" / part, tests / part)
    for init in (tests, tests / "entrypoints"):
        (init / "__init__.py").touch()
    shutil.copy(sdist / "tests" / "entrypoints" / "conftest.py", tests / "entrypoints" / "conftest.py")
    shutil.copy(HERE / "shim_utils.py", tests / "utils.py")
    shutil.copy(HERE / "vllm_stub.py", work / "vllm_stub.py")
    (work / "conftest.py").write_text(CONFTEST.format(here=str(work)))
    (work / "pytest.ini").write_text("[pytest]\nasyncio_mode = strict\nasyncio_default_fixture_loop_scope = function\n")
    return end_to_end(tests)


def end_to_end(tests: Path) -> list[Path]:
    """The test files that talk to a server: they start RemoteOpenAIServer themselves, or use a
    fixture of their folder's conftest.py that does (the Responses API's files: server_with_store)."""
    server_fixtures: dict[Path, set[str]] = {}
    for conftest in tests.rglob("conftest.py"):
        text = conftest.read_text()
        if "RemoteOpenAIServer" in text:
            server_fixtures[conftest.parent] = set(re.findall(r"^(?:async )?def (\w+)\(", text, re.M))
    files = []
    for path in tests.rglob("test_*.py"):
        text = path.read_text()
        fixtures = set().union(*(names for folder, names in server_fixtures.items() if folder in path.parents))
        if "RemoteOpenAIServer" in text or any(re.search(rf"\b{name}\b", text) for name in fixtures):
            files.append(path)
    return sorted(files)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sdist", default=None)
    parser.add_argument("--work", default="/tmp/vllm-shim")
    parser.add_argument("-k", default=None)
    parser.add_argument("files", nargs="*", help="test files (relative to tests/entrypoints) to run; default all e2e")
    args = parser.parse_args()
    sdist = sdist_dir(args.sdist)
    work = Path(args.work)
    files = build_workspace(sdist, work)
    if args.files:
        files = [work / "tests" / "entrypoints" / f for f in args.files]
    report = work / "report.json"
    env = {**os.environ, "PYTHONPATH": f"{work}:{ROOT}", "VLLM_SDIST": str(sdist),
           "OCTAVO_SHIM_LOG": str(work / "dropped-flags.log"), "OCTAVO_SHIM_WORK": str(work), "OCTAVO_SHIM_SERVER_LOG": str(work / "servers.log")}
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "--tb=line", "-rN", "--timeout=150",
           "--continue-on-collection-errors",
           *(["-k", args.k] if args.k else []), f"--junitxml={work / 'junit.xml'}",
           *[str(f.relative_to(work)) for f in files]]
    missing = [m for m in ("pytest_asyncio", "pytest_timeout", "anthropic") if importlib.util.find_spec(m) is None]
    if missing:
        print(f"missing {', '.join(missing)}: pip install -e '.[peer-tests]'", file=sys.stderr)
        return 2
    print(f"{len(files)} end-to-end test files; workspace {work}", flush=True)
    subprocess.run(cmd, cwd=work, env=env)
    results = summarise(work / "junit.xml")
    report.write_text(json.dumps(results, indent=1))
    table(results)
    return 0


def summarise(junit: Path) -> dict[str, dict]:
    import xml.etree.ElementTree as ET

    out = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        outcome, detail = "passed", ""
        for child in case:
            if child.tag in ("failure", "error"):
                outcome, detail = ("needs vLLM" if "NeedsVllm" in (child.get("message") or "") + (child.text or "")
                                   else child.tag), (child.get("message") or "")[:300]
            elif child.tag == "skipped":
                outcome, detail = "skipped", (child.get("message") or "")[:300]
        out[name] = {"outcome": outcome, "detail": detail}
    return out


def table(results: dict[str, dict]) -> None:
    by_file: dict[str, dict[str, int]] = {}
    for name, r in results.items():
        f = name.split("::")[0].removeprefix("tests.entrypoints.")
        by_file.setdefault(f, {}).setdefault(r["outcome"], 0)
        by_file[f][r["outcome"]] += 1
    kinds = ("passed", "failure", "error", "needs vLLM", "skipped")
    print(f"{'file':60} " + " ".join(f"{k:>10}" for k in kinds))
    for f in sorted(by_file):
        print(f"{f[-60:]:60} " + " ".join(f"{by_file[f].get(k, 0):>10}" for k in kinds))
    totals = {k: sum(c.get(k, 0) for c in by_file.values()) for k in kinds}
    print(f"{'total':60} " + " ".join(f"{totals[k]:>10}" for k in kinds))


if __name__ == "__main__":
    sys.exit(main())
