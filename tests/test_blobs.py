"""The content store: blobs named by their sha256, written atomically, verified on demand."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

from skillswarm.protocol.transport.blobs import (
    BlobStore, PartialDownload, check_sha256, default_blob_root, partial_pieces_path,
)
from skillswarm.protocol.transport.pieces import PIECE_SIZE, tree_hash
from skillswarm.protocol.errors import BlobError


def test_add_bytes_and_files_name_blobs_by_their_sha256(tmp_path: Path) -> None:
    store = BlobStore(tmp_path / "store")
    data = os.urandom(3 << 20)
    sha = store.add_bytes(data)
    assert sha == hashlib.sha256(data).hexdigest()
    assert store.has(sha) and store.path(sha).read_bytes() == data and store.size(sha) == len(data)
    src = tmp_path / "delta.safetensors"
    src.write_bytes(b"other bytes")
    sha2 = store.add_file(src)
    assert sha2 == hashlib.sha256(b"other bytes").hexdigest() and src.exists()
    assert list(store) == sorted([sha, sha2])
    assert store.add_file(src) == sha2  # adding the same content again is a no-op
    assert not [p for p in (tmp_path / "store").rglob("*") if p.is_file() and p.name not in (sha, sha2)], "temp files left"


def test_move_renames_the_file_into_the_store(tmp_path: Path) -> None:
    store = BlobStore(tmp_path / "store")
    src = tmp_path / "big.bin"
    src.write_bytes(b"x" * 1000)
    sha = store.add_file(src, move=True)
    assert not src.exists() and store.path(sha).read_bytes() == b"x" * 1000


def test_verify_removes_a_blob_that_no_longer_matches(tmp_path: Path) -> None:
    store = BlobStore(tmp_path)
    sha = store.add_bytes(b"precious")
    assert store.verify(sha)
    store.path(sha).write_bytes(b"rotten!!")
    assert not store.verify(sha) and not store.has(sha)


def test_bad_hashes_and_missing_files_raise_blob_errors(tmp_path: Path) -> None:
    store = BlobStore(tmp_path)
    for bad in ["abc", "A" * 64, "../" + "a" * 61, "g" * 64, None]:
        with pytest.raises(BlobError, match="not a sha256"):
            store.path(bad)  # type: ignore[arg-type]
    with pytest.raises(BlobError, match="is not in"):
        store.size("a" * 64)
    with pytest.raises(BlobError, match="is not a file"):
        store.add_file(tmp_path / "missing")
    assert check_sha256("0" * 64) == "0" * 64


def test_default_root_lives_in_the_cache_dir(isolated_home: Path) -> None:
    assert default_blob_root() == isolated_home / "cache" / "blobs"
    assert BlobStore().root == default_blob_root()


def test_piece_lists_are_computed_once_cached_and_removed_with_their_blob(tmp_path: Path) -> None:
    store = BlobStore(tmp_path / "store")
    data = os.urandom(PIECE_SIZE + 5)
    sha = store.add_bytes(data)
    expected = hashlib.sha256(data[:PIECE_SIZE]).digest() + hashlib.sha256(data[PIECE_SIZE:]).digest()
    assert store.pieces(sha) == expected and store.pieces_path(sha).read_bytes() == expected
    assert store.tree(sha) == tree_hash(expected)
    assert list(store) == [sha], "the cache is not a blob"
    store.remove(sha)
    assert not store.pieces_path(sha).exists()


def test_a_partial_file_written_piece_by_piece_becomes_its_intact_prefix_for_an_appending_fetch(tmp_path: Path) -> None:
    store = BlobStore(tmp_path / "store")
    data = os.urandom(3 * PIECE_SIZE + 10)
    sha = hashlib.sha256(data).hexdigest()
    part = store.partial_path(sha)
    part.parent.mkdir(parents=True)
    with open(part, "wb") as f:  # pieces 0 and 2 written, piece 1 still a hole
        f.write(data[:PIECE_SIZE])
        f.seek(2 * PIECE_SIZE)
        f.write(data[2 * PIECE_SIZE:3 * PIECE_SIZE])
    pieces = b"".join(hashlib.sha256(data[i:i + PIECE_SIZE]).digest() for i in range(0, len(data), PIECE_SIZE))
    partial_pieces_path(part).write_bytes(pieces)
    download = PartialDownload.open(part, store.path(sha), 1.0)
    try:
        assert download.offset == PIECE_SIZE == part.stat().st_size
        assert download.hasher.hexdigest() == hashlib.sha256(data[:PIECE_SIZE]).hexdigest()
        assert not partial_pieces_path(part).exists()
    finally:
        download.close()
