"""Pieces: a blob cut into fixed-size pieces, each with its sha256, so a download from several providers can
check every piece on arrival and blame the one provider that sent a bad one.

A blob's *piece list* is the concatenation of its pieces' sha256 digests (32 bytes each, PIECE_SIZE bytes a
piece, the last one shorter). Its *tree hash* is the sha256 of that list behind a prefix naming the piece
size; records carry the tree hash (`FileEntry.tree`), never the list, which a provider sends on request and
the fetcher checks against the tree hash before trusting it (`check_piece_list`).
"""

from __future__ import annotations

import errno
import hashlib
import os
from pathlib import Path

PIECE_SIZE = 4 << 20  # bytes per piece: the unit of verification, of resumption, and of a request
DIGEST = 32  # bytes per piece digest (sha256)
_PREFIX = f"skillswarm/pieces/{PIECE_SIZE}\n".encode()


def piece_count(size: int) -> int:
    """How many pieces a blob of `size` bytes has."""
    return -(-size // PIECE_SIZE)


def piece_span(index: int, size: int) -> tuple[int, int]:
    """The bytes [start, end) of piece `index` of a blob of `size` bytes."""
    start = index * PIECE_SIZE
    return start, min(size, start + PIECE_SIZE)


def tree_hash(piece_list: bytes) -> str:
    """The tree hash of a piece list (hex)."""
    return hashlib.sha256(_PREFIX + piece_list).hexdigest()


def file_pieces(path: Path | str) -> bytes:
    """The piece list of a file, read one piece at a time."""
    out = bytearray()
    with open(path, "rb", buffering=0) as f:
        buf = bytearray(PIECE_SIZE)
        while n := f.readinto(buf):
            out += hashlib.sha256(memoryview(buf)[:n]).digest()
    return bytes(out)


def tree_of_file(path: Path | str) -> str:
    """The tree hash of a file (what a publisher puts in `FileEntry.tree`)."""
    return tree_hash(file_pieces(path))


def check_piece_list(piece_list: bytes, size: int, tree: str) -> str:
    """'' if `piece_list` is the list of a `size`-byte blob whose tree hash is `tree`; else what is wrong."""
    want = piece_count(size) * DIGEST
    if len(piece_list) != want:
        return f"its piece list has {len(piece_list)} bytes where a {size:,}-byte blob has {want}"
    if tree_hash(piece_list) != tree:
        return "its piece list does not match the tree hash the blob was published with"
    return ""


def digest_of(piece_list: bytes, index: int) -> bytes:
    """The expected sha256 of piece `index`."""
    return piece_list[index * DIGEST:(index + 1) * DIGEST]


def pack_bits(flags: list[bool]) -> bytes:
    """Which pieces a peer holds, one bit each (piece 0 is the high bit of the first byte)."""
    out = bytearray(-(-len(flags) // 8))
    for i, f in enumerate(flags):
        if f:
            out[i >> 3] |= 0x80 >> (i & 7)
    return bytes(out)


def unpack_bits(data: bytes, n: int) -> list[bool]:
    """The flags `pack_bits` packed, for `n` pieces."""
    return [bool(data[i >> 3] & (0x80 >> (i & 7))) for i in range(n)]


def held_pieces(fd: int, size: int, piece_list: bytes) -> list[bool]:
    """Which pieces a partial file (written piece by piece, perhaps with holes) already holds intact; holes
    are skipped without reading them."""
    have = [False] * piece_count(size)
    length = os.fstat(fd).st_size
    buf = bytearray(PIECE_SIZE)
    for i in range(len(have)):
        start, end = piece_span(i, size)
        if end > length:
            break
        try:
            if os.lseek(fd, start, os.SEEK_DATA) >= end:
                continue  # a hole: never written
        except OSError as e:
            if e.errno == errno.ENXIO:
                break  # nothing but holes from here on
            # SEEK_DATA unsupported here: read the piece
        view = memoryview(buf)[:end - start]
        if os.preadv(fd, [view], start) == end - start:
            have[i] = hashlib.sha256(view).digest() == digest_of(piece_list, i)
    return have
