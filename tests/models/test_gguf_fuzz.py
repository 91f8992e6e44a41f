"""Hostile GGUF files: mutations of the embedded model's header and of a tiny Gemma-layout file's
(counts, lengths, types, dimensions, offsets, values, random bytes, truncation) are each either
read as exactly the original model or refused with a one-line GGUFFormatError, with the reader's
allocations under twice the file's size; and `octavo serve` refuses the issue's files in a
fraction of a second without a traceback. `tools/gguf_fuzz.py` runs 2,000 such files through
whole starts."""

from __future__ import annotations

import os
import signal
import struct
import subprocess
import sys
import tracemalloc
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from octavo.models import gguf_arch
from octavo.models.gguf_file import ArrayValue, GGUFFormatError, read_header
from octavo.models.loader import default_gguf_path

# values a mutated field takes: the edges of its width, and what reads as huge counts and sizes
EDGES = (0, 1, 2, 3, 7, 8, 9, 31, 32, 255, 256, 2**16, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**40, 2**62, 2**63,
         2**64 - 1)
HANG_S = 60  # a generous bound: a read takes milliseconds; only a loop without end reaches it


@pytest.fixture(scope="module")
def tiny_gemma(tmp_path_factory) -> Path:
    """A Gemma 3-layout GGUF (6 layers: 5 sliding, 1 global; Q8_0 linear weights) of ~100 KB."""
    from tests.models.gguf_writer import hf_model, write_gguf

    path = tmp_path_factory.mktemp("gguf") / "tiny-gemma3.gguf"
    write_gguf(hf_model("gemma3"), "gemma3", path)
    return path


def layout_of(path: Path) -> list[tuple[int, int, str]]:
    """(offset, size, what) of every scalar field of the header, and the first and last length
    of each string array (its elements are walked, not recorded)."""
    fields: list[tuple[int, int, str]] = []
    header = read_header(path, fields)
    for key, value in header.metadata.items():
        if isinstance(value, ArrayValue) and value.elem_type == 8 and value.count:
            fields.append((value.offset, 8, f"the length of element 0 of {key}"))
    return fields


def signature(path: Path) -> tuple:
    """What the engine would load from a file: its config, its tensor table and its tokenizer."""
    header = read_header(path)
    config = gguf_arch.hf_config(header)
    tensors = [(t.name, t.shape, t.ggml_type, t.offset, t.num_bytes) for t in header.tensors.values()]
    tokenizer = [(k, header.strings(k) or header.numbers(k)) for k in sorted(header.metadata) if k.startswith("tokenizer.")
                 and isinstance(header.metadata[k], ArrayValue)]
    scalars = sorted((k, v) for k, v in header.metadata.items() if not isinstance(v, ArrayValue))
    return config, tensors, tokenizer, scalars


class Hung(Exception):
    pass


def read_bounded(path: Path) -> tuple[object, int]:
    """(hf_config or the GGUFFormatError, peak bytes Python allocated while reading). Any other
    exception propagates (a traceback is a failure); a read past HANG_S raises Hung."""
    def on_alarm(signum, frame):
        raise Hung(f"reading {path.name} took more than {HANG_S} s")

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(HANG_S)
    tracemalloc.start()
    try:
        try:
            result: object = gguf_arch.hf_config(read_header(path))
        except GGUFFormatError as exc:
            result = exc
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    return result, peak


_SIGNATURES: dict[Path, tuple] = {}


def check_mutant(original: Path, head: bytearray, tmp: Path, same_model: bool) -> None:
    """Write the mutated header `head` as a file of the original's size (the tensor data a sparse
    hole: the checks read only the header and the size) and read it: refused with one line naming
    it, or (when the mutation can only be structural: `same_model`) read as exactly the original."""
    path = tmp / original.name
    path.write_bytes(head)
    size = original.stat().st_size
    os.truncate(path, size)
    result, peak = read_bounded(path)
    assert peak < 2 * max(size, 1 << 16), f"reading allocated {peak} bytes for a {size}-byte file"
    if isinstance(result, GGUFFormatError):
        message = str(result)
        assert "\n" not in message and message.startswith(f"{path.name}: "), message
        return
    if same_model:
        if original not in _SIGNATURES:
            _SIGNATURES[original] = signature(original)
        assert signature(path) == _SIGNATURES[original], "a structural mutation was read as another model"
    path.unlink()


def mutate_field(data: bytes, field: tuple[int, int, str], value: int) -> bytearray:
    offset, size, _ = field
    out = bytearray(data)
    out[offset : offset + size] = (value % (1 << (8 * size))).to_bytes(size, "little")
    return out


def sources(tiny_gemma: Path) -> dict[str, tuple[Path, bytes, list]]:
    out = {}
    for path in (default_gguf_path(), tiny_gemma):
        header_end = read_header(path).data_offset
        with open(path, "rb") as fh:
            head = fh.read(header_end)
        out[path.name] = (path, head, layout_of(path))
    return out


@pytest.fixture(scope="module")
def files(tiny_gemma):
    return sources(tiny_gemma)


_SETTINGS = settings(max_examples=120, deadline=None, derandomize=True,
                     suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
# the tiny file three times as often: a mutant of the 49k-token vocabulary that is read costs ~0.3 s
WHICH = st.sampled_from(["SmolLM2-135M-Instruct.Q4_1.gguf"] + ["tiny-gemma3.gguf"] * 3)


@_SETTINGS
@given(which=WHICH, data=st.data())
def test_a_mutated_count_length_type_or_offset_is_refused_or_changes_nothing(files, tmp_path, which, data):
    path, head, layout = files[which]
    structural = [f for f in layout if not f[2].startswith("metadata ")]
    field = data.draw(st.sampled_from(structural))
    original = int.from_bytes(head[field[0] : field[0] + field[1]], "little")
    value = data.draw(st.one_of(st.sampled_from(EDGES), st.integers(0, 2 ** (8 * field[1]) - 1),
                                st.sampled_from([original - 1, original + 1, original * 2, original // 2])))
    mutant = mutate_field(head, field, value)
    check_mutant(path, mutant, tmp_path, same_model=True)


@_SETTINGS
@given(which=WHICH, data=st.data())
def test_a_mutated_value_or_random_bytes_are_refused_in_one_line_or_read(files, tmp_path, which, data):
    path, head, layout = files[which]
    values = [f for f in layout if f[2].startswith("metadata ")]
    mutant = bytearray(head)
    if data.draw(st.booleans()):
        field = data.draw(st.sampled_from(values))
        mutant = mutate_field(head, field, data.draw(st.one_of(st.sampled_from(EDGES), st.integers(0, 2**64 - 1))))
    else:
        for _ in range(data.draw(st.integers(1, 8))):
            mutant[data.draw(st.integers(0, len(head) - 1))] = data.draw(st.integers(0, 255))
    check_mutant(path, mutant, tmp_path, same_model=False)


@settings(max_examples=60, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_a_truncated_file_is_refused(tiny_gemma, tmp_path, data):
    whole = tiny_gemma.read_bytes()
    cut = data.draw(st.integers(0, len(whole) - 1))
    path = tmp_path / "cut.gguf"
    path.write_bytes(whole[:cut])
    result, _ = read_bounded(path)
    assert isinstance(result, GGUFFormatError), f"a file cut at {cut} of {len(whole)} bytes was read"


# Runs the CLI and writes its peak RSS (VmHWM: this process image's own, unlike ru_maxrss, which
# keeps the forking parent's across exec) on stderr's last line.
_MEASURED_CLI = """
import atexit, sys
def peak():
    with open("/proc/self/status") as f:
        kib = next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
    sys.stderr.write(f"\\npeak-rss-kib {kib}\\n")
atexit.register(peak)
from octavo.cli import main
sys.exit(main(sys.argv[1:]))
"""


def run_cli_measured(args: list[str], timeout_s: float) -> tuple[int, str, int]:
    """(exit status, stderr without the measurement, peak RSS in bytes) of `octavo ARGS`; a
    failure if it outlives `timeout_s`."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    try:
        proc = subprocess.run([sys.executable, "-c", _MEASURED_CLI, *args], stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, env=env, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        pytest.fail(f"octavo {' '.join(args)} still ran after {timeout_s:.0f} s: it must refuse the file")
    err, _, measured = proc.stderr.rstrip().rpartition("\n")
    assert measured.startswith("peak-rss-kib "), proc.stderr[-2000:]
    return proc.returncode, err, int(measured.split()[1]) * 1024


def test_serve_refuses_the_issue_files_in_one_line_without_loading_them(tmp_path):
    """A metadata array count of 2**40 (gguf-py allocated without end), a tensor of the wrong shape
    (served, then crashed on the first request), a truncated file: each an exit status 2 and one
    line on stderr, the process never holding twice the file's size."""
    src = default_gguf_path()
    data = bytearray(src.read_bytes())
    merges = read_header(src).metadata["tokenizer.ggml.merges"]
    count = bytearray(data)
    struct.pack_into("<Q", count, merges.offset - 8, 1 << 40)
    # ffn_down's dimensions swapped: the same bytes, read as [576, 1536] for [1536, 576]
    ne0, ne1 = [f for f in layout_of(src) if f[2] == "a dimension of tensor blk.0.ffn_down.weight"]
    shape = mutate_field(mutate_field(data, ne0, 576), ne1, 1536)
    cut = data[: len(data) // 2]
    for name, content, expect in (("count", count, "claims 1099511627776 elements"),
                                  ("shape", shape, "tensor blk.0.ffn_down.weight has shape [576, 1536]"),
                                  ("cut", cut, "lies past the end of the file")):
        path = tmp_path / f"{name}.gguf"
        path.write_bytes(content)
        status, err, peak = run_cli_measured(["serve", str(path), "--port", "1"], 120)
        lines = [line for line in err.splitlines() if line.strip()]
        assert status == 2 and len(lines) == 1 and "Traceback" not in err and expect in lines[0], (name, status, err)
        assert peak < 2 * len(data), f"{name}.gguf: the refused start peaked at {peak >> 20} MiB"
