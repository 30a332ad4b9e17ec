"""The content store: files named by their sha256 in one directory (the cache dir by default).

A blob appears under its final name only complete and verified (hashed while copied to a temp file,
then renamed). Downloads in progress live in `.partial/` under the store (`PartialDownload`: locked,
hashed as it grows), so an interrupted fetch resumes from the bytes it already has; a download from
several providers writes verified pieces in place instead (`pieces`, `swarm`) and keeps its piece list
beside the partial file. Each blob's piece list is cached in `.pieces/` for serving. A store may be capped
(`max_bytes`): a blob is refused before its first byte is written unless it fits under the cap and leaves
the filesystem a margin free; `prune` and `remove` make room.

Nothing is taken as good for being on disk: `has` (which every use of a stored blob goes through) checks the
blob's size on every call and its sha256 once per process while its size and mtime stay the same
(`file_problem`), and deletes a blob that fails, so it is fetched again and never served or announced.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import stat
import re
import shutil
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Iterable, Iterator

from skillswarm.protocol.atomic import WriteBehind, atomic_open, atomic_write_bytes
from skillswarm.protocol.errors import BlobError
from skillswarm.protocol.hashing import CHUNK, sha256_file
from skillswarm.protocol.paths import cache_dir
from skillswarm.protocol.transport.pieces import (
    DIGEST, PIECE_SIZE, file_pieces, held_pieces, piece_count, tree_hash,
)

_SHA256 = re.compile(r"^[0-9a-f]{64}$")
SYNC_EVERY = 16 << 20  # bytes a download appends between write-back steps

# After any write the filesystem keeps this much free, or this fraction of it if that is smaller.
FS_MARGIN_BYTES = 1 << 30
FS_MARGIN_FRACTION = 0.05

# Room promised to downloads in progress in this process: (store root, sha) -> blob size. Concurrent
# downloads each check against the others' promises, so together they cannot overrun a cap.
_reserved: dict[tuple[str, str], int] = {}
_reserved_lock = threading.Lock()

log = logging.getLogger(__name__)

# Files this process has hashed (or written from hashed bytes) and found to be their blob:
# (st_dev, st_ino) -> (size, mtime_ns, sha256). Keyed by the file, not its name, so hard links (a checkpoint's
# files and the blobs they were linked from) share one check; a change of size or mtime means hashing again.
_checked: dict[tuple[int, int], tuple[int, int, str]] = {}
_hashing: dict[tuple[int, int], threading.Lock] = {}  # one hash of a file at a time: waiting callers reuse it
_checked_lock = threading.Lock()


def file_problem(path: Path | str, sha: str, size: int | None = None) -> str | None:
    """What is wrong with the file at `path` as blob `sha` (of `size` bytes when given), or None if nothing.
    Rule: the size is checked on every call, the sha256 once per process while the file's (device, inode,
    size, mtime_ns) stay the same, so a multi-GB blob is not re-hashed on every access. FileNotFoundError if absent."""
    st = os.stat(path)
    if not stat.S_ISREG(st.st_mode):
        return "it is not a regular file"
    if size is not None and st.st_size != size:
        return f"it is {st.st_size:,} bytes, not {size:,}"
    key, seen = (st.st_dev, st.st_ino), (st.st_size, st.st_mtime_ns, sha)
    if _checked.get(key) == seen:
        return None
    with _checked_lock:
        lock = _hashing.setdefault(key, threading.Lock())
    with lock:
        if _checked.get(key) == seen:  # hashed meanwhile by another caller
            return None
        got = sha256_file(path)
        if got != sha:
            return f"its bytes hash to {got[:12]}, not {sha[:12]}"
        _checked[key] = seen
    return None


def remember(path: Path | str, sha: str) -> None:
    """Note that the file at `path` holds exactly the bytes of blob `sha` (just hashed and written by this
    process), so `file_problem` need not hash it again while it is unchanged."""
    with contextlib.suppress(OSError):
        st = os.stat(path)
        _checked[(st.st_dev, st.st_ino)] = (st.st_size, st.st_mtime_ns, sha)


def known_sha(path: Path | str) -> str | None:
    """The sha256 this process found the file at `path` to have, while unchanged since; None if not checked."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    seen = _checked.get((st.st_dev, st.st_ino))
    return seen[2] if seen is not None and seen[:2] == (st.st_size, st.st_mtime_ns) else None


def check_sha256(sha: str) -> str:
    """Return `sha` if it is a lower-case sha256 hex digest; raise `BlobError` otherwise."""
    if not isinstance(sha, str) or not _SHA256.match(sha):
        raise BlobError(f"{sha!r} is not a sha256 digest (64 lower-case hex characters)")
    return sha


def default_blob_root() -> Path:
    """Where a node keeps its blobs unless told otherwise: `<cache dir>/blobs`."""
    return cache_dir() / "blobs"


class BlobStore:
    """Blobs on disk under `root`, each named by the sha256 of its bytes; at most `max_bytes` of them
    (complete blobs plus partial downloads) when a cap is given."""

    def __init__(self, root: Path | str | None = None, max_bytes: int | None = None) -> None:
        if max_bytes is not None and (isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 0):
            raise BlobError(f"max_bytes={max_bytes!r}: give the store's cap in bytes (a whole number), or None for none")
        self.root = Path(root).expanduser() if root is not None else default_blob_root()
        self.root.mkdir(parents=True, exist_ok=True)
        self.max_bytes = max_bytes

    def __repr__(self) -> str:
        cap = f", max_bytes={self.max_bytes}" if self.max_bytes is not None else ""
        return f"BlobStore({str(self.root)!r}{cap})"

    def path(self, sha: str) -> Path:
        """Where blob `sha` lives (whether or not it is here yet)."""
        return self.root / check_sha256(sha)

    def has(self, sha: str, size: int | None = None) -> bool:
        """Whether blob `sha` (of `size` bytes when given) is complete and intact in this store (`file_problem`'s
        rule); a bad one is deleted with a warning and counts as absent, so it is fetched again."""
        path = self.path(sha)
        try:
            problem = file_problem(path, sha, size)
        except FileNotFoundError:
            return False
        if problem is None:
            return True
        log.warning("blob %s in %s is bad (%s): deleted, to be fetched again", sha[:12], self.root, problem)
        if path.is_file():
            path.unlink(missing_ok=True)
        self.pieces_path(sha).unlink(missing_ok=True)
        return False

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
        size = src.stat().st_size
        same_fs = os.stat(src).st_dev == os.stat(self.root).st_dev
        if link and same_fs:
            sha = known_sha(src) or sha256_file(src)
            if not self.has(sha, size):
                self.check_room(size, sha, new_disk_bytes=False)
                try:
                    os.link(src, self.path(sha))
                    remember(self.path(sha), sha)
                except FileExistsError:
                    pass
            return sha
        if move and same_fs:
            sha = known_sha(src) or sha256_file(src)
            if self.has(sha, size):
                src.unlink()
            else:
                self.check_room(size, sha, new_disk_bytes=False)
                os.chmod(src, 0o644)
                os.replace(src, self.path(sha))
                remember(self.path(sha), sha)
            return sha
        # The name is known only after hashing: copy to a unique staging name atomically, then rename.
        self.check_room(size)
        staging = self.root / ".partial" / f"add-{uuid.uuid4().hex}"
        h = hashlib.sha256()
        try:
            with open(src, "rb") as fin, atomic_open(staging, "wb") as fout:
                while block := fin.read(CHUNK):
                    h.update(block)
                    fout.write(block)
            sha = h.hexdigest()
            if self.has(sha, size):
                staging.unlink()
            else:
                os.replace(staging, self.path(sha))
                remember(self.path(sha), sha)
        finally:
            staging.unlink(missing_ok=True)
        if move:
            src.unlink(missing_ok=True)
        return sha

    def add_bytes(self, data: bytes) -> str:
        """Store bytes and return their sha256."""
        sha = hashlib.sha256(data).hexdigest()
        if not self.has(sha, len(data)):
            self.check_room(len(data), sha)
            with atomic_open(self.path(sha), "wb") as f:
                f.write(data)
            remember(self.path(sha), sha)
        return sha

    def verify(self, sha: str) -> bool:
        """Re-hash a stored blob (whatever this process checked before); a blob that no longer matches its name
        is removed with a warning (and False returned)."""
        path = self.path(sha)
        if not path.is_file():
            return False
        got = sha256_file(path)
        if got == sha:
            remember(path, sha)
            return True
        log.warning("blob %s in %s is bad (its bytes hash to %s): deleted, to be fetched again", sha[:12], self.root,
                    got[:12])
        path.unlink(missing_ok=True)
        self.pieces_path(sha).unlink(missing_ok=True)
        return False

    def remove(self, sha: str) -> None:
        """Delete a blob and any partial download of it (no error if absent); a partial download that a
        fetch is writing right now stays."""
        self.path(sha).unlink(missing_ok=True)
        self.pieces_path(sha).unlink(missing_ok=True)
        part = self.partial_path(sha)
        try:
            f = open(part, "rb")
        except FileNotFoundError:
            return
        with f:
            try:
                fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)  # the lock a fetch holds while it writes
            except BlockingIOError:
                return
            part.unlink(missing_ok=True)
            partial_pieces_path(part).unlink(missing_ok=True)

    def prune(self, keep: Iterable[str]) -> int:
        """Delete every complete blob whose sha256 is not in `keep` and return the bytes freed (partial
        downloads stay: `remove` deletes those)."""
        if isinstance(keep, str):
            raise BlobError("prune takes a collection of sha256 digests to keep, not one string (pass [sha])")
        kept = set(keep)
        freed = 0
        for sha in self:
            if sha in kept:
                continue
            path = self.path(sha)
            try:
                size = path.stat().st_size
                path.unlink()
            except FileNotFoundError:  # removed meanwhile
                continue
            self.pieces_path(sha).unlink(missing_ok=True)
            freed += size
        return freed

    def usage(self) -> int:
        """Bytes this store takes: complete blobs plus partial downloads and files being added."""
        total = 0
        for folder in (self.root, self.root / ".partial"):
            try:
                entries = os.scandir(folder)
            except FileNotFoundError:
                continue
            with entries:
                for entry in entries:
                    with contextlib.suppress(OSError):  # renamed or removed meanwhile
                        if entry.is_file(follow_symlinks=False):
                            total += held_bytes(entry.stat(follow_symlinks=False))
        return total

    def check_room(self, size: int, sha: str | None = None, *, new_disk_bytes: bool = True) -> None:
        """Raise `BlobError` unless `size` more bytes (of blob `sha`, whose partial download already counts)
        fit under the cap and leave the filesystem its margin (`new_disk_bytes=False`: a rename or hard
        link, which takes no new disk space)."""
        with _reserved_lock:
            self._check_room(size, sha, new_disk_bytes)

    @contextlib.contextmanager
    def reserve(self, sha: str, size: int) -> Iterator[None]:
        """Check that blob `sha` of `size` bytes fits (`check_room`) and hold that room for it until the
        block ends, so concurrent downloads in this process cannot together overrun the cap."""
        key = (str(self.root), check_sha256(sha))
        with _reserved_lock:
            self._check_room(size, sha, True)
            _reserved[key] = size
        try:
            yield
        finally:
            with _reserved_lock:
                _reserved.pop(key, None)

    def _check_room(self, size: int, sha: str | None, new_disk_bytes: bool) -> None:
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise BlobError(f"a blob size must be a whole number of bytes, not {size!r}")
        what = f"blob {sha[:12]} ({size:,} bytes)" if sha else f"a blob of {size:,} bytes"
        need = max(0, size - self._partial_bytes(sha)) + self._promised(besides=sha)
        if self.max_bytes is not None:
            usage = self.usage()
            if usage + need > self.max_bytes:
                raise BlobError(
                    f"{what} does not fit in the blob store {self.root}: it holds {usage:,} bytes (complete blobs "
                    f"and partial downloads) of its {self.max_bytes:,}-byte cap; raise the cap "
                    "(BlobStore(root, max_bytes=...)) or make room (BlobStore.prune(keep) or BlobStore.remove(sha))")
        if new_disk_bytes:
            disk = shutil.disk_usage(self.root)
            margin = min(FS_MARGIN_BYTES, int(disk.total * FS_MARGIN_FRACTION))
            if disk.free - need < margin:
                raise BlobError(
                    f"{what} does not fit on the disk of the blob store {self.root}: {disk.free:,} bytes are free and "
                    f"{margin:,} must stay free after the write; free disk space, prune the store, or put it on "
                    "another disk (BlobStore(root=...))")

    def _partial_bytes(self, sha: str | None) -> int:
        try:
            return held_bytes(self.partial_path(sha).stat()) if sha else 0
        except FileNotFoundError:
            return 0

    def _promised(self, besides: str | None) -> int:
        """Bytes promised to other downloads into this store still to arrive (the caller holds the lock)."""
        root = str(self.root)
        return sum(max(0, size - self._partial_bytes(sha)) for (r, sha), size in _reserved.items()
                   if r == root and sha != besides)

    def export(self, sha: str, dest: Path | str) -> Path:
        """Copy an intact blob (`has`) out of the store to `dest` (atomically); `BlobError` if it is absent or bad."""
        if not self.has(sha):
            raise BlobError(f"blob {sha[:12]} is not in {self.root} (or was bad and is deleted); fetch it again")
        with open(self.path(sha), "rb") as fin, atomic_open(dest, "wb") as fout:
            shutil.copyfileobj(fin, fout, CHUNK)
        return Path(dest)

    def __iter__(self) -> Iterator[str]:
        """The sha256 of every complete blob in the store."""
        return iter(sorted(p.name for p in self.root.iterdir() if _SHA256.match(p.name) and p.is_file()))

    def partial_path(self, sha: str) -> Path:
        """Where an in-progress download of `sha` accumulates (resumed from its size)."""
        return self.root / ".partial" / f"{check_sha256(sha)}.part"

    def pieces_path(self, sha: str) -> Path:
        """Where the piece list of blob `sha` is cached (see `pieces`)."""
        return self.root / ".pieces" / check_sha256(sha)

    def pieces(self, sha: str) -> bytes:
        """The piece list of a blob this store holds: cached, else computed from the blob and cached."""
        size = self.size(sha)
        try:
            cached = self.pieces_path(sha).read_bytes()
            if len(cached) == piece_count(size) * DIGEST:
                return cached
        except FileNotFoundError:
            pass
        data = file_pieces(self.path(sha))
        self.save_pieces(sha, data)
        return data

    def save_pieces(self, sha: str, piece_list: bytes) -> None:
        """Cache the (verified) piece list of blob `sha`."""
        atomic_write_bytes(self.pieces_path(sha), piece_list)

    def tree(self, sha: str) -> str:
        """The tree hash of a blob this store holds (what a publisher puts in `FileEntry.tree`)."""
        return tree_hash(self.pieces(sha))


def partial_pieces_path(part: Path) -> Path:
    """Where a download from several providers keeps its verified piece list, beside its partial file; its
    presence also says the partial file was written piece by piece (it may have holes)."""
    return part.with_suffix(".pieces")


def range_digests(path: Path, ranges: Iterable[tuple[int, int]]) -> list[str]:
    """The sha256 of each byte range [start, end) of the file at `path`: what a fetcher compares to tell
    which provider of a download that failed verification sent the bytes that differ."""
    digests = []
    with open(path, "rb") as f:
        for start, end in ranges:
            f.seek(start)
            h, left = hashlib.sha256(), end - start
            while left > 0 and (block := f.read(min(CHUNK, left))):
                h.update(block)
                left -= len(block)
            digests.append(h.hexdigest())
    return digests


def held_bytes(st: os.stat_result) -> int:
    """The bytes a file really holds on disk: a partial file written piece by piece may have holes."""
    return min(st.st_size, st.st_blocks * 512) if hasattr(st, "st_blocks") else st.st_size


class PartialDownload:
    """The download in progress: appended and hashed as bytes arrive, resumable, and locked (flock)
    against a second fetcher of the same blob in any process."""

    def __init__(self, path: Path, file: Any) -> None:
        self.path, self.file = path, file
        self.hasher, self.offset = hashlib.sha256(), 0
        self._writeback = WriteBehind(file.fileno(), SYNC_EVERY)

    @classmethod
    def open(cls, path: Path, final: Path, wait_s: float) -> PartialDownload | None:
        """Lock and open the partial file, hashing what it already holds; None if the blob appeared meanwhile."""
        path.parent.mkdir(parents=True, exist_ok=True)
        deadline = time.monotonic() + wait_s
        while not final.is_file():
            f = open(path, "a+b", buffering=0)
            try:
                fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                f.close()
                if time.monotonic() > deadline:
                    raise BlobError(f"another fetch of blob {final.name[:12]} holds {path}; try again later") from None
                time.sleep(0.2)
                continue
            if final.is_file():  # finished by the fetcher that held the lock
                f.close()
                return None
            part = cls(path, f)
            _keep_intact_prefix(f, path)
            f.seek(0)
            while block := f.read(CHUNK):
                part.hasher.update(block)
                part.offset += len(block)
            part._writeback.reset(part.offset)
            return part
        return None

    def append(self, data: memoryview) -> None:
        self.hasher.update(data)
        while data:
            data = data[self.file.write(data):]
        self.offset = self.file.tell()
        self._writeback.advance(self.offset)  # write back as we go: the final fsync has little left

    def reset(self) -> None:
        """Throw every byte away (they failed verification)."""
        self.file.truncate(0)
        self.hasher, self.offset = hashlib.sha256(), 0
        self._writeback.reset()

    def publish(self, final: Path) -> None:
        """Make the verified file durable and give it its final name."""
        os.fsync(self.file.fileno())
        os.chmod(self.path, 0o644)
        os.replace(self.path, final)
        remember(final, self.hasher.hexdigest())

    def close(self, *, remove: bool = False) -> None:
        self.file.close()
        if remove:
            self.path.unlink(missing_ok=True)


def _keep_intact_prefix(f: Any, part: Path) -> None:
    """A partial file written piece by piece (its piece list beside it) may have holes: an appending download
    keeps only the pieces that are intact from its start, and the file becomes an ordinary prefix."""
    listed = partial_pieces_path(part)
    try:
        piece_list = listed.read_bytes()
    except FileNotFoundError:
        return
    length = min(os.fstat(f.fileno()).st_size, len(piece_list) // DIGEST * PIECE_SIZE)
    have = held_pieces(f.fileno(), length, piece_list)  # a cut last piece counts only if it is the blob's end
    keep = next((i for i, ok in enumerate(have) if not ok), len(have)) * PIECE_SIZE
    f.truncate(min(keep, length))
    listed.unlink(missing_ok=True)
