"""Reading a GGUF file's header without trusting it: every count and length is checked against the
bytes left before anything is allocated, and every tensor's type, size and offset against the file.

A GGUF is `magic "GGUF" | version u32 | tensor count u64 | metadata count u64 | metadata | tensor
infos | padding to the alignment | tensor data` (ggml's docs/gguf.md). gguf-py's reader trusts the
counts: one metadata array whose count is set to 2**40 made it allocate without end. Here nothing
is materialised while walking the header (string arrays are only walked, numbers only counted),
so a malformed file costs at most one pass over its header, and is refused with a one-line
`GGUFFormatError` naming the key, tensor or offset. The tensors must lie as llama.cpp lays them
out (in order, each at the previous one's end rounded up to the alignment), which is also what
llama.cpp checks at load. Pure Python (struct and mmap): `octavo serve FILE` reads this before it
imports torch, so a refused file costs milliseconds.
"""

from __future__ import annotations

import hashlib
import mmap
import os
import struct
import sys
from array import array
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4  # GGML_MAX_DIMS
# The most elements of one metadata array Octavo reads (the largest vocabularies and merge lists
# have ~10^6): a count above it is refused before walking its elements.
MAX_ARRAY_ELEMENTS = 1 << 24
MAX_KEY_BYTES = 1 << 16

# GGUF metadata value types: code -> (name, struct format of one element; None for string/array)
VALUE_TYPES: dict[int, tuple[str, str | None]] = {
    0: ("uint8", "B"), 1: ("int8", "b"), 2: ("uint16", "H"), 3: ("int16", "h"), 4: ("uint32", "I"),
    5: ("int32", "i"), 6: ("float32", "f"), 7: ("bool", "?"), 8: ("string", None), 9: ("array", None),
    10: ("uint64", "Q"), 11: ("int64", "q"), 12: ("float64", "d"),
}
STRING, ARRAY = 8, 9

# ggml tensor types Octavo reads: code -> (name, weights per block, bytes per block) (ggml.h /
# ggml.c type traits). The I-quants, ternary types and NVFP4 are refused by name (MXFP4, gpt-oss's
# experts, is read and kept in its blocks: quantization.MXFP4).
TENSOR_TYPES: dict[int, tuple[str, int, int]] = {
    0: ("F32", 1, 4), 1: ("F16", 1, 2), 30: ("BF16", 1, 2),
    2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20), 6: ("Q5_0", 32, 22), 7: ("Q5_1", 32, 24), 8: ("Q8_0", 32, 34),
    10: ("Q2_K", 256, 84), 11: ("Q3_K", 256, 110), 12: ("Q4_K", 256, 144), 13: ("Q5_K", 256, 176),
    14: ("Q6_K", 256, 210), 39: ("MXFP4", 32, 17),
}
KNOWN_UNSUPPORTED_TYPES = {
    9: "Q8_1", 15: "Q8_K", 16: "IQ2_XXS", 17: "IQ2_XS", 18: "IQ3_XXS", 19: "IQ1_S", 20: "IQ4_NL", 21: "IQ3_S",
    22: "IQ2_S", 23: "IQ4_XS", 24: "I8", 25: "I16", 26: "I32", 27: "I64", 28: "F64", 29: "IQ1_M", 34: "TQ1_0",
    35: "TQ2_0", 40: "NVFP4", 41: "Q1_0",
}


class GGUFFormatError(ValueError):
    """A GGUF file Octavo refuses; the message is one line naming the file and what is wrong."""


@dataclass(frozen=True, slots=True)
class ArrayValue:
    """A metadata array, not materialised: `count` elements of `elem_type` from byte `offset`."""

    elem_type: int
    count: int
    offset: int


@dataclass(frozen=True, slots=True)
class TensorInfo:
    """One tensor: `shape` in GGUF order (ne0 = the row length first), ggml type, absolute offset."""

    name: str
    shape: tuple[int, ...]
    ggml_type: int
    offset: int  # absolute, in the file
    num_bytes: int

    @property
    def type_name(self) -> str:
        return TENSOR_TYPES[self.ggml_type][0]

    @property
    def num_elements(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


class _Cursor:
    """Reads little-endian values from the mapped file, each read checked against its end."""

    def __init__(self, buf: Any, name: str, layout: list | None = None) -> None:
        self.buf, self.pos, self.end, self.name = buf, 0, len(buf), name
        self.layout = layout  # if a list: (offset, size, what) of every scalar read, appended

    def fail(self, what: str) -> GGUFFormatError:
        return GGUFFormatError(f"{self.name}: {what}")

    def need(self, num_bytes: int, what: str) -> None:
        if num_bytes < 0 or num_bytes > self.end - self.pos:
            raise self.fail(f"{what} needs {num_bytes} bytes at offset {self.pos}, but the file ends "
                            f"{self.end - self.pos} bytes later")

    def scalar(self, fmt: str, what: str) -> Any:
        size = struct.calcsize("<" + fmt)
        self.need(size, what)
        (value,) = struct.unpack_from("<" + fmt, self.buf, self.pos)
        if self.layout is not None:
            self.layout.append((self.pos, size, what))
        self.pos += size
        return value

    def raw_string(self, what: str, max_bytes: int | None = None) -> bytes:
        length = self.scalar("Q", f"the length of {what}")
        if max_bytes is not None and length > max_bytes:
            raise self.fail(f"{what} claims {length} bytes (at most {max_bytes})")
        self.need(length, what)
        data = bytes(self.buf[self.pos : self.pos + length])
        self.pos += length
        return data

    def text(self, what: str, max_bytes: int | None = None) -> str:
        data = self.raw_string(what, max_bytes)
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError:
            raise self.fail(f"{what} is not UTF-8") from None

    def skip_strings(self, count: int, what: str) -> None:
        """Walk `count` strings (each a u64 length and its bytes) without keeping them."""
        unpack, buf, pos, end = struct.Struct("<Q").unpack_from, self.buf, self.pos, self.end
        for i in range(count):
            if end - pos < 8:
                self.pos = pos
                raise self.fail(f"{what}: element {i} of {count} lies past the end of the file")
            (length,) = unpack(buf, pos)
            pos += 8
            if length > end - pos:
                self.pos = pos
                raise self.fail(f"{what}: element {i} of {count} claims {length} bytes, past the end of the file")
            pos += length
        self.pos = pos


class GGUFHeader:
    """A GGUF file's checked header: metadata (scalars as Python values, strings decoded, arrays as
    `ArrayValue`), tensors by name in file order, and where their data starts."""

    def __init__(self, path: Path, file_size: int, version: int, metadata: dict[str, Any],
                 value_types: dict[str, int], tensors: dict[str, TensorInfo], data_offset: int) -> None:
        self.path, self.file_size, self.version = path, file_size, version
        self.metadata, self.value_types = metadata, value_types  # key -> value; key -> its VALUE_TYPES code
        self.tensors, self.data_offset = tensors, data_offset
        self._content_key: str | None = None

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    def strings(self, key: str) -> list[str]:
        """A string array's elements (decoded, invalid UTF-8 replaced); [] if absent."""
        value = self.metadata.get(key)
        if not isinstance(value, ArrayValue) or value.elem_type != STRING:
            return []
        out: list[str] = []
        with _mapped(self.path) as buf:
            pos = value.offset
            for _ in range(value.count):
                (length,) = struct.unpack_from("<Q", buf, pos)
                out.append(bytes(buf[pos + 8 : pos + 8 + length]).decode("utf-8", errors="replace"))
                pos += 8 + length
        return out

    def raw_array(self, key: str) -> bytes | None:
        """A string or numeric array's elements as the file encodes them (for copying the array
        into another GGUF as it is); None if absent or an array of arrays."""
        value = self.metadata.get(key)
        if not isinstance(value, ArrayValue) or value.elem_type == ARRAY:
            return None
        with _mapped(self.path) as buf:
            if value.elem_type != STRING:
                size = struct.calcsize("<" + VALUE_TYPES[value.elem_type][1])
                return bytes(buf[value.offset : value.offset + value.count * size])
            unpack, pos = struct.Struct("<Q").unpack_from, value.offset
            for _ in range(value.count):  # (the header was checked: every element lies inside)
                pos += 8 + unpack(buf, pos)[0]
            return bytes(buf[value.offset : pos])

    def numbers(self, key: str) -> list[int | float]:
        """A numeric array's elements; [] if absent."""
        value = self.metadata.get(key)
        if not isinstance(value, ArrayValue) or value.elem_type in (STRING, ARRAY):
            return []
        fmt = VALUE_TYPES[value.elem_type][1]
        size = struct.calcsize("<" + fmt)
        with _mapped(self.path) as buf:
            if fmt == "?":
                return [b != 0 for b in bytes(buf[value.offset : value.offset + value.count])]
            values = array(fmt)
            values.frombytes(bytes(buf[value.offset : value.offset + value.count * size]))
        if sys.byteorder != "little":
            values.byteswap()
        return values.tolist()

    def content_key(self) -> str:
        """A digest of what the file holds, cheap to compute at every start: the whole header (all
        metadata and the tensor index) and, of every tensor, its first, middle and last 4 KiB, so
        a file replaced in place (`cp -p`, `rsync -a`: same size and time) gets another key.
        Computed once per header (a start asks for it when naming, converting and checking)."""
        if self._content_key is not None:
            return self._content_key
        digest = hashlib.sha256()
        digest.update(f"{self.file_size}:".encode())
        with _mapped(self.path) as buf:
            digest.update(buf[: self.data_offset])
            for t in self.tensors.values():
                for start in {t.offset, t.offset + max(0, t.num_bytes // 2 - 2048), t.offset + max(0, t.num_bytes - 4096)}:
                    digest.update(buf[start : min(start + 4096, t.offset + t.num_bytes)])
        self._content_key = digest.hexdigest()
        return self._content_key


class _mapped:
    """The file mapped read-only (an empty file as empty bytes: mmap refuses length 0)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __enter__(self) -> Any:
        with open(self.path, "rb") as fh:
            size = os.fstat(fh.fileno()).st_size
            self.map = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) if size else None
        return self.map if self.map is not None else b""

    def __exit__(self, *exc: object) -> None:
        if self.map is not None:
            self.map.close()


def read_header(path: str | os.PathLike, layout: list | None = None) -> GGUFHeader:
    """Parse and check `path`'s header. Raises GGUFFormatError (one line) for any malformed part,
    OSError if it cannot be read. Allocates no more than the header's own size. `layout`: a list
    to which (offset, size, what) of every count, length, type, dimension, offset and scalar
    value read is appended (what the fuzz tests mutate)."""
    path = Path(path)
    with _mapped(path) as buf:
        cur = _Cursor(buf, path.name, layout)
        file_size = len(buf)
        if file_size < 4 or bytes(buf[:4]) != MAGIC:
            raise cur.fail("not a GGUF file (it does not start with the bytes GGUF)")
        cur.pos = 4
        version = cur.scalar("I", "the version")
        if version not in (2, 3):
            raise cur.fail(f"GGUF version {version} is not supported (2 and 3 are)")
        num_tensors = cur.scalar("Q", "the tensor count")
        num_kv = cur.scalar("Q", "the metadata count")
        # each metadata entry takes at least 13 bytes (key length, type, a one-byte value); each
        # tensor info at least 32 (name length, dimension count, one dimension, type, offset)
        if num_kv > (file_size - cur.pos) // 13:
            raise cur.fail(f"the header claims {num_kv} metadata entries; the file has room for at most "
                           f"{(file_size - cur.pos) // 13}")
        if num_tensors > (file_size - cur.pos) // 32:
            raise cur.fail(f"the header claims {num_tensors} tensors; the file has room for at most "
                           f"{(file_size - cur.pos) // 32}")
        metadata, value_types = _read_metadata(cur, num_kv)
        infos = _read_tensor_infos(cur, num_tensors)
        alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
        if not isinstance(alignment, int) or isinstance(alignment, bool) or alignment < 1 or alignment & (alignment - 1):
            raise cur.fail(f"general.alignment must be a power of two, got {alignment!r}")
        data_offset = -(-cur.pos // alignment) * alignment
        tensors = _place_tensors(cur, infos, data_offset, alignment)
    return GGUFHeader(path, file_size, version, metadata, value_types, tensors, data_offset)


def _read_metadata(cur: _Cursor, count: int) -> tuple[dict[str, Any], dict[str, int]]:
    metadata: dict[str, Any] = {}
    value_types: dict[str, int] = {}
    for i in range(count):
        key = cur.text(f"metadata key {i}", MAX_KEY_BYTES)
        if key in metadata:
            raise cur.fail(f"metadata key {key!r} appears twice")
        code = cur.scalar("I", f"the type of {key}")
        if code not in VALUE_TYPES:
            raise cur.fail(f"metadata {key} has unknown value type {code}")
        metadata[key], value_types[key] = _read_value(cur, key, code), code
    return metadata, value_types


def _read_value(cur: _Cursor, key: str, code: int) -> Any:
    if code == STRING:
        return cur.raw_string(f"metadata {key}").decode("utf-8", errors="replace")
    if code != ARRAY:
        return cur.scalar(VALUE_TYPES[code][1], f"metadata {key}")
    elem = cur.scalar("I", f"the element type of {key}")
    if elem not in VALUE_TYPES or elem == ARRAY:
        raise cur.fail(f"metadata {key} is an array of unknown or nested type {elem}")
    count = cur.scalar("Q", f"the element count of {key}")
    if count > MAX_ARRAY_ELEMENTS:
        raise cur.fail(f"metadata {key} claims {count} elements (at most {MAX_ARRAY_ELEMENTS} are read)")
    start = cur.pos
    if elem == STRING:
        if count * 8 > cur.end - cur.pos:
            raise cur.fail(f"metadata {key} claims {count} strings; the file has room for at most {(cur.end - cur.pos) // 8}")
        cur.skip_strings(count, f"metadata {key}")
    else:
        cur.need(count * struct.calcsize("<" + VALUE_TYPES[elem][1]), f"metadata {key} ({count} elements)")
        cur.pos += count * struct.calcsize("<" + VALUE_TYPES[elem][1])
    return ArrayValue(elem, count, start)


def _read_tensor_infos(cur: _Cursor, count: int) -> list[tuple[str, tuple[int, ...], int, int]]:
    infos = []
    names: set[str] = set()
    for i in range(count):
        name = cur.text(f"the name of tensor {i}", MAX_KEY_BYTES)
        if name in names:
            raise cur.fail(f"tensor {name} appears twice")
        names.add(name)
        num_dims = cur.scalar("I", f"the dimension count of tensor {name}")
        if not 1 <= num_dims <= MAX_DIMS:
            raise cur.fail(f"tensor {name} has {num_dims} dimensions (1 to {MAX_DIMS} are valid)")
        shape = tuple(cur.scalar("Q", f"a dimension of tensor {name}") for _ in range(num_dims))
        ggml_type = cur.scalar("I", f"the type of tensor {name}")
        offset = cur.scalar("Q", f"the offset of tensor {name}")
        infos.append((name, shape, ggml_type, offset))
    return infos


def _place_tensors(cur: _Cursor, infos: list, data_offset: int, alignment: int) -> dict[str, TensorInfo]:
    """Each tensor's type known, its size computed without overflow, and its data where llama.cpp
    would put it: in file order, each at the previous end rounded up to the alignment, inside
    the file; and the data filling the file (a changed type or shape leaves bytes unclaimed)."""
    tensors: dict[str, TensorInfo] = {}
    expected = 0
    for name, shape, ggml_type, offset in infos:
        if ggml_type not in TENSOR_TYPES:
            what = KNOWN_UNSUPPORTED_TYPES.get(ggml_type)
            raise cur.fail(f"tensor {name} has type {what or ggml_type}, which Octavo does not read "
                           f"(it reads {', '.join(t[0] for t in TENSOR_TYPES.values())})")
        type_name, block, block_bytes = TENSOR_TYPES[ggml_type]
        if any(d < 1 for d in shape):
            raise cur.fail(f"tensor {name} has an empty dimension: {list(shape)}")
        num_elements = 1
        for d in shape:
            num_elements *= d  # Python integers: no overflow; compared with the file below
        if shape[0] % block:
            raise cur.fail(f"tensor {name}: rows of {shape[0]} weights are not whole {type_name} blocks of {block}")
        num_bytes = num_elements // block * block_bytes
        if offset != expected:
            raise cur.fail(f"tensor {name} starts at data offset {offset}; it must start at {expected} "
                           "(tensors lie in order, aligned)")
        start = data_offset + offset
        if num_bytes > cur.end - start:
            raise cur.fail(f"tensor {name} ({type_name}, shape {list(shape)}, {num_bytes} bytes at offset {start}) "
                           f"lies past the end of the file ({cur.end} bytes)")
        tensors[name] = TensorInfo(name, shape, ggml_type, start, num_bytes)
        expected = -(-(offset + num_bytes) // alignment) * alignment
    data_end = data_offset + (max((t.offset - data_offset + t.num_bytes for t in tensors.values()), default=0))
    if cur.end - data_end >= alignment:
        raise cur.fail(f"{cur.end - data_end} bytes follow the last tensor's data (at most the alignment's "
                       f"{alignment - 1} may): a tensor's type or shape does not match the data written")
    return tensors
