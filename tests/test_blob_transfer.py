"""Blob transfer between real hivemind peers on 127.0.0.1: providers found through the DHT, verified
downloads, lying and dying providers, resumption, size limits and upload caps."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path
from typing import Iterator

import psutil
import pytest

from skillswarm.protocol.transport.blobs import BlobStore
from skillswarm.protocol.errors import BlobError
from skillswarm.protocol.hashing import sha256_file
from tests.net_helpers import BlobPeer, blob_swarm, rot_unseen, still_running

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]
NET = "blobs"
MB = 1 << 20


@pytest.fixture(scope="module")
def swarm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, BlobPeer]]:
    with blob_swarm(NET, tmp_path_factory.mktemp("swarm"), "honest", "fetcher", "liar", "flaky") as peers:
        yield peers


def _blob(store: BlobStore, size: int) -> str:
    return store.add_bytes(os.urandom(size))


def _copy(src: BlobStore, dst: BlobStore, sha: str) -> None:
    dst.add_bytes(src.path(sha).read_bytes())


def test_a_50mb_blob_is_found_through_the_dht_fetched_and_verified(swarm: dict[str, BlobPeer]) -> None:
    honest, fetcher = swarm["honest"], swarm["fetcher"]
    sha = _blob(honest.store, 50 * MB)
    record = honest.dht.provide(sha, store=honest.store)
    assert record.size == 50 * MB and record.peer_id == honest.dht.identity.peer_id
    assert [p.peer_id for p in fetcher.dht.get_providers(sha)] == [honest.dht.identity.peer_id]
    report = fetcher.dht.fetch_report(sha, max_size=64 * MB, store=fetcher.store, progress=False)
    path = Path(report.path)
    assert path == fetcher.store.path(sha) and sha256_file(path) == sha and path.stat().st_size == 50 * MB
    assert report.segments == [(honest.dht.identity.peer_id, 0, 50 * MB)] and report.received == 50 * MB
    assert not list((fetcher.store.root / ".partial").glob("*.part")), "partial file left behind"
    # A second fetch is served from the store, with no transfer.
    assert fetcher.dht.fetch_report(sha, max_size=64 * MB, store=fetcher.store).already_present


def test_corrupted_bytes_never_appear_under_the_final_name(swarm: dict[str, BlobPeer]) -> None:
    honest, fetcher, liar = swarm["honest"], swarm["fetcher"], swarm["liar"]
    sha = _blob(honest.store, 4 * MB)
    _copy(honest.store, liar.store, sha)

    def rot(path: Path) -> None:  # bit rot on the liar's disk, one byte in the middle, after its provider's check
        with open(path, "r+b") as f:
            f.seek(2 * MB)
            byte = f.read(1)
            f.seek(2 * MB)
            f.write(bytes([byte[0] ^ 0xFF]))

    rot_unseen(liar, sha, rot)
    liar.dht.serve_blobs(liar.store)
    honest.dht.serve_blobs(honest.store)
    liar_id, honest_id = liar.dht.identity.peer_id, honest.dht.identity.peer_id
    with pytest.raises(BlobError, match="do not match the sha256"):
        fetcher.dht.fetch(sha, max_size=8 * MB, store=fetcher.store, providers=[liar_id], progress=False)
    assert not fetcher.store.path(sha).exists()
    assert not fetcher.store.partial_path(sha).exists(), "unverified bytes were kept"
    report = fetcher.dht.fetch_report(sha, max_size=8 * MB, store=fetcher.store, providers=[liar_id, honest_id])
    assert sha256_file(fetcher.store.path(sha)) == sha, report
    # The verified attempt's segments (back to the last one from byte 0) cover the blob contiguously; a busy machine
    # may cut a stream and resume it, and the liar may have sent part of it, but never the bad byte.
    verified = [report.segments[-1]]
    while verified[0][1] != 0:
        verified.insert(0, report.segments[len(report.segments) - len(verified) - 1])
    assert verified[-1][2] == 4 * MB and all(a[2] == b[1] for a, b in zip(verified, verified[1:])), report
    assert all(peer == honest_id or b <= 2 * MB for peer, _, b in verified), report
    # The liar is named exactly when it sent the bad byte (a busy machine may cut its stream before it).
    sent_bad = any(peer == liar_id and a <= 2 * MB < b for peer, a, b in report.segments)
    assert ("do not match" in report.rejected.get(liar_id, "")) == sent_bad, report
    assert honest_id not in report.rejected, report


def test_unknown_hashes_oversized_blobs_and_busy_providers_are_refused(swarm: dict[str, BlobPeer]) -> None:
    honest, fetcher = swarm["honest"], swarm["fetcher"]
    honest_id = honest.dht.identity.peer_id
    with pytest.raises(BlobError, match="unknown blob"):
        fetcher.dht.fetch("e" * 64, max_size=MB, store=fetcher.store, providers=[honest_id], progress=False)
    with pytest.raises(BlobError, match="no provider is known"):
        fetcher.dht.fetch("e" * 64, max_size=MB, store=fetcher.store, progress=False)
    sha = _blob(honest.store, 3 * MB)
    with pytest.raises(BlobError, match="over the 1048576-byte limit"):
        fetcher.dht.fetch(sha, max_size=MB, store=fetcher.store, providers=[honest_id], progress=False)
    with pytest.raises(BlobError, match="over the 1048576-byte limit"):
        fetcher.dht.fetch(sha, size=3 * MB, max_size=MB, store=fetcher.store, providers=[honest_id], progress=False)
    assert not fetcher.store.has(sha) and not fetcher.store.partial_path(sha).exists()

    # One upload at a time, 3 MB at 2 MB/s: a second download meanwhile is told "busy".
    honest.dht.serve_blobs(honest.store, max_concurrent=1, max_upload_mb_s=2)
    try:
        first = threading.Thread(target=fetcher.dht.fetch, args=(sha,),
                                 kwargs=dict(max_size=8 * MB, store=fetcher.store, providers=[honest_id], progress=False))
        first.start()
        time.sleep(0.5)
        other = BlobStore(fetcher.store.root.parent / "other")
        with pytest.raises(BlobError, match="busy"):
            fetcher.dht.fetch(sha, max_size=8 * MB, store=other, providers=[honest_id], progress=False)
        first.join(30)
        assert sha256_file(fetcher.store.path(sha)) == sha
    finally:
        honest.dht.serve_blobs(honest.store)


def _kill_provider_midway(provider: BlobPeer, fetching: threading.Thread, at_bytes: int, partial: Path) -> list[psutil.Process]:
    """SIGKILL the provider's DHT process once the fetcher holds `at_bytes`; return its processes."""
    procs = [psutil.Process(provider.dht.pid), *psutil.Process(provider.dht.pid).children(recursive=True)]
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and fetching.is_alive():
        if partial.exists() and partial.stat().st_size >= at_bytes:
            os.kill(provider.dht.pid, signal.SIGKILL)
            return procs
        time.sleep(0.02)
    raise AssertionError("the transfer finished or stalled before the provider could be killed")


def test_a_provider_dying_midway_is_replaced_without_starting_over(swarm: dict[str, BlobPeer], tmp_path: Path) -> None:
    honest, fetcher, flaky = swarm["honest"], swarm["fetcher"], swarm["flaky"]
    size = 12 * MB
    sha = _blob(honest.store, size)
    _copy(honest.store, flaky.store, sha)
    flaky.dht.serve_blobs(flaky.store, max_upload_mb_s=8)
    honest.dht.serve_blobs(honest.store)
    flaky_id, honest_id = flaky.dht.identity.peer_id, honest.dht.identity.peer_id
    result: dict = {}

    def fetch(providers: list[str]) -> None:
        try:
            result["report"] = fetcher.dht.fetch_report(sha, max_size=size, store=fetcher.store, providers=providers,
                                                        progress=False, stall_timeout=5)
        except BlobError as e:
            result["error"] = e

    # The only provider dies at ~4 MB: the fetch fails, and the bytes it got stay for the next try.
    t = threading.Thread(target=fetch, args=([flaky_id],))
    t.start()
    procs = _kill_provider_midway(flaky, t, 4 * MB, fetcher.store.partial_path(sha))
    t.join(60)
    assert "error" in result and not fetcher.store.has(sha)
    kept = fetcher.store.partial_path(sha).stat().st_size
    assert 4 * MB <= kept < size
    # Its p2pd went down with it, on its own.
    assert not still_running(procs, timeout=5), "the killed provider left processes behind"

    # On retry, another provider continues from the last byte received; nothing is fetched twice.
    report = fetcher.dht.fetch_report(sha, max_size=size, store=fetcher.store, providers=[flaky_id, honest_id],
                                      progress=False, stall_timeout=5)
    assert report.resumed_from == kept and report.received == size - kept
    assert report.segments == [(honest_id, kept, size)]
    assert sha256_file(fetcher.store.path(sha)) == sha


def test_a_provider_dying_midway_is_replaced_within_the_same_fetch(swarm: dict[str, BlobPeer]) -> None:
    honest, fetcher = swarm["honest"], swarm["fetcher"]
    size = 12 * MB
    sha = _blob(honest.store, size)
    # A fresh, throttled provider that will die mid-way (the liar's node, reused).
    dying = swarm["liar"]
    _copy(honest.store, dying.store, sha)
    dying.dht.serve_blobs(dying.store, max_upload_mb_s=8)
    honest.dht.serve_blobs(honest.store)
    dying_id, honest_id = dying.dht.identity.peer_id, honest.dht.identity.peer_id
    result: dict = {}
    t = threading.Thread(target=lambda: result.update(report=fetcher.dht.fetch_report(
        sha, max_size=size, store=fetcher.store, providers=[dying_id, honest_id], progress=False, stall_timeout=5)))
    t.start()
    _kill_provider_midway(dying, t, 3 * MB, fetcher.store.partial_path(sha))
    t.join(60)
    report = result["report"]
    # The bytes arrive in order and exactly once: the dying provider's, then the honest one's from where they
    # stopped. (A stream may break and resume from the same provider on a loaded machine: more segments,
    # still contiguous.)
    segments = report.segments
    assert [s[1] for s in segments[1:]] == [s[2] for s in segments[:-1]] and segments[0][1] == 0, report
    peers = [s[0] for s in segments]
    cut = next(s[1] for s in segments if s[0] == honest_id)
    assert peers[0] == dying_id and peers[-1] == honest_id and segments[-1][2] == size, report
    assert set(peers[peers.index(honest_id):]) == {honest_id} and cut >= 3 * MB, report
    assert report.received == size
    assert sha256_file(fetcher.store.path(sha)) == sha
