"""Crash-safe writes: a file appears under its final name complete or not at all."""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os
import sys
import tempfile
from pathlib import Path
from typing import IO, Callable, Iterator


@contextlib.contextmanager
def atomic_open(path: Path | str, mode: str = "wb", perms: int = 0o644) -> Iterator[IO]:
    """Open a temp file beside `path`; on clean exit fsync it and rename it over `path`, on error delete it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, mode) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, perms)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_bytes(path: Path | str, data: bytes) -> Path:
    """Write bytes atomically."""
    with atomic_open(path, "wb") as f:
        f.write(data)
    return Path(path)


def atomic_write_text(path: Path | str, text: str) -> Path:
    """Write text atomically."""
    with atomic_open(path, "w") as f:
        f.write(text)
    return Path(path)


class WriteBehind:
    """Keeps a file being appended to from piling up dirty pages, without stalling the writer: every
    `window` bytes it starts write-back of the newest window and waits only for the one before (Linux
    `sync_file_range`), so the final fsync has little left. Elsewhere it falls back to fdatasync. It is
    advisory: its errors are ignored, and durability still comes from the fsync before the rename."""

    _START, _WAIT = 2, 1 | 4  # SYNC_FILE_RANGE_WRITE; SYNC_FILE_RANGE_WAIT_BEFORE | WAIT_AFTER

    def __init__(self, fd: int, window: int = 16 << 20) -> None:
        self.fd, self.window = fd, window
        self._started = self._done = 0  # write-back started for [0, _started), finished for [0, _done)

    def advance(self, offset: int) -> None:
        """The file now holds `offset` bytes."""
        if offset - self._started < self.window:
            return
        if _sync_file_range is None:
            os.fdatasync(self.fd)
        else:
            _sync_file_range(self.fd, self._started, offset - self._started, self._START)
            if self._started > self._done:
                _sync_file_range(self.fd, self._done, self._started - self._done, self._START | self._WAIT)
        self._done, self._started = self._started, offset

    def reset(self, offset: int = 0) -> None:
        """The file was truncated to `offset` bytes."""
        self._started = self._done = offset


def _load_sync_file_range() -> Callable[[int, int, int, int], int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        fn = libc.sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_sync_file_range = _load_sync_file_range()
