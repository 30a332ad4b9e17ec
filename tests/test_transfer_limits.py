"""Limits on downloads, with real hivemind peers on 127.0.0.1: a provider that trickles bytes cannot hold a
fetch past its deadline, an honest provider takes over from it, a round's fetches end within their budget,
and a capped blob store refuses what does not fit before a byte is written."""

from __future__ import annotations

import hashlib
import os
import re
import time
from pathlib import Path
from typing import Iterator

import pytest

from skillswarm.protocol.transport import blobs
from skillswarm.protocol.transport.blobs import BlobStore
from skillswarm.protocol.errors import BlobError
from skillswarm.protocol.hashing import sha256_file
from skillswarm.protocol.identity import Identity
from skillswarm.protocol.transport.dht import SwarmDHT
from skillswarm.protocol.transport.provider import provider_stats
from skillswarm.protocol.transport.wire import GRACE_S, MIN_RATE, deadline_for
from tests.net_helpers import BlobPeer, blob_swarm, rot_unseen

NET = "limits"
MB = 1 << 20
TRICKLE_MB_S = 0.02  # 20 KB/s: far under any minimum rate used here


@pytest.fixture(scope="module")
def swarm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, BlobPeer]]:
    with blob_swarm(NET, tmp_path_factory.mktemp("swarm"), "honest", "fetcher", "trickler") as peers:
        peers["honest"].dht.serve_blobs(peers["honest"].store)
        peers["trickler"].dht.serve_blobs(peers["trickler"].store, max_upload_mb_s=TRICKLE_MB_S)
        yield peers


def _blob(size: int, *stores: BlobStore) -> str:
    data = os.urandom(size)
    for store in stores:
        store.add_bytes(data)
    return hashlib.sha256(data).hexdigest()


def _settled_size(path: Path, quiet_s: float = 1.5) -> int:
    """The file's size once it held still for `quiet_s` (raises if it keeps growing: bytes still moving)."""
    before = path.stat().st_size
    time.sleep(quiet_s)
    after = path.stat().st_size
    assert after == before, f"{path.name} grew from {before} to {after} bytes after its fetch ended"
    return after


def test_the_limits_are_one_constant_each() -> None:
    assert (GRACE_S, MIN_RATE) == (30.0, 100_000.0)
    assert deadline_for(10_000_000) == 30.0 + 100.0
    assert deadline_for(1_000_000, min_rate=500_000, grace_s=2) == 4.0


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_trickling_provider_alone_fails_by_the_deadline(swarm: dict[str, BlobPeer]) -> None:
    fetcher, trickler = swarm["fetcher"], swarm["trickler"]
    size = 4 * MB
    sha = _blob(size, trickler.store)

    # An explicit deadline: the fetch ends then, says what arrived from whom, and keeps those bytes.
    started = time.monotonic()
    with pytest.raises(BlobError) as caught:
        fetcher.dht.fetch(sha, max_size=8 * MB, store=fetcher.store, providers=[trickler.id], progress=False,
                          deadline_s=4, grace_s=3, min_rate=1_000_000)
    took = time.monotonic() - started
    message = str(caught.value)
    assert 3.9 <= took <= 4 + 1.5, took
    assert "its 4 s deadline passed" in message and trickler.id[:20] in message, message
    assert re.search(r"[\d,]+ of 4,194,304 bytes arrived in 4\.\d s", message), message
    assert "minimum rate is 1,000,000 bytes/s" in message and "min_rate=" in message, message
    partial = fetcher.store.partial_path(sha)
    kept = _settled_size(partial)  # the DHT process stopped moving bytes at the deadline
    assert 0 < kept < size and f"the {kept:,} bytes it holds are kept" in message
    assert not fetcher.store.has(sha)

    # The deadline derived from the size: GRACE + size / MIN_RATE. Dropped twice for slowness long before
    # it, the trickler is rejected and the fetch fails at once, with the same account of what arrived.
    deadline = deadline_for(size, min_rate=200_000, grace_s=1)
    started = time.monotonic()
    with pytest.raises(BlobError) as caught:
        fetcher.dht.fetch(sha, max_size=8 * MB, store=fetcher.store, providers=[trickler.id], progress=False,
                          grace_s=1, min_rate=200_000)
    took = time.monotonic() - started
    message = str(caught.value)
    assert took < deadline / 2, (took, deadline)
    assert "dropped twice as too slow" in message and "under 200,000 bytes/s" in message, message
    assert "bytes arrived in" in message and trickler.id[:20] in message, message
    assert _settled_size(partial) > kept  # resumed from what the first fetch kept, and kept again


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_an_honest_provider_takes_over_from_a_trickler(swarm: dict[str, BlobPeer]) -> None:
    fetcher, trickler, honest = swarm["fetcher"], swarm["trickler"], swarm["honest"]
    size = 6 * MB
    sha = _blob(size, trickler.store, honest.store)
    deadline = deadline_for(size, grace_s=1.5)  # the default minimum rate
    started = time.monotonic()
    report = fetcher.dht.fetch_report(sha, max_size=8 * MB, store=fetcher.store, providers=[trickler.id, honest.id],
                                      progress=False, grace_s=1.5)
    took = time.monotonic() - started
    assert sha256_file(fetcher.store.path(sha)) == sha
    assert took < 10 and took < deadline / 4, (took, deadline)
    # The trickler's stream was dropped once (its bytes kept); the honest provider sent the rest, from there.
    (first, start0, cut), (second, start1, end) = report.segments
    assert (first, second) == (trickler.id, honest.id) and start0 == 0 and start1 == cut and end == size, report
    assert cut < size // 2 and report.received == size
    assert not fetcher.store.partial_path(sha).exists()


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_liar_cut_off_for_slowness_is_still_named_once_the_blob_verifies(swarm: dict[str, BlobPeer]) -> None:
    fetcher, trickler, honest = swarm["fetcher"], swarm["trickler"], swarm["honest"]
    size = 3 * MB
    sha = _blob(size, honest.store, trickler.store)

    def rot(bad: Path) -> None:  # the trickler's copy is wrong from its first byte; it is dropped as slow soon after
        with open(bad, "r+b") as f:
            first_byte = f.read(1)[0]
            f.seek(0)
            f.write(bytes([first_byte ^ 0xFF]))

    rot_unseen(trickler, sha, rot)
    report = fetcher.dht.fetch_report(sha, max_size=8 * MB, store=fetcher.store, providers=[trickler.id, honest.id],
                                      progress=False, grace_s=1.5)
    assert sha256_file(fetcher.store.path(sha)) == sha
    # Its bytes and the honest provider's rest failed verification together; the honest copy, fetched again
    # from zero, verified, and the range that differs from it names the trickler, not the honest provider.
    (first, start0, cut), (second, start1, end1), (third, start2, end2) = report.segments
    assert (first, second, third) == (trickler.id, honest.id, honest.id), report
    assert (start0, start1, end1, start2, end2) == (0, cut, size, 0, size) and 0 < cut < size, report
    assert f"bytes 0-{cut} differ from the verified blob" in report.rejected[trickler.id], report
    assert honest.id not in report.rejected, report


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_rounds_fetches_end_within_the_budget(swarm: dict[str, BlobPeer]) -> None:
    fetcher, trickler, honest = swarm["fetcher"], swarm["trickler"], swarm["honest"]
    good = _blob(3 * MB, honest.store)
    trickled = _blob(2 * MB, trickler.store)
    missing = hashlib.sha256(b"a blob nobody has").hexdigest()
    honest.dht.provide(good, store=honest.store)
    trickler.dht.provide(trickled, store=trickler.store)  # still served at TRICKLE_MB_S
    budget = 6.0
    started = time.monotonic()
    # A minimum rate the trickler meets: only the budget can stop its download (due in 200 s).
    results = fetcher.dht.fetch_many([(good, 3 * MB, 4 * MB), (missing, MB, 4 * MB), (trickled, None, 4 * MB)],
                                     budget_s=budget, store=fetcher.store, min_rate=10_000, grace_s=1, progress=True)
    took = time.monotonic() - started
    assert budget - 0.5 <= took <= budget + 3, took
    assert isinstance(results[good], Path) and sha256_file(results[good]) == good
    assert isinstance(results[missing], BlobError) and "no provider is known" in str(results[missing])
    error = results[trickled]
    assert isinstance(error, BlobError), error
    assert "the round's fetch budget of 6 s ran out" in str(error) and trickler.id[:20] in str(error), error
    assert "bytes arrived in" in str(error) and "kept for a later fetch" in str(error), error
    assert 0 < _settled_size(fetcher.store.partial_path(trickled)) < 2 * MB
    deadline = time.monotonic() + 10  # the trickler notices the stream is gone and frees its upload slot
    while trickler.dht.run_coroutine(provider_stats)["active"] and time.monotonic() < deadline:
        time.sleep(0.2)
    assert trickler.dht.run_coroutine(provider_stats)["active"] == 0


def test_malformed_requests_are_refused_with_a_clear_error() -> None:
    dht = SwarmDHT(NET, Identity.generate())  # never started: the checks come first
    with pytest.raises(BlobError, match=r"takes \(sha, size or None, max_size\) tuples"):
        dht.fetch_many(["a" * 64], budget_s=5)
    with pytest.raises(BlobError, match="budget_s=0: give the round's fetch budget"):
        dht.fetch_many([("a" * 64, None, MB)], budget_s=0)
    with pytest.raises(BlobError, match="min_rate=-1: give a positive number of bytes/s"):
        dht.fetch_many([("a" * 64, None, MB)], budget_s=5, min_rate=-1)
    with pytest.raises(BlobError, match="deadline_s=0: give a positive number of seconds"):
        dht.fetch("a" * 64, max_size=MB, deadline_s=0, providers=[])
    with pytest.raises(BlobError, match="max_size=None: give a number of bytes"):
        dht.fetch("a" * 64, max_size=None, providers=[])  # type: ignore[arg-type]


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_capped_store_refuses_a_blob_before_any_byte(swarm: dict[str, BlobPeer], tmp_path: Path) -> None:
    fetcher, honest = swarm["fetcher"], swarm["honest"]
    capped = BlobStore(tmp_path / "capped", max_bytes=4 * MB)
    old = capped.add_bytes(os.urandom(3 * MB))
    sha = _blob(2 * MB, honest.store)
    served = honest.dht.run_coroutine(provider_stats)["served_bytes"]
    # Its size known (announced): refused before a stream opens.
    with pytest.raises(BlobError) as caught:
        fetcher.dht.fetch(sha, size=2 * MB, max_size=4 * MB, store=capped, providers=[honest.id], progress=False)
    message = str(caught.value)
    assert f"does not fit in the blob store {capped.root}" in message, message
    assert "holds 3,145,728 bytes" in message and "4,194,304-byte cap" in message and "max_bytes=" in message
    assert honest.dht.run_coroutine(provider_stats)["served_bytes"] == served
    # Its size unknown: the DHT process refuses it once the provider's header says how big it is.
    with pytest.raises(BlobError, match="does not fit in the blob store"):
        fetcher.dht.fetch(sha, max_size=4 * MB, store=capped, providers=[honest.id], progress=False)
    assert not capped.partial_path(sha).exists() and capped.usage() == 3 * MB and list(capped) == [old]
    # Pruning makes room; then the same fetch goes through, and remove() takes it out again.
    assert capped.prune(keep=[]) == 3 * MB and capped.usage() == 0
    path = fetcher.dht.fetch(sha, max_size=4 * MB, store=capped, providers=[honest.id], progress=False)
    assert sha256_file(path) == sha and capped.usage() == 2 * MB
    capped.remove(sha)
    assert capped.usage() == 0 and not capped.has(sha)


# ---- the store's cap, without a network ------------------------------------------------------------
def test_usage_counts_blobs_and_partial_downloads_and_the_cap_holds(tmp_path: Path) -> None:
    store = BlobStore(tmp_path / "s", max_bytes=10_000)
    a = store.add_bytes(b"a" * 4_000)
    part = store.partial_path("b" * 64)
    part.parent.mkdir(parents=True, exist_ok=True)
    part.write_bytes(b"b" * 3_000)
    assert store.usage() == 7_000
    store.check_room(5_000, "b" * 64)  # its partial's 3,000 bytes already count: 2,000 more fit
    with pytest.raises(BlobError) as caught:
        store.add_bytes(b"c" * 3_001)
    message = str(caught.value)
    assert str(store.root) in message and "holds 7,000 bytes" in message and "10,000-byte cap" in message
    assert "max_bytes=" in message and "prune" in message
    src = tmp_path / "big.bin"
    src.write_bytes(b"d" * 3_001)
    for kwargs in ({}, {"move": True}, {"link": True}):
        with pytest.raises(BlobError, match="does not fit"):
            store.add_file(src, **kwargs)
    assert src.exists() and list(store) == [a]
    with pytest.raises(BlobError, match="whole number"):
        BlobStore(tmp_path / "t", max_bytes=-1)


def test_reservations_keep_concurrent_downloads_under_the_cap(tmp_path: Path) -> None:
    store = BlobStore(tmp_path, max_bytes=10_000)
    with store.reserve("a" * 64, 6_000):
        with pytest.raises(BlobError, match="does not fit"):
            with store.reserve("b" * 64, 5_000):
                pass
        with store.reserve("b" * 64, 4_000):
            pass
    with store.reserve("b" * 64, 10_000):  # released: the room is back
        pass


def test_the_filesystem_keeps_a_margin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = BlobStore(tmp_path)  # no cap: only the disk limits it
    disk = blobs.shutil.disk_usage(tmp_path)
    margin = min(blobs.FS_MARGIN_BYTES, int(disk.total * blobs.FS_MARGIN_FRACTION))
    monkeypatch.setattr(blobs.shutil, "disk_usage", lambda _path: disk._replace(free=margin + 1_000))
    store.check_room(1_000)
    with pytest.raises(BlobError, match=f"{margin + 1_000:,} bytes are free and {margin:,} must stay free"):
        store.check_room(1_001)
    store.check_room(10 * MB, new_disk_bytes=False)  # a rename or hard link takes no new space


def test_remove_deletes_a_partial_download_unless_a_fetch_holds_it(tmp_path: Path) -> None:
    import fcntl

    store = BlobStore(tmp_path)
    sha = store.add_bytes(b"complete")
    part = store.partial_path(sha)
    part.parent.mkdir()
    part.write_bytes(b"comp")
    store.remove(sha)
    assert not store.has(sha) and not part.exists()
    other = "c" * 64
    held = store.partial_path(other)
    held.write_bytes(b"in flight")
    with open(held, "rb") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)  # what a running fetch holds
        store.remove(other)
        assert held.exists()
    store.remove(other)
    assert not held.exists()
    store.remove(other)  # absent: no error


def test_prune_keeps_what_is_listed_and_returns_the_bytes_freed(tmp_path: Path) -> None:
    store = BlobStore(tmp_path)
    keep = store.add_bytes(b"k" * 100)
    drop = [store.add_bytes(b"x" * 300), store.add_bytes(b"y" * 200)]
    part = store.partial_path("d" * 64)
    part.parent.mkdir()
    part.write_bytes(b"partial")
    assert store.prune([keep]) == 500
    assert list(store) == [keep] and part.exists() and not any(store.has(s) for s in drop)
    assert store.prune({keep}) == 0
    with pytest.raises(BlobError, match="not one string"):
        store.prune(keep)
