"""Nothing unverified leaves the store: a damaged blob in a node's cache (truncated, or a byte flipped) is
deleted and fetched again by `pull`, never exported into a checkpoint directory, and never served: a provider
holding one answers as if it did not hold it. Real files, a real BlobStore, real peers on 127.0.0.1."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Iterator

import pytest
import torch
from safetensors.torch import save_file

from skillswarm.node.checkpoints.pull import export, pull
from skillswarm.node.checkpoints.store import CheckpointStore, checkpoint_files, with_trees
from skillswarm.protocol.errors import BlobError, HashMismatchError
from skillswarm.protocol.hashing import sha256_file, weights_hash
from skillswarm.protocol.identity import Identity
from skillswarm.protocol.records import CheckpointManifest, NetworkSpec
from skillswarm.protocol.transport.blobs import BlobStore
from skillswarm.protocol.transport.pieces import PIECE_SIZE
from tests.net_helpers import BlobPeer, blob_swarm

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]
NET = "pullverify"
MB = 1 << 20


@pytest.fixture(scope="module")
def swarm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, BlobPeer]]:
    with blob_swarm(NET, tmp_path_factory.mktemp("swarm"), "seed", "puller", "other", "rotten") as peers:
        yield peers


@pytest.fixture(scope="module")
def published(swarm: dict[str, BlobPeer], tmp_path_factory: pytest.TempPathFactory) -> tuple[NetworkSpec, CheckpointManifest]:
    """A checkpoint v1 (a config and an 819,888-byte safetensors file) signed by a coordinator and served by the seed."""
    model = tmp_path_factory.mktemp("model")
    (model / "config.json").write_text('{"model_type": "tiny"}\n')
    save_file({"w": torch.arange(204_954, dtype=torch.float32)}, str(model / "model.safetensors"))
    coordinator, seed = Identity.generate(), swarm["seed"]
    manifest = coordinator.sign_record(CheckpointManifest(
        network=NET, version=1, parent_version=0, parent_hash="0" * 64, weights_hash=weights_hash(model),
        files=with_trees(checkpoint_files(model), model, seed.store)))
    for f in manifest.files:
        seed.store.add_file(model / f.path)
        seed.dht.provide(f.sha256, store=seed.store)
    spec = NetworkSpec(network=NET, base_model="remote/tiny", base_hash="0" * 64, skills=["arith"])
    return spec, manifest


def _weights(manifest: CheckpointManifest) -> tuple[str, int]:
    entry = next(f for f in manifest.files if f.path == "model.safetensors")
    return entry.sha256, entry.size


def _pull_and_export(peer: BlobPeer, spec: NetworkSpec, manifest: CheckpointManifest, store: CheckpointStore,
                     out: Path) -> Path:
    pull(peer.dht, spec, manifest, store, peer.store, progress=False)
    return export(store, manifest.version, out)


def test_a_truncated_cached_blob_is_fetched_again_and_the_pull_has_the_manifests_bytes(
        swarm: dict[str, BlobPeer], published: tuple[NetworkSpec, CheckpointManifest], tmp_path: Path,
        caplog: pytest.LogCaptureFixture) -> None:
    spec, manifest = published
    puller, (sha, size) = swarm["puller"], _weights(manifest)
    assert size == 819_888
    store = CheckpointStore(NET, tmp_path / "ckpts")
    _pull_and_export(puller, spec, manifest, store, tmp_path / "first")
    # The blob is cut short in place: the local checkpoint's file, a hard link to it, is cut too.
    os.truncate(puller.store.path(sha), 300_000)
    assert (store.path(1) / "model.safetensors").stat().st_size == 300_000
    with caplog.at_level(logging.WARNING):
        out = _pull_and_export(puller, spec, manifest, store, tmp_path / "second")
    got = out / "model.safetensors"
    assert got.stat().st_size == size and sha256_file(got) == sha
    assert sha256_file(puller.store.path(sha)) == sha, "the cached blob was not fetched again"
    assert sha256_file(store.path(1) / "model.safetensors") == sha
    assert "300,000 bytes, not 819,888" in caplog.text, caplog.text


def test_an_altered_cached_blob_is_fetched_again_not_exported(
        swarm: dict[str, BlobPeer], published: tuple[NetworkSpec, CheckpointManifest], tmp_path: Path,
        caplog: pytest.LogCaptureFixture) -> None:
    spec, manifest = published
    puller, (sha, size) = swarm["puller"], _weights(manifest)
    cache = BlobStore(tmp_path / "cache")  # a node's cache holding the right size, one byte flipped
    good = swarm["seed"].store.path(sha).read_bytes()
    cache.path(sha).write_bytes(good[:size // 2] + bytes([good[size // 2] ^ 0xFF]) + good[size // 2 + 1:])
    assert cache.path(sha).stat().st_size == size
    store = CheckpointStore(NET, tmp_path / "ckpts")
    with caplog.at_level(logging.WARNING):
        pull(puller.dht, spec, manifest, store, cache, progress=False)
    out = export(store, 1, tmp_path / "out")
    assert sha256_file(out / "model.safetensors") == sha and sha256_file(cache.path(sha)) == sha
    assert f"blob {sha[:12]}" in caplog.text and "hash to" in caplog.text, caplog.text


def test_export_refuses_a_local_checkpoint_damaged_since_it_was_pulled(
        swarm: dict[str, BlobPeer], published: tuple[NetworkSpec, CheckpointManifest], tmp_path: Path) -> None:
    spec, manifest = published
    puller, (_, size) = swarm["puller"], _weights(manifest)
    store = CheckpointStore(NET, tmp_path / "ckpts")
    pull(puller.dht, spec, manifest, store, BlobStore(tmp_path / "cache"), progress=False)
    time.sleep(0.05)  # later than its last write, as damage is: a new mtime
    with open(store.path(1) / "model.safetensors", "r+b") as f:  # damaged after the pull (a new mtime)
        f.seek(size - 1)
        last = f.read(1)[0]
        f.seek(size - 1)
        f.write(bytes([last ^ 0xFF]))
    out = tmp_path / "out"
    with pytest.raises(HashMismatchError, match="local checkpoint v1 is missing or damaged .* pull it again"):
        export(store, 1, out)
    assert not out.exists() and not list(tmp_path.glob(".out.pull-*")), "an unverified export was left behind"
    assert not store.has(1), "the damaged version stays in the store"


def _flip(path: Path, at: int) -> None:
    os.chmod(path, 0o644)
    with open(path, "r+b") as f:
        f.seek(at)
        byte = f.read(1)[0]
        f.seek(at)
        f.write(bytes([byte ^ 0xFF]))


def test_a_node_holding_a_corrupt_blob_does_not_serve_it(swarm: dict[str, BlobPeer]) -> None:
    seed, other, rotten = swarm["seed"], swarm["other"], swarm["rotten"]
    data = os.urandom(3 * MB + 5)
    sha = rotten.store.add_bytes(data)
    rotten.dht.provide(sha, store=rotten.store)  # announced while good...
    _flip(rotten.store.path(sha), MB)  # ...then its disk rots
    with pytest.raises(BlobError, match="unknown blob"):
        other.dht.fetch(sha, size=len(data), max_size=len(data), store=other.store, providers=[rotten.id],
                        progress=False)
    assert not rotten.store.path(sha).exists(), "the corrupt blob was kept"
    assert not other.store.path(sha).exists() and not other.store.partial_path(sha).exists()

    # With an honest provider too, found through the DHT, piece by piece: the fetch goes to it alone.
    data = os.urandom(2 * PIECE_SIZE + 17)
    sha = seed.store.add_bytes(data)
    rotten.store.add_bytes(data)
    tree = seed.store.tree(sha)
    for peer in (seed, rotten):
        peer.dht.provide(sha, store=peer.store)
    os.truncate(rotten.store.path(sha), PIECE_SIZE)
    report = other.dht.fetch_report(sha, size=len(data), max_size=len(data), store=other.store, tree=tree,
                                    progress=False)
    assert sha256_file(other.store.path(sha)) == sha
    assert {peer for peer, _, _ in report.segments} == {seed.id}, report
    assert not rotten.store.path(sha).exists(), "the truncated blob was kept"
