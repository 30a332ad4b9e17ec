"""Swarming downloads between real hivemind peers on 127.0.0.1: a blob fetched piece by piece from every
provider at once, each piece checked against a piece list that must match the published tree hash; a
provider that sends a bad piece or a bad list is rejected while every good piece stays; an interrupted
download resumes with the pieces it holds; a peer still downloading serves the pieces it holds."""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Iterator

import pytest

from skillswarm.protocol.errors import BlobError
from skillswarm.protocol.hashing import sha256_file
from skillswarm.protocol.transport.blobs import BlobStore, held_bytes, partial_pieces_path
from skillswarm.protocol.transport.pieces import PIECE_SIZE, check_piece_list, piece_count, tree_hash
from skillswarm.protocol.transport.provider import provider_stats
from tests.net_helpers import BlobPeer, blob_swarm, rot_unseen, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]
NET = "swarming"


@pytest.fixture(scope="module")
def swarm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, BlobPeer]]:
    with blob_swarm(NET, tmp_path_factory.mktemp("swarm"), "fetcher", "a", "b", "liar") as peers:
        yield peers


def _rot(path: Path, size: int) -> None:
    """Bit rot: flip one byte in the middle of every piece of a stored blob."""
    with open(path, "r+b") as f:
        for i in range(piece_count(size)):
            at = i * PIECE_SIZE + min(PIECE_SIZE, size - i * PIECE_SIZE) // 2
            f.seek(at)
            byte = f.read(1)
            f.seek(at)
            f.write(bytes([byte[0] ^ 0xFF]))


def _covered_once(segments: list[tuple[str, int, int]], start: int, end: int) -> bool:
    """Whether the segments tile [start, end) with no gap and no byte twice."""
    at = start
    for _, a, b in sorted(segments, key=lambda s: s[1]):
        if a != at:
            return False
        at = b
    return at == end


def test_the_tree_hash_binds_every_piece_and_the_piece_size() -> None:
    data = os.urandom(2 * PIECE_SIZE + 1)
    digests = b"".join(__import__("hashlib").sha256(data[i:i + PIECE_SIZE]).digest()
                       for i in range(0, len(data), PIECE_SIZE))
    tree = tree_hash(digests)
    assert not check_piece_list(digests, len(data), tree)
    assert "does not match the tree hash" in check_piece_list(digests[:-1] + b"\0", len(data), tree)
    assert "piece list has" in check_piece_list(digests[:64], len(data), tree)


def test_a_provider_serving_corrupt_pieces_is_dropped_and_the_good_pieces_stay(swarm: dict[str, BlobPeer]) -> None:
    fetcher, a, b, liar = swarm["fetcher"], swarm["a"], swarm["b"], swarm["liar"]
    size = 5 * PIECE_SIZE + 12345  # six pieces, the last one short
    data = os.urandom(size)
    sha = a.store.add_bytes(data)
    b.store.add_bytes(data)
    liar.store.add_bytes(data)
    for p in (a, b, liar):
        p.dht.provide(sha, store=p.store)  # each caches the blob's piece list...
    rot_unseen(liar, sha, lambda path: _rot(path, size))  # ...then the liar's disk rots: a right list, wrong pieces
    tree = a.store.tree(sha)
    assert {p.peer_id for p in fetcher.dht.get_providers(sha)} == {a.id, b.id, liar.id}

    report = fetcher.dht.fetch_report(sha, size=size, max_size=size, store=fetcher.store, tree=tree, progress=False)
    assert report.pieces and sha256_file(fetcher.store.path(sha)) == sha
    assert set(report.rejected) == {liar.id} and "does not match the piece list" in report.rejected[liar.id]
    assert report.discarded >= size - 5 * PIECE_SIZE, "the liar's bad piece arrived and was thrown away"
    # Every byte was written once, by an honest provider: no good piece was fetched again.
    assert {peer for peer, _, _ in report.segments} <= {a.id, b.id} and len({p for p, _, _ in report.segments}) == 2
    assert _covered_once(report.segments, 0, size) and report.received == size
    assert not list((fetcher.store.root / ".partial").iterdir()), "partial files left behind"
    # The fetcher can serve it at once: its piece list came with the download.
    assert fetcher.store.pieces_path(sha).read_bytes() == a.store.pieces(sha)


def test_a_piece_list_that_does_not_match_the_tree_hash_is_refused(swarm: dict[str, BlobPeer], tmp_path: Path) -> None:
    fetcher, a, liar = swarm["fetcher"], swarm["a"], swarm["liar"]
    size = 2 * PIECE_SIZE + 777
    data = os.urandom(size)
    sha = a.store.add_bytes(data)
    liar.store.add_bytes(data)
    rot_unseen(liar, sha, lambda path: _rot(path, size))  # rotted before its list was computed: the list describes the rot
    a.dht.serve_blobs(a.store)
    liar.dht.serve_blobs(liar.store)
    tree = a.store.tree(sha)
    with pytest.raises(BlobError, match="no provider sent a piece list that matches its tree hash"):
        fetcher.dht.fetch(sha, size=size, max_size=size, store=fetcher.store, providers=[liar.id], tree=tree,
                          progress=False)
    assert not fetcher.store.has(sha) and not fetcher.store.partial_path(sha).exists()
    # A wrong tree hash from the caller: even honest lists are refused, nothing is written.
    with pytest.raises(BlobError, match="does not match the tree hash"):
        fetcher.dht.fetch(sha, size=size, max_size=size, store=fetcher.store, providers=[a.id], tree="0" * 64,
                          progress=False)
    assert not fetcher.store.partial_path(sha).exists()
    report = fetcher.dht.fetch_report(sha, size=size, max_size=size, store=fetcher.store, providers=[liar.id, a.id],
                                      tree=tree, progress=False)
    assert "does not match the tree hash" in report.rejected[liar.id]
    assert {p for p, _, _ in report.segments} == {a.id} and sha256_file(fetcher.store.path(sha)) == sha
    # The store's quota holds for swarming downloads too: refused before a byte is written.
    capped = BlobStore(tmp_path / "capped", max_bytes=size - 1)
    with pytest.raises(BlobError, match="does not fit"):
        fetcher.dht.fetch(sha, size=size, max_size=size, store=capped, providers=[a.id], tree=tree, progress=False)
    assert capped.usage() == 0


def test_a_trickling_provider_holds_no_piece_hostage(swarm: dict[str, BlobPeer]) -> None:
    fetcher, a, b = swarm["fetcher"], swarm["a"], swarm["b"]
    size = 3 * PIECE_SIZE
    data = os.urandom(size)
    sha = a.store.add_bytes(data)
    b.store.add_bytes(data)
    tree = a.store.tree(sha)
    a.dht.serve_blobs(a.store)
    try:
        b.dht.serve_blobs(b.store, max_upload_mb_s=0.02)  # 20 KB/s: under any minimum rate used here
        report = fetcher.dht.fetch_report(sha, size=size, max_size=size, store=fetcher.store, providers=[b.id, a.id],
                                          tree=tree, grace_s=1.0, min_rate=200_000, progress=False)
    finally:
        b.dht.serve_blobs(b.store)
    assert sha256_file(fetcher.store.path(sha)) == sha
    assert {p for p, _, _ in report.segments} == {a.id} and _covered_once(report.segments, 0, size)


def test_an_interrupted_swarming_download_resumes_with_the_pieces_it_holds(swarm: dict[str, BlobPeer]) -> None:
    fetcher, a, b = swarm["fetcher"], swarm["a"], swarm["b"]
    size = 8 * PIECE_SIZE
    data = os.urandom(size)
    sha = a.store.add_bytes(data)
    b.store.add_bytes(data)
    tree = a.store.tree(sha)
    try:
        for p in (a, b):  # slow uploads, so the deadline cuts the download midway
            p.dht.serve_blobs(p.store, max_upload_mb_s=4)
        with pytest.raises(BlobError, match="deadline passed.*kept for a later fetch"):
            fetcher.dht.fetch(sha, size=size, max_size=size, store=fetcher.store, providers=[a.id, b.id], tree=tree,
                              deadline_s=3.0, progress=False)
    finally:
        for p in (a, b):
            p.dht.serve_blobs(p.store)
    part = fetcher.store.partial_path(sha)
    assert part.exists() and partial_pieces_path(part).exists() and not fetcher.store.has(sha)

    report = fetcher.dht.fetch_report(sha, size=size, max_size=size, store=fetcher.store, providers=[a.id, b.id],
                                      tree=tree, progress=False)
    held = report.resumed_from
    assert 0 < held < size and held % PIECE_SIZE == 0, report
    # Only the missing pieces travelled; the pieces held were not fetched again.
    assert report.received == size - held and sum(e - s for _, s, e in report.segments) == size - held
    assert sha256_file(fetcher.store.path(sha)) == sha
    assert not part.exists() and not partial_pieces_path(part).exists()


def test_a_peer_still_downloading_serves_the_pieces_it_holds(swarm: dict[str, BlobPeer]) -> None:
    fetcher, a, b = swarm["fetcher"], swarm["a"], swarm["b"]
    size = 6 * PIECE_SIZE
    sha = a.store.add_bytes(os.urandom(size))
    tree = a.store.tree(sha)
    fetcher.dht.serve_blobs(fetcher.store)  # a node serving its store announces what it downloads into it
    reports: dict = {}

    def fetch(peer: BlobPeer, providers: list[str]) -> None:
        reports[peer.id] = peer.dht.fetch_report(sha, size=size, max_size=size, store=peer.store, providers=providers,
                                                 tree=tree, progress=False)

    first = threading.Thread(target=fetch, args=(fetcher, [a.id]))
    second = threading.Thread(target=fetch, args=(b, [fetcher.id]))  # only from the peer still downloading
    served = a.dht.run_coroutine(provider_stats)["served_bytes"]
    try:
        a.dht.serve_blobs(a.store, max_upload_mb_s=4)  # about 6 s for the first download
        first.start()
        wait_for(lambda: fetcher.id in {p.peer_id for p in b.dht.get_providers(sha)}, 10, "the downloader's record")
        wait_for(lambda: _held(fetcher.store, sha) >= PIECE_SIZE, 10, "the first piece", poll=0.05)
        second.start()
        wait_for(lambda: _held(b.store, sha) >= PIECE_SIZE, 10, "a piece relayed before the first download ended",
                 poll=0.05)
        assert first.is_alive(), "the first download ended before it could relay a piece"
        first.join(60)
        second.join(60)
    finally:
        a.dht.serve_blobs(a.store)
    for peer in (fetcher, b):
        assert sha256_file(peer.store.path(sha)) == sha
    assert {p for p, _, _ in reports[b.id].segments} == {fetcher.id}
    # The first holder uploaded the blob once, though two peers downloaded it.
    assert a.dht.run_coroutine(provider_stats)["served_bytes"] - served == size


def _held(store: BlobStore, sha: str) -> int:
    """Verified bytes a store holds of a blob: complete, or written piece by piece so far."""
    for path in (store.path(sha), store.partial_path(sha)):
        try:
            return held_bytes(path.stat())
        except FileNotFoundError:
            continue
    return 0


def test_a_busy_provider_is_asked_again_not_blamed(swarm: dict[str, BlobPeer]) -> None:
    fetcher, a, b = swarm["fetcher"], swarm["a"], swarm["b"]
    size = 2 << 20
    sha = a.store.add_bytes(os.urandom(size))
    tree = a.store.tree(sha)
    reports: dict = {}

    def fetch(peer: BlobPeer) -> None:
        reports[peer.id] = peer.dht.fetch_report(sha, size=size, max_size=size, store=peer.store, providers=[a.id],
                                                 tree=tree, progress=False)

    try:
        a.dht.serve_blobs(a.store, max_concurrent=1, max_upload_mb_s=2)  # one upload at a time, about 1 s each
        threads = [threading.Thread(target=fetch, args=(p,)) for p in (fetcher, b)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    finally:
        a.dht.serve_blobs(a.store)
    for peer in (fetcher, b):
        assert not reports[peer.id].rejected and sha256_file(peer.store.path(sha)) == sha


def test_a_delta_comes_from_its_other_holders_once_its_author_is_gone(tmp_path: Path) -> None:
    """A delta manifest names its blob's tree hash: a coordinator that merged it (or an archive) serves it, and a
    fetcher takes it piece by piece from them after its worker has left."""
    from skillswarm.protocol.identity import Identity
    from skillswarm.protocol.records import DeltaManifest

    with blob_swarm("held", tmp_path, "boot", "author", "holder", "fetcher") as peers:
        author, holder, fetcher = peers["author"], peers["holder"], peers["fetcher"]
        blob = tmp_path / "delta.bin"
        blob.write_bytes(os.urandom(2 * PIECE_SIZE + 4321))
        sha = author.store.add_file(blob)
        author.dht.provide(sha, store=author.store)
        manifest = Identity.generate().sign_record(DeltaManifest(
            network="held", skill="arith", base_version=0, base_hash="a" * 64, blob=sha, size=blob.stat().st_size,
            codec="int8", norm=1.0, num_tensors=1, tree=author.store.tree(sha)))
        holder.dht.fetch(sha, size=manifest.size, max_size=manifest.size, store=holder.store, progress=False,
                         tree=manifest.tree)
        holder.dht.provide(sha, store=holder.store)
        author.dht.shutdown()  # the worker leaves
        report = fetcher.dht.fetch_report(sha, size=manifest.size, max_size=manifest.size, store=fetcher.store,
                                          progress=False, tree=manifest.tree)
        assert sha256_file(Path(report.path)) == sha
        assert {s for s, _, _ in report.segments} == {holder.id}  # every piece from the holder


def test_a_copy_counts_only_when_a_random_piece_of_it_matches(tmp_path: Path) -> None:
    """A leaving coordinator counts the copies others hold (`SwarmDHT.holders`): a peer that says it holds every
    piece but serves other bytes is no copy."""
    with blob_swarm("spot", tmp_path, "owner", "honest", "liar") as peers:
        owner, honest, liar = peers["owner"], peers["honest"], peers["liar"]
        blob = tmp_path / "ckpt.bin"
        blob.write_bytes(os.urandom(3 * PIECE_SIZE + 99))
        size = blob.stat().st_size
        sha = owner.store.add_file(blob)
        owner.dht.provide(sha, store=owner.store)
        for p in (honest, liar):
            p.dht.fetch(sha, size=size, max_size=size, store=p.store, progress=False, tree=owner.store.tree(sha))
            p.dht.provide(sha, store=p.store)
        rot_unseen(liar, sha, lambda path: _rot(path, size))  # it still answers "have" for every piece
        providers = owner.dht.get_providers(sha)
        assert {p.peer_id for p in providers} >= {honest.id, liar.id}
        assert owner.dht.holders(sha, size, providers) == [honest.id]
        assert honest.dht.holders(sha, size, providers) == [owner.id]  # any holder of a good copy checks so
