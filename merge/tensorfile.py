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
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Iterator, Sequence

import torch

from skillswarm.protocol.errors import MergeError

MAX_HEADER_BYTES = 100 * 1024 * 1024  # the safetensors library's own limit

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


class TensorFile:
    """One safetensors file opened for positioned reads; thread-safe (pread keeps no file position)."""

    def __init__(self, path: Path | str) -> None:
        self.path = Path(path)
        try:
            self._fd = os.open(self.path, os.O_RDONLY)
        except OSError as e:
            raise MergeError(f"cannot open {self.path}: {e.strerror}") from None
        try:
            self.metadata, self.entries = self._parse_header()
        except BaseException:
            os.close(self._fd)
            raise

    def _parse_header(self) -> tuple[dict[str, str], dict[str, Entry]]:
        size = os.fstat(self._fd).st_size
        bad = f"{self.path} is not a safetensors file"
        if size < 8:
            raise MergeError(f"{bad} (only {size} bytes)")
        n = int.from_bytes(os.pread(self._fd, 8, 0), "little")
        if n > MAX_HEADER_BYTES or 8 + n > size:
            raise MergeError(f"{bad} (header length {n} does not fit in {size} bytes)")
        try:
            header = json.loads(os.pread(self._fd, n, 8))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise MergeError(f"{bad} (header is not JSON: {e})") from None
        if not isinstance(header, dict):
            raise MergeError(f"{bad} (header is not a JSON object)")
        metadata = header.pop("__metadata__", None) or {}
        if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
            raise MergeError(f"{bad} (__metadata__ must map names to strings)")
        base, entries = 8 + n, {}
        for name, info in header.items():
            try:
                dtype = DTYPES[info["dtype"]]
                shape = tuple(int(d) for d in info["shape"])
                start, end = (int(x) for x in info["data_offsets"])
            except (KeyError, TypeError, ValueError):
                raise MergeError(f"{bad} (tensor `{name}` has a malformed entry: {info!r})") from None
            expect = numel(shape) * dtype.itemsize
            if min(shape, default=0) < 0 or start < 0 or end - start != expect or base + end > size:
                raise MergeError(f"{self.path}: tensor `{name}` ({info['dtype']} {list(shape)}) has byte range "
                                 f"[{start}, {end}) that does not match its size or the file; the file is corrupt")
            entries[name] = Entry(dtype, shape, base + start, base + end)
        return metadata, entries

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
            raise MergeError(f"{self.path} has no tensor `{name}`") from None

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
