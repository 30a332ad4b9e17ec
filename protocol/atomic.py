"""Crash-safe writes: a file appears under its final name complete or not at all."""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path
from typing import IO, Iterator


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
