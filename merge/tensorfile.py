"""Safetensors files read by positioned reads and written as a stream.

Why not `safetensors.safe_open`: it memory-maps the file, and every page a merge touches stays in the
process's resident set until the map is closed, so merging 8 deltas of a 1 GB model would show ~9 GB
RSS. `os.pread` copies just the rows asked for and leaves the page cache to the kernel. The writer puts
the header first (the layout is known in advance) and then each tensor's bytes in order, so a shard of
any size is written with one chunk in memory, and the file's sha256 is computed on the way.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Iterator, Sequence

import torch

from skillswarm.protocol.errors import MergeError

MAX_HEADER_BYTES = 100 * 1024 * 1024  # the safetensors library's own limit
MAX_JSON_DEPTH = 16  # a safetensors header nests 3 deep, a delta's metadata JSON at most 3
MAX_DIMS = 32  # dimensions of one tensor
MAX_DIM = 1 << 48  # elements along one dimension (no file holds more bytes than this)
MAX_INT_CHARS = 20  # digits (and sign) of a JSON integer: offsets fit in 63 bits

DTYPES: dict[str, torch.dtype] = {
    "BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16, "U16": torch.uint16,
    "I32": torch.int32, "U32": torch.uint32, "I64": torch.int64, "U64": torch.uint64,
    "F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32, "F64": torch.float64,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
DTYPE_NAMES: dict[torch.dtype, str] = {v: k for k, v in DTYPES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    """The safetensors name of a torch dtype ("F32", "BF16", ...)."""
    try:
        return DTYPE_NAMES[dtype]
    except KeyError:
        raise MergeError(f"dtype {dtype} cannot be stored in safetensors") from None


def numel(shape: Sequence[int]) -> int:
    """Number of elements of a shape (1 for a scalar)."""
    return math.prod(shape)


@dataclass(frozen=True)
class Entry:
    """Where one tensor lies in a file: dtype, shape and absolute byte range."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int
    end: int

    @property
    def rows(self) -> int:
        """Length of dim 0 (a scalar counts as one row)."""
        return self.shape[0] if self.shape else 1

    @property
    def row_bytes(self) -> int:
        """Bytes of one row along dim 0."""
        return (self.end - self.start) // self.rows if self.rows else 0


class _Refused(ValueError):
    """A JSON value the bounded parser does not accept (raised from its hooks)."""


# a JSON string, or an unterminated one up to the end: every match attempt at a quote succeeds, so the scan is
# linear (a pattern that can fail there rescans the rest of the text from each escaped quote: quadratic)
_JSON_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*(?:"|\\?\Z)', re.DOTALL)
_NOT_BRACKET = re.compile(r"[^\[\]{}]+")


def json_depth_ok(text: str, max_depth: int = MAX_JSON_DEPTH) -> bool:
    """Whether JSON text's brackets balance and nest at most `max_depth` deep (text nesting up to twice that may
    pass), checked in linear time without recursion before a recursive parser sees it: strings dropped, then
    each pass deletes the empty pairs, at least one level. Where text is not JSON the answer may be wrong, but
    only past the point where a JSON parser stops with an error."""
    s = _NOT_BRACKET.sub("", _JSON_STRING.sub("", text))
    for _ in range(max_depth):
        if not s:
            return True
        s = s.replace("[]", "").replace("{}", "")
    return not s


def _refuse_constant(name: str) -> Any:
    raise _Refused(f"{name} is not a number JSON allows")


def _bounded_int(text: str) -> int:
    if len(text) > MAX_INT_CHARS:
        raise _Refused(f"integer {text[:24]}... is too large")
    return int(text)


def _finite_float(text: str) -> float:
    x = float(text)
    if not math.isfinite(x):
        raise _Refused(f"number {text[:24]} is not finite")
    return x


def _no_float(text: str) -> Any:
    raise _Refused(f"number {text[:24]} is not an integer")


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise _Refused(f"key {k[:64]!r} appears twice")
        out[k] = v
    return out


def parse_json(data: str | bytes, what: str, *, floats: bool = True, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """Parse untrusted JSON within bounds (UTF-8, nesting depth, integer size, finite numbers, no duplicate
    keys; `floats` False: integers only), so a hostile file gets a MergeError naming `what`, never an
    OverflowError or RecursionError from deeper code."""
    try:
        text = data.decode("utf-8") if isinstance(data, (bytes, bytearray)) else data
    except UnicodeDecodeError as e:
        raise MergeError(f"{what} is not UTF-8 text ({e.reason} at byte {e.start})") from None
    if not json_depth_ok(text, max_depth):
        raise MergeError(f"{what} is not JSON nested at most {max_depth} deep (brackets nest deeper or do not match)")
    try:
        return json.loads(text, parse_constant=_refuse_constant, parse_int=_bounded_int,
                          parse_float=_finite_float if floats else _no_float, object_pairs_hook=_unique_keys)
    except _Refused as e:
        raise MergeError(f"{what}: {e}") from None
    except (ValueError, RecursionError) as e:
        raise MergeError(f"{what} is not JSON: {e}") from None


def shown(text: str, chars: int = 200) -> str:
    """A name from an untrusted file as a message shows it: at most `chars` characters on one line, control
    characters and lone surrogates escaped (so the message stays one line and encodes as UTF-8)."""
    if not text.isprintable():  # escapes only lengthen text: its first `chars` characters are enough
        text = "".join(c if c.isprintable() else c.encode("unicode_escape", "backslashreplace").decode("ascii")
                       for c in text[:chars])
    return text if len(text) <= chars else text[:chars - 3] + "..."


def is_int(x: object) -> bool:
    """A JSON integer (bool is not one)."""
    return isinstance(x, int) and not isinstance(x, bool)


def parse_header(raw: bytes, data_size: int, where: str) -> tuple[dict[str, str], dict[str, Entry]]:
    """Validate a safetensors header (its JSON bytes) against the `data_size` bytes that follow it: metadata a
    str -> str map, every dtype known, shapes and offsets in range, tensors tiling the data exactly (as the
    reference reader requires). Entries' offsets are relative to the data. MergeError for anything else."""
    bad = f"{where} is not a safetensors file"
    header = parse_json(raw, f"{bad}: its header", floats=False)
    if not isinstance(header, dict):
        raise MergeError(f"{bad} (header is not a JSON object)")
    metadata = header.pop("__metadata__", None)
    metadata = {} if metadata is None else metadata
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise MergeError(f"{bad} (__metadata__ must map names to strings)")
    entries: dict[str, Entry] = {}
    for name, info in header.items():
        entry = _entry(info)
        if isinstance(entry, str):
            raise MergeError(f"{bad} (tensor `{shown(name)}`: {entry}; its entry is {_clip(info, 120)})")
        if entry.end - entry.start != numel(entry.shape) * entry.dtype.itemsize:
            raise MergeError(f"{where}: tensor `{shown(name)}` ({info['dtype']} {list(entry.shape)}) has byte range "
                             f"[{entry.start}, {entry.end}) that does not match its size; the file is corrupt")
        entries[name] = entry
    end = 0
    for name, e in sorted(entries.items(), key=lambda kv: (kv[1].start, kv[1].end)):
        if e.start != end:
            raise MergeError(f"{where}: tensor `{shown(name)}` starts at data byte {e.start}, not where the previous "
                             f"one ends ({end}): tensors overlap or leave a gap; the file is corrupt")
        end = e.end
    if end != data_size:
        raise MergeError(f"{where}: its tensors end at data byte {end} but the file holds {data_size} data bytes "
                         "(truncated or padded); the file is corrupt")
    return metadata, entries


def _entry(info: object) -> Entry | str:
    """One header entry as an Entry (offsets relative to the data), or what is wrong with it."""
    if not isinstance(info, dict):
        return "an entry must be an object with dtype, shape and data_offsets"
    dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if not isinstance(dtype, str) or dtype not in DTYPES:
        return "no dtype" if dtype is None else f"unknown dtype {_clip(dtype, 40)}"
    if not isinstance(shape, list) or len(shape) > MAX_DIMS or not all(is_int(d) and 0 <= d <= MAX_DIM for d in shape):
        return f"shape must be a list of at most {MAX_DIMS} integers in [0, 2^48]"
    if (not isinstance(offsets, list) or len(offsets) != 2 or not all(is_int(x) and 0 <= x < 1 << 63 for x in offsets)
            or offsets[0] > offsets[1]):
        return "data_offsets must be two integers 0 <= begin <= end < 2^63"
    return Entry(DTYPES[dtype], tuple(shape), offsets[0], offsets[1])


def _clip(value: object, chars: int = 200) -> str:
    text = repr(value)
    return text if len(text) <= chars else text[:chars - 3] + "..."


class TensorFile:
    """One safetensors file opened for positioned reads; thread-safe (pread keeps no file position)."""

    def __init__(self, path: Path | str) -> None:
        self.path = Path(path)
        self._fd = -1
        try:
            self._fd = os.open(self.path, os.O_RDONLY)
        except OSError as e:
            raise MergeError(f"cannot open {self.path}: {e.strerror}") from None
        try:
            self.metadata, self.entries = self._parse_header()
        except BaseException:
            self.close()  # and forget the number: __del__ closing it again would close whatever file reuses it
            raise

    def _parse_header(self) -> tuple[dict[str, str], dict[str, Entry]]:
        size = os.fstat(self._fd).st_size
        bad = f"{self.path} is not a safetensors file"
        if size < 8:
            raise MergeError(f"{bad} (only {size} bytes)")
        n = int.from_bytes(os.pread(self._fd, 8, 0), "little")
        if n > MAX_HEADER_BYTES or 8 + n > size:
            raise MergeError(f"{bad} (header length {n} does not fit in {size} bytes)")
        raw = os.pread(self._fd, n, 8)
        if len(raw) != n:
            raise MergeError(f"{self.path} ended early (truncated while reading?)")
        metadata, entries = parse_header(raw, size - 8 - n, str(self.path))
        base = 8 + n
        return metadata, {k: Entry(e.dtype, e.shape, base + e.start, base + e.end) for k, e in entries.items()}

    def keys(self) -> list[str]:
        """Tensor names, in the file's order."""
        return list(self.entries)

    def __contains__(self, name: object) -> bool:
        return name in self.entries

    def entry(self, name: str) -> Entry:
        """The entry of a tensor (MergeError if absent)."""
        try:
            return self.entries[name]
        except KeyError:
            raise MergeError(f"{self.path} has no tensor `{shown(name)}`") from None

    def _read(self, offset: int, nbytes: int, dtype: torch.dtype) -> torch.Tensor:
        buf = torch.empty(nbytes, dtype=torch.uint8)
        view, done = memoryview(buf.numpy()), 0
        while done < nbytes:
            got = os.preadv(self._fd, [view[done:]], offset + done)
            if got <= 0:
                raise MergeError(f"{self.path} ended early (truncated while reading?)")
            done += got
        return buf.view(dtype)

    def read(self, name: str) -> torch.Tensor:
        """A whole tensor (a fresh, writable copy)."""
        e = self.entry(name)
        return self._read(e.start, e.end - e.start, e.dtype).reshape(e.shape)

    def read_rows(self, name: str, r0: int, r1: int) -> torch.Tensor:
        """Rows [r0, r1) along dim 0 (a scalar has the one row [0, 1) and comes back 0-d)."""
        e = self.entry(name)
        if not e.shape:
            return self.read(name)
        r0, r1 = max(0, r0), min(r1, e.rows)
        return self._read(e.start + r0 * e.row_bytes, max(0, r1 - r0) * e.row_bytes, e.dtype).reshape(
            (max(0, r1 - r0), *e.shape[1:]))

    def read_flat(self, name: str, i0: int, i1: int) -> torch.Tensor:
        """Elements [i0, i1) of the flattened tensor."""
        e = self.entry(name)
        size = e.dtype.itemsize
        i0, i1 = max(0, i0), min(i1, numel(e.shape))
        return self._read(e.start + i0 * size, max(0, i1 - i0) * size, e.dtype)

    def close(self) -> None:
        """Release the file descriptor."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> "TensorFile":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass


Layout = Sequence[tuple[str, torch.dtype, Sequence[int]]]


class TensorFileWriter:
    """Streams a safetensors file into an open binary file: the header now, then each tensor's bytes in
    layout order (one or more `write` calls per tensor). `close` checks that every byte arrived."""

    def __init__(self, f: IO[bytes], layout: Layout, metadata: dict[str, str] | None = None) -> None:
        header: dict[str, object] = {"__metadata__": dict(metadata)} if metadata else {}
        offset = 0
        self._sizes: list[tuple[str, int]] = []
        for name, dtype, shape in layout:
            size = numel(shape) * dtype.itemsize
            header[name] = {"dtype": dtype_name(dtype), "shape": list(shape), "data_offsets": [offset, offset + size]}
            self._sizes.append((name, size))
            offset += size
        raw = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
        raw += b" " * (-(8 + len(raw)) % 8)  # data starts 8-byte aligned, as the reference writer does
        self._f, self.sha = f, hashlib.sha256()
        self.size = 0
        self._emit(len(raw).to_bytes(8, "little") + raw)
        self._next: Iterator[tuple[str, int]] = iter(self._sizes)
        self._name, self._left = "", 0
        self._advance()

    def _emit(self, data: bytes | memoryview) -> None:
        self._f.write(data)
        self.sha.update(data)
        self.size += len(data)

    def _advance(self) -> None:
        while self._left == 0:
            nxt = next(self._next, None)
            if nxt is None:
                self._name = ""
                return
            self._name, self._left = nxt

    def write(self, name: str, chunk: torch.Tensor) -> None:
        """Append the next bytes of tensor `name` (a chunk of its rows, in order)."""
        if chunk.numel() == 0:
            return
        if name != self._name:
            raise MergeError(f"internal: wrote `{name}` while `{self._name or '(end)'}` was expected")
        data = memoryview(chunk.detach().contiguous().reshape(-1).view(torch.uint8).numpy())
        if len(data) > self._left:
            raise MergeError(f"internal: `{name}` got {len(data)} bytes, only {self._left} left")
        self._emit(data)
        self._left -= len(data)
        self._advance()

    def close(self) -> tuple[str, int]:
        """Check completeness; return the file's (sha256, size)."""
        if self._name:
            raise MergeError(f"internal: file closed before `{self._name}` was written in full")
        return self.sha.hexdigest(), self.size


def row_chunks(shape: Sequence[int], chunk_elems: int) -> list[tuple[int, int]]:
    """Split dim 0 into row ranges of at most `chunk_elems` elements (at least one row each); a scalar is
    one row, an empty tensor one empty range. The merge works chunk by chunk, so this bounds its memory."""
    rows = shape[0] if shape else 1
    if rows == 0:
        return [(0, 0)]
    per = max(1, chunk_elems // max(1, numel(shape[1:]) if shape else 1))
    return [(r, min(r + per, rows)) for r in range(0, rows, per)]
