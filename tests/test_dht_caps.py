"""What one DHT peer stores: the network's store policy and the storage caps. First the caps' accounting
on a `CappedStorage` fed the values hivemind would store (no network), then floods, forged manifests,
allowlists and honest traffic between real hivemind peers on 127.0.0.1."""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable, Iterator

import msgspec
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hivemind.dht.routing import DHTID
from hivemind.dht.storage import DHTLocalStorage

from skillswarm.protocol import keys
from skillswarm.protocol.transport import storage_caps
from skillswarm.protocol.transport.blobs import BlobStore
from skillswarm.protocol.codec import encode_record
from skillswarm.protocol.transport.dht import SwarmDHT
from skillswarm.protocol.transport.dht_process import store_values
from skillswarm.protocol.identity import Identity
from skillswarm.protocol.records import (
    CheckpointManifest, DeltaManifest, FileEntry, NetworkSpec, PeerRecord, Record, SkillStats, TrainStats, TrustPolicy,
)
from skillswarm.protocol.transport.storage_caps import (
    MAX_BYTES_PER_AUTHOR, MAX_SUBKEYS_PER_KEY, MAX_VALUES_PER_AUTHOR, CappedStorage, install, newest_within_caps,
)
from skillswarm.protocol.transport.validation import StorePolicy
from tests.net_helpers import signed_dht_record, store_at

NET = "capped"
DELTA_CAP = MAX_VALUES_PER_AUTHOR["delta"]
T0 = time.time() - 3600  # records made an hour ago: fresh enough for every peer's validator, `created` + i orders them
coordinator, mallory = Identity.generate(), Identity.generate()


# ---- records and values -------------------------------------------------------------------------
def _delta(who: Identity, skill: str, version: int, created: float, network: str = NET) -> DeltaManifest:
    return who.sign_record(DeltaManifest(network=network, skill=skill, base_version=version, base_hash="a" * 64,
                                         blob=f"{version:064x}", size=1, codec="dense_bf16", norm=1.0, num_tensors=1),
                           created=created)


def _checkpoint(who: Identity, version: int, created: float | None = None, files: int = 1) -> CheckpointManifest:
    entries = [FileEntry(path=f"{'d' * 160}/shard-{i:03d}.safetensors", sha256=f"{version:032x}{i:032x}", size=1)
               for i in range(files)]
    parent = dict(parent_version=version - 1, parent_hash="a" * 64) if version else {}
    return who.sign_record(CheckpointManifest(network=NET, version=version, weights_hash="b" * 64, files=entries,
                                              **parent), created=created)


def _peer_record(who: Identity) -> PeerRecord:
    return who.sign_record(PeerRecord(network=NET, peer_id=who.peer_id, role="worker"))


def _value(who: Identity, record: Record, ttl: float = 600.0) -> tuple[bytes, bytes, bytes, float]:
    """(key id, msgpack subkey, signed value, expiration): a value as hivemind sends and stores it."""
    key, subkey = keys.locations(record)[0]
    r = signed_dht_record(who, encode_record(record), key, subkey, ttl=ttl)
    return r.key, r.subkey, r.value, r.expiration_time


def _put(storage: CappedStorage, item: tuple[bytes, bytes, bytes, float]) -> bool:
    key, subkey, value, expiration = item
    return storage.store(DHTID.from_bytes(key), value, expiration, subkey=msgspec.msgpack.decode(subkey))


def _author(usage: dict, who: Identity) -> dict:
    return usage["authors"].get(who.public_key_hex, {"bytes": 0, "values": {}})


# ---- the accounting, on one storage -------------------------------------------------------------
def test_a_flood_by_one_author_keeps_only_its_newest_values() -> None:
    storage = CappedStorage()
    flood = [_value(mallory, _delta(mallory, f"made-up-{i}", 0, created=T0 + i)) for i in range(3 * DELTA_CAP)]
    assert all(_put(storage, item) for item in flood)  # each newer one displaces the oldest
    usage = storage.ledger.usage()
    assert usage["values"] == DELTA_CAP and _author(usage, mallory)["values"] == {"delta": DELTA_CAP}
    kept = sorted(s for s, _ in storage.get(DHTID.from_bytes(flood[0][0])).value.items())
    assert kept == sorted(msgspec.msgpack.decode(item[1]) for item in flood[-DELTA_CAP:])
    # an older record than all it keeps is refused; another author is not affected by mallory's flood
    assert not _put(storage, _value(mallory, _delta(mallory, "late", 0, created=T0 - 1)))
    assert _put(storage, _value(coordinator, _delta(coordinator, "arith", 0, created=T0 - 1)))


def test_replacing_a_value_counts_once_and_expired_values_stop_counting() -> None:
    storage = CappedStorage()
    record = _peer_record(mallory)
    for ttl in range(100, 200, 10):  # a heartbeat: the same subkey, each time expiring later
        assert _put(storage, _value(mallory, record, ttl=ttl))
    item = _value(mallory, record, ttl=50)
    assert not _put(storage, item)  # expires sooner than the value stored: hivemind keeps the later one
    usage = storage.ledger.usage()
    assert usage["values"] == 1 and usage["bytes"] == len(item[2]) == usage["peer_bytes"]
    assert _put(storage, _value(coordinator, _peer_record(coordinator), ttl=0.5))
    assert storage.ledger.usage()["values"] == 2
    time.sleep(0.7)
    assert storage.ledger.usage()["values"] == 1 and coordinator.public_key_hex not in storage.ledger.usage()["authors"]


def test_a_full_key_drops_its_first_stored_value_and_takes_replacements(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(storage_caps, "MAX_SUBKEYS_PER_KEY", 4)
    storage = CappedStorage()
    authors = [Identity.generate() for _ in range(5)]
    assert [_put(storage, _value(a, _peer_record(a))) for a in authors] == [True] * 5
    peers = DHTID.generate(source=keys.peers_key(NET))
    assert {s for s, _ in storage.get(peers).value.items()} == {a.public_key_hex for a in authors[1:]}  # first out
    assert _put(storage, _value(authors[1], _peer_record(authors[1]), ttl=900))
    assert storage.ledger.usage()["values"] == 4


def test_the_byte_caps_per_author_and_per_peer(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(storage_caps, "MAX_BYTES_PER_AUTHOR", 40_000)
    big = [_value(coordinator, _checkpoint(coordinator, v, created=T0 + v, files=40)) for v in range(1, 9)]
    size = len(big[0][2])
    assert 10_000 < size < 20_000
    storage = CappedStorage()
    assert all(_put(storage, item) for item in big)
    held = _author(storage.ledger.usage(), coordinator)
    assert held["bytes"] <= 40_000 and held["values"]["checkpoint"] == 40_000 // size
    # the peer's cap is shared by its storage and cache, and refuses whoever comes next
    monkeypatch.setattr(storage_caps, "MAX_PEER_BYTES", 2 * size)
    node = SimpleNamespace(protocol=SimpleNamespace(storage=DHTLocalStorage(), cache=DHTLocalStorage()))
    install(node)
    assert _put(node.protocol.storage, big[0]) and _put(node.protocol.cache, big[1])
    assert not _put(node.protocol.storage, _value(mallory, _peer_record(mallory)))


def test_reads_hand_out_copies_and_install_readmits_what_was_stored() -> None:
    plain = DHTLocalStorage()  # what hivemind stored while the node joined, before the caps were installed
    for i in range(2 * DELTA_CAP):
        key, subkey, value, expiration = _value(mallory, _delta(mallory, f"s{i}", 0, created=T0 + i))
        plain.store(DHTID.from_bytes(key), value, expiration, subkey=msgspec.msgpack.decode(subkey))
    node = SimpleNamespace(protocol=SimpleNamespace(storage=plain, cache=DHTLocalStorage()))
    install(node)
    storage = node.protocol.storage
    assert isinstance(storage, CappedStorage) and storage.ledger.usage()["values"] == DELTA_CAP
    key = DHTID.generate(source=keys.deltas_key(NET, 0))
    storage.get(key).value.store("merged-by-a-search", b"x", time.time() + 60)  # what hivemind's get does
    assert storage.ledger.usage()["values"] == len(list(storage.get(key).value.items())) == DELTA_CAP


def test_a_reader_keeps_each_authors_newest_within_the_cap() -> None:
    entries = {}
    for i in range(DELTA_CAP + 5):
        record = _delta(mallory, f"s{i}", 0, created=float(i))
        entries[keys.locations(record)[0][1]] = (encode_record(record), time.time() + 60)
    entries["not-an-owner"] = (b"junk", 0.0)  # left for the facade, which drops it
    kept = newest_within_caps(entries)
    assert len(kept) == DELTA_CAP + 1 and f"{mallory.public_key_hex}:s0" not in kept


# ---- between real peers -------------------------------------------------------------------------
def _spec(**more: Any) -> NetworkSpec:
    return NetworkSpec(**{"network": NET, "base_model": "m", "base_hash": "a" * 64, "skills": ["arith", "rev"],
                          "coordinators": [coordinator.public_key_hex], **more})


# hivemind's pipe into the DHT process takes a few KB per call, so batches are built inside that process
# (a forked copy of this one: module-level functions and identities are there too) from a `make(i)`.
def _seeded(i: int) -> Identity:
    return Identity(Ed25519PrivateKey.from_private_bytes(i.to_bytes(32, "big")))


def _flood(i: int) -> tuple[str, str, bytes, float]:
    """500 deltas under invented skills, then 100 under a real skill on base versions 0-99, newest last."""
    skill, version = (f"made-up-{i}", i % 10) if i < 500 else ("arith", i - 500)
    record = _delta(mallory, skill, version, created=T0 + i)
    return (*keys.locations(record)[0], encode_record(record), time.time() + 3600)


def _big(i: int) -> tuple[bytes, bytes, bytes, float]:
    """The coordinator's manifest of version i, ~17 KB (64 files)."""
    return _value(coordinator, _checkpoint(coordinator, i, created=T0 + i, files=64))


def _crowd(i: int) -> tuple[bytes, bytes, bytes, float]:
    """Node i's PeerRecord: one key, one subkey per node."""
    return _value(_seeded(i), _peer_record(_seeded(i)), ttl=300)


async def _publish(_dht: Any, node: Any, make: Callable[[int], tuple], n: int) -> None:
    """Store `make(i)` for i < n the way a node does (hivemind signs under this node's subkeys)."""
    for i in range(0, n, 50):
        await store_values(_dht, node, [make(j) for j in range(i, min(n, i + 50))])


async def _store_at(_dht: Any, node: Any, peer: str, items: list | None = None, make: Callable[[int], tuple] | None = None,
                    lo: int = 0, hi: int = 0, chunk: int = 20) -> list[bool]:
    """Ask one peer to store pre-signed values (`items`, or `make(i)` for lo <= i < hi); its answer per value."""
    items = items if items is not None else [make(i) for i in range(lo, hi)]
    return await store_at(_dht, node, peer, items, chunk)


async def _stored_subkeys(_dht: Any, node: Any, keys: list[str]) -> dict[str, list[str]]:
    """The subkeys this peer holds in its own storage under each key."""
    out = {}
    for key in keys:
        item = node.protocol.storage.get(DHTID.generate(source=key))
        out[key] = sorted(s for s, _ in item.value.items()) if item is not None else []
    return out


def _store_at_all(sender: SwarmDHT, peer: SwarmDHT, items: list | None = None, **make: Any) -> list[bool]:
    return sender.run_coroutine(_store_at, peer=peer.peer_id, items=items, **make)


@pytest.fixture(scope="module")
def boot() -> Iterator[SwarmDHT]:
    """The network's bootstrap peer (`net serve --network FILE`): it applies the network's policy."""
    dht = SwarmDHT(NET, Identity.generate(), policy=StorePolicy.from_spec(_spec())).start()
    try:
        yield dht
    finally:
        dht.shutdown()


@pytest.fixture
def peers(boot: SwarmDHT) -> Iterator[list[SwarmDHT]]:
    """Start more peers with `peers.append(SwarmDHT(...).start())`; each is shut down after the test."""
    started: list[SwarmDHT] = []
    try:
        yield started
    finally:
        for dht in started:
            dht.shutdown()


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_flood_of_deltas_leaves_a_policy_peer_holding_at_most_the_cap(boot: SwarmDHT, peers: list[SwarmDHT]) -> None:
    peers.append(attacker := SwarmDHT(NET, mallory, initial_peers=boot.visible_maddrs()).start())
    attacker.run_coroutine(_publish, make=_flood, n=600)
    versions = [keys.deltas_key(NET, v) for v in range(100)]
    held = boot.run_coroutine(_stored_subkeys, keys=versions)
    subkeys = [s for found in held.values() for s in found]
    assert subkeys and all(s.endswith(":arith") for s in subkeys)  # none of the invented skills
    assert len(subkeys) <= DELTA_CAP
    usage = boot.storage_usage()["storage"]
    assert _author(usage, mallory)["values"].get("delta", 0) == len(subkeys)
    read = [d for v in range(100) for d in boot.get_deltas(v)]
    assert 0 < len(read) <= DELTA_CAP and {d.skill for d in read} == {"arith"}
    assert {d.base_version for d in read} == set(range(100 - len(read), 100))  # the newest ones


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_untrusted_checkpoints_are_refused(boot: SwarmDHT, peers: list[SwarmDHT]) -> None:
    peers.append(rogue := SwarmDHT(NET, Identity.generate(), initial_peers=boot.visible_maddrs()).start())
    rogue.put(_checkpoint(rogue.identity, 90), ttl=600)  # a valid signature, by a key the network does not trust
    assert rogue.identity.public_key_hex not in boot.storage_usage()["storage"]["authors"]
    assert boot.get_checkpoint(90, trusted=[coordinator.public_key_hex]) is None
    assert boot.latest_checkpoint(trusted=None) is None  # refused at the DHT level, even from the rogue's own storage
    # A peer without a network file (the rogue here) cannot tell a coordinator: it keeps no manifest past an hour.
    long, short = (_value(coordinator, _checkpoint(coordinator, 91), ttl=ttl) for ttl in (86400, 1800))
    assert _store_at_all(boot, rogue, [long, short]) == [False, True]
    assert _store_at_all(rogue, boot, [long]) == [True]  # the network's own coordinator: a day is fine


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_an_allowlist_network_stores_deltas_of_listed_keys_only(peers: list[SwarmDHT]) -> None:
    alice = Identity.generate()
    spec = _spec(trust=TrustPolicy(admission="allowlist", workers=[alice.public_key_hex]))
    peers.append(host := SwarmDHT(NET, Identity.generate(), policy=StorePolicy.from_spec(spec)).start())
    peers.append(sender := SwarmDHT(NET, Identity.generate(), initial_peers=host.visible_maddrs()).start())
    listed, unlisted = _delta(alice, "arith", 5, time.time()), _delta(mallory, "arith", 5, time.time())
    assert _store_at_all(sender, host, [_value(alice, listed), _value(mallory, unlisted)]) == [True, False]
    assert [d.author for d in host.get_deltas(5)] == [alice.public_key_hex]


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_the_byte_cap_per_author_and_the_subkey_cap_per_key_hold(peers: list[SwarmDHT]) -> None:
    peers.append(host := SwarmDHT(NET, Identity.generate()).start())  # a bootstrap peer without a network file
    peers.append(sender := SwarmDHT(NET, Identity.generate(), initial_peers=host.visible_maddrs()).start())
    # One author's big manifests (~17 KB each, 300 of them: 5 MB): the newest that fit in 4 MiB stay.
    size = len(_big(1)[2])
    assert all(_store_at_all(sender, host, make=_big, lo=1, hi=301))
    held = _author(host.storage_usage()["storage"], coordinator)
    assert MAX_BYTES_PER_AUTHOR - 2 * size < held["bytes"] <= MAX_BYTES_PER_AUTHOR
    kept = held["values"]["checkpoint"]
    assert kept < 300
    assert _store_at_all(sender, host, make=_big, lo=1, hi=2) == [False]  # older than everything it keeps
    newest = [keys.checkpoint_key(NET, v) for v in range(301 - kept, 301)]
    assert all(host.run_coroutine(_stored_subkeys, keys=newest).values())
    # One key, more authors than it may hold: each value past MAX_SUBKEYS_PER_KEY displaces the one stored first.
    ok = _store_at_all(sender, host, make=_crowd, lo=1, hi=MAX_SUBKEYS_PER_KEY + 51, chunk=200)
    assert ok == [True] * (MAX_SUBKEYS_PER_KEY + 50)
    peers = keys.peers_key(NET)
    assert host.storage_usage()["storage"]["keys"][DHTID.generate(source=peers).to_bytes().hex()] == MAX_SUBKEYS_PER_KEY
    held = set(host.run_coroutine(_stored_subkeys, keys=[peers])[peers])
    assert held == {_seeded(i).public_key_hex for i in range(51, MAX_SUBKEYS_PER_KEY + 51)}
    first = _seeded(1)
    assert _store_at_all(sender, host, [_value(first, _peer_record(first), ttl=600)]) == [True]  # a heartbeat


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_honest_workers_and_coordinators_are_stored_and_read_back(boot: SwarmDHT, peers: list[SwarmDHT],
                                                                  tmp_path: Path) -> None:
    policy = StorePolicy.from_spec(_spec())
    join = boot.visible_maddrs()
    peers.append(worker := SwarmDHT(NET, Identity.generate(), initial_peers=join, policy=policy).start())
    peers.append(coord := SwarmDHT(NET, coordinator, initial_peers=join, policy=policy).start())
    peers.append(reader := SwarmDHT(NET, Identity.generate(), initial_peers=join, policy=policy, client_mode=True).start())
    worker.start_heartbeat(lambda: worker.make_peer_record(role="worker", skills=["rev"], engine="hf"))
    assert worker.put(SkillStats(network=NET, skill="rev", checkpoint_version=2, stats=TrainStats(steps=3)), 300)
    blobs = BlobStore(tmp_path / "blobs")
    sha = blobs.add_bytes(b"a delta's bytes")
    worker.provide(sha, store=blobs)
    delta = DeltaManifest(network=NET, skill="rev", base_version=2, base_hash="a" * 64, blob=sha, size=15,
                          codec="dense_bf16", norm=1.0, num_tensors=1)
    assert worker.put(delta, 86400, keep=True)  # node/roles/worker.py DELTA_TTL
    for v in (0, 1, 2):
        assert coord.put(_checkpoint(coordinator, v), 86400, keep=True)  # node/roles/coordinator.py MANIFEST_TTL
    me = worker.identity.public_key_hex
    assert me in {p.author for p in reader.get_peers()}
    assert [s.stats.steps for s in reader.get_skill_stats("rev")] == [3]
    assert [p.peer_id for p in reader.get_providers(sha)] == [worker.identity.peer_id]
    assert [(d.author, d.blob) for d in reader.get_deltas(2)] == [(me, sha)]
    trusted = [coordinator.public_key_hex]
    assert [c.version for c in reader.get_checkpoints(trusted=trusted)] == [0, 1, 2]
    assert reader.latest_checkpoint(trusted=trusted).version == 2
    assert boot.storage_usage()["storage"]["authors"][me]["values"] == {"peer": 1, "skill_stats": 1, "provider": 1,
                                                                        "delta": 1}
    manifests = [keys.checkpoint_key(NET, v) for v in (0, 1, 2)] + [keys.latest_checkpoint_key(NET)]
    assert set(map(tuple, boot.run_coroutine(_stored_subkeys, keys=manifests).values())) == {(trusted[0],)}
