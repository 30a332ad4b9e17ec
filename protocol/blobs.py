"""The content store: files named by their sha256 in one directory (the cache dir by default).

A blob appears under its final name only complete and verified (hashed while copied to a temp file,
then renamed). Downloads in progress live in `.partial/` under the store, so an interrupted fetch
resumes from the bytes it already has.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import uuid
from pathlib import Path
from typing import Iterator

from skillswarm.protocol.atomic import atomic_open
from skillswarm.protocol.errors import BlobError
from skillswarm.protocol.hashing import CHUNK, sha256_file
from skillswarm.protocol.paths import cache_dir

_SHA256 = re.compile(r"^[0-9a-f]{64}$")


def check_sha256(sha: str) -> str:
    """Return `sha` if it is a lower-case sha256 hex digest; raise `BlobError` otherwise."""
    if not isinstance(sha, str) or not _SHA256.match(sha):
        raise BlobError(f"{sha!r} is not a sha256 digest (64 lower-case hex characters)")
    return sha


def default_blob_root() -> Path:
    """Where a node keeps its blobs unless told otherwise: `<cache dir>/blobs`."""
    return cache_dir() / "blobs"


class BlobStore:
    """Blobs on disk under `root`, each named by the sha256 of its bytes."""

    def __init__(self, root: Path | str | None = None) -> None:
        self.root = Path(root).expanduser() if root is not None else default_blob_root()
        self.root.mkdir(parents=True, exist_ok=True)

    def __repr__(self) -> str:
        return f"BlobStore({str(self.root)!r})"

    def path(self, sha: str) -> Path:
        """Where blob `sha` lives (whether or not it is here yet)."""
        return self.root / check_sha256(sha)

    def has(self, sha: str) -> bool:
        """Whether blob `sha` is complete in this store."""
        return self.path(sha).is_file()

    def size(self, sha: str) -> int:
        """The size of a blob this store holds; `BlobError` if it holds none."""
        try:
            return self.path(sha).stat().st_size
        except FileNotFoundError:
            raise BlobError(f"blob {sha[:12]} is not in {self.root}") from None

    def add_file(self, path: Path | str, *, move: bool = False, link: bool = False) -> str:
        """Hash a file into the store and return its sha256. `move=True` renames it in (same filesystem,
        no copy) instead of copying it; the source is then gone. `link=True` hard-links it in (same
        filesystem; for files that are only ever replaced, never modified in place, like checkpoints)."""
        src = Path(path)
        if not src.is_file():
            raise BlobError(f"{src} is not a file")
        same_fs = os.stat(src).st_dev == os.stat(self.root).st_dev
        if link and same_fs:
            sha = sha256_file(src)
            if not self.has(sha):
                try:
                    os.link(src, self.path(sha))
                except FileExistsError:
                    pass
            return sha
        if move and same_fs:
            sha = sha256_file(src)
            if self.has(sha):
                src.unlink()
            else:
                os.chmod(src, 0o644)
                os.replace(src, self.path(sha))
            return sha
        # The name is known only after hashing: copy to a unique staging name atomically, then rename.
        staging = self.root / ".partial" / f"add-{uuid.uuid4().hex}"
        h = hashlib.sha256()
        try:
            with open(src, "rb") as fin, atomic_open(staging, "wb") as fout:
                while block := fin.read(CHUNK):
                    h.update(block)
                    fout.write(block)
            sha = h.hexdigest()
            if self.has(sha):
                staging.unlink()
            else:
                os.replace(staging, self.path(sha))
        finally:
            staging.unlink(missing_ok=True)
        if move:
            src.unlink(missing_ok=True)
        return sha

    def add_bytes(self, data: bytes) -> str:
        """Store bytes and return their sha256."""
        sha = hashlib.sha256(data).hexdigest()
        if not self.has(sha):
            with atomic_open(self.path(sha), "wb") as f:
                f.write(data)
        return sha

    def verify(self, sha: str) -> bool:
        """Re-hash a stored blob; a blob that no longer matches its name is removed (and False returned)."""
        path = self.path(sha)
        if not path.is_file():
            return False
        if sha256_file(path) == sha:
            return True
        path.unlink(missing_ok=True)
        return False

    def remove(self, sha: str) -> None:
        """Delete a blob (no error if absent)."""
        self.path(sha).unlink(missing_ok=True)

    def export(self, sha: str, dest: Path | str) -> Path:
        """Copy a blob out of the store to `dest` (atomically)."""
        with open(self.path(sha), "rb") as fin, atomic_open(dest, "wb") as fout:
            shutil.copyfileobj(fin, fout, CHUNK)
        return Path(dest)

    def __iter__(self) -> Iterator[str]:
        """The sha256 of every complete blob in the store."""
        return iter(sorted(p.name for p in self.root.iterdir() if _SHA256.match(p.name) and p.is_file()))

    def partial_path(self, sha: str) -> Path:
        """Where an in-progress download of `sha` accumulates (resumed from its size)."""
        return self.root / ".partial" / f"{check_sha256(sha)}.part"
