"""Start `octavo generate` on N mutated GGUF files and tabulate what each start did.

    python tools/gguf_fuzz.py --num-files 2000 [--json out.json]

Mutants of the embedded SmolLM2 file and of a tiny Gemma 3-layout file (tests/models): a count,
length, type, dimension or offset of the header set to an edge value (structural), a scalar
hyperparameter set to another value (value), random bytes in the header, or the file cut short.
Each start runs in its own process (one thread) with a deadline; outcomes: refused (exit 2, one
line on stderr), served (its greedy answer compared with the unmutated file's: a structural
mutation must answer the same), traceback, hang, or another exit. Peak RSS (VmHWM) of every
refused start is compared with the file's size. Conversions go to a scratch cache directory.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from octavo.models.gguf_file import read_header  # noqa: E402
from tests.models.test_gguf_fuzz import _MEASURED_CLI, EDGES, layout_of  # noqa: E402

PROMPT = "The capital of France is"


def mutations(path: Path, rng: random.Random, count: int) -> list[dict]:
    """`count` mutations of `path`: {kind, patches [(offset, bytes)] or cut, what}."""
    fields = layout_of(path)
    head_end = read_header(path).data_offset
    structural = [f for f in fields if not f[2].startswith("metadata ")]
    values = [f for f in fields if f[2].startswith("metadata ")]
    size = path.stat().st_size
    out = []
    for _ in range(count):
        roll = rng.random()
        if roll < 0.5 or roll < 0.75:
            offset, width, what = rng.choice(structural if roll < 0.5 else values)
            value = rng.choice([*EDGES, rng.getrandbits(8 * width), rng.getrandbits(8 * width)])
            patch = (value % (1 << (8 * width))).to_bytes(width, "little")
            out.append({"kind": "structural" if roll < 0.5 else "value", "what": f"{what} = {value}",
                        "patches": [(offset, patch)]})
        elif roll < 0.9:
            patches = [(rng.randrange(head_end), bytes([rng.randrange(256)])) for _ in range(rng.randint(1, 8))]
            out.append({"kind": "bytes", "what": f"{len(patches)} random header bytes", "patches": patches})
        else:
            cut = rng.randrange(size)
            out.append({"kind": "cut", "what": f"cut at {cut} of {size} bytes", "cut": cut})
    return out


def start(path: Path, env: dict, timeout_s: float) -> dict:
    """One `octavo generate` start on `path`: its outcome, seconds, peak RSS and answer."""
    cmd = [sys.executable, "-c", _MEASURED_CLI, "generate", str(path), "--prompt", PROMPT, "--max-tokens", "8",
           "--json", "--kv-cache-memory", "64MiB"]
    began = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"outcome": "hang", "seconds": timeout_s}
    seconds = time.perf_counter() - began
    err, _, measured = proc.stderr.rstrip().rpartition("\n")
    peak = int(measured.split()[1]) * 1024 if measured.startswith("peak-rss-kib ") else None
    lines = [line for line in err.splitlines() if line.startswith("octavo: error:")]
    result = {"seconds": round(seconds, 3), "peak_rss": peak}
    if "Traceback" in err:
        return {**result, "outcome": "traceback", "detail": err[-1500:]}
    if proc.returncode == 2 and len(lines) == 1:
        if lines[0].startswith("octavo: error: prompt 0:"):  # the file loaded; its declared context cannot hold the prompt
            return {**result, "outcome": "served, prompt refused", "detail": lines[0]}
        return {**result, "outcome": "refused", "detail": lines[0]}
    if proc.returncode == 0:
        answer = json.loads(proc.stdout)["answers"][0]["text"]
        return {**result, "outcome": "served", "answer": answer}
    return {**result, "outcome": f"exit {proc.returncode}", "detail": err[-1500:]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--num-files", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds a start may take (a hang past it)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    from octavo.cache import cache_dir
    from octavo.models.loader import default_gguf_path
    from tests.models.gguf_writer import hf_model, write_gguf

    work = Path(tempfile.mkdtemp(prefix="octavo-gguf-fuzz-"))
    cache = work / "cache"
    cache.mkdir()
    kernels = cache_dir() / "kernels"
    if kernels.is_dir():  # the compiled kernels are reused; conversions go to the scratch cache
        (cache / "kernels").symlink_to(kernels)
    env = dict(os.environ, OMP_NUM_THREADS="1", OCTAVO_CACHE_DIR=str(cache), OCTAVO_ADAPTIVE_THREADS="0")
    (work / "src").mkdir()
    tiny = work / "src" / "tiny-gemma3.gguf"
    write_gguf(hf_model("gemma3"), "gemma3", tiny)
    empty = work / "empty.gguf"
    empty.write_bytes(b"GGUF")
    baseline = start(empty, env, args.timeout)  # what any refused start costs: the interpreter and the CLI
    rng = random.Random(args.seed)
    results: list[dict] = []
    counts: Counter = Counter()
    try:
        for source, share in ((default_gguf_path(), 0.5), (tiny, 0.5)):
            original = start(source, env, args.timeout)
            assert original["outcome"] == "served", original
            target = work / source.name
            shutil.copyfile(source, target)
            whole = source.read_bytes() if source.stat().st_size < (1 << 26) else None
            for i, m in enumerate(mutations(source, rng, int(args.num_files * share))):
                saved = []
                with open(target, "r+b") as fh:
                    for offset, patch in m.get("patches", []):
                        fh.seek(offset)
                        saved.append((offset, fh.read(len(patch))))
                        fh.seek(offset)
                        fh.write(patch)
                    if "cut" in m:
                        fh.truncate(m["cut"])
                r = start(target, env, args.timeout)
                if r["outcome"] == "served":
                    same = r["answer"] == original["answer"]
                    r["outcome"] = "served, same answer" if same else "served, another answer"
                    if m["kind"] == "structural" and not same:
                        r["outcome"] = "WRONG: a structural mutation served another model"
                with open(target, "r+b") as fh:  # undo
                    if "cut" in m:
                        fh.seek(m["cut"])
                        fh.write((whole if whole is not None else source.read_bytes())[m["cut"]:])
                    for offset, old in reversed(saved):
                        fh.seek(offset)
                        fh.write(old)
                r.update(file=source.name, kind=m["kind"], what=m["what"], file_bytes=source.stat().st_size)
                results.append(r)
                counts[(m["kind"], r["outcome"])] += 1
                if (i + 1) % 50 == 0:
                    print(f"{source.name}: {i + 1} files; {dict(Counter(x['outcome'] for x in results))}", flush=True)
                for path in (cache / "models").glob("*") if (cache / "models").is_dir() else []:
                    shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    refused = [r for r in results if r["outcome"] == "refused" and r["peak_rss"]]
    over = [r for r in refused if r["peak_rss"] - baseline["peak_rss"] >= 2 * r["file_bytes"]]
    print(f"a refused start of a 4-byte file peaks at {baseline['peak_rss'] / 2**20:.1f} MiB (the baseline)")
    print(f"\n{len(results)} files")
    print("| mutation | outcome | files |\n| --- | --- | ---: |")
    for (kind, outcome), n in sorted(counts.items()):
        print(f"| {kind} | {outcome} | {n} |")
    for name in sorted({r["file"] for r in refused}):
        mine = sorted(r["peak_rss"] for r in refused if r["file"] == name)
        secs = sorted(r["seconds"] for r in refused if r["file"] == name)
        size = next(r["file_bytes"] for r in refused if r["file"] == name)
        print(f"{name} ({size / 2**20:.1f} MiB): refused starts peak RSS median {mine[len(mine) // 2] / 2**20:.1f} MiB, "
              f"max {mine[-1] / 2**20:.1f} MiB; seconds median {secs[len(secs) // 2]:.2f}, max {secs[-1]:.2f}")
    print(f"refused starts whose peak RSS over the baseline is 2x the file's size or more: {len(over)}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    bad = [r for r in results if r["outcome"] in ("traceback", "hang") or r["outcome"].startswith(("WRONG", "exit"))]
    for r in bad[:10]:
        print("\n", r["kind"], r["what"], r["outcome"], r.get("detail", "")[-600:])
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
