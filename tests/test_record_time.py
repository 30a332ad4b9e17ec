"""No author's clock is trusted: a real peer refuses a record `created` in the future (1e11: the year 5138) or
too long ago for its kind, takes an honest one, and an honest node's own old records are re-signed fresh when
it stores them again. The storage caps never let `created` decide whose value a full key drops."""

from __future__ import annotations

import time
from typing import Iterator

import msgspec
import pytest
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord

from skillswarm.protocol import keys
from skillswarm.protocol.codec import decode_record, encode_record
from skillswarm.protocol.identity import Identity
from skillswarm.protocol.records import (
    CheckpointManifest, DeltaManifest, FileEntry, NetworkSpec, PeerRecord, ProviderRecord, Record,
)
from skillswarm.protocol.transport import storage_caps
from skillswarm.protocol.transport.dht import SwarmDHT
from skillswarm.protocol.transport.storage_caps import CappedStorage
from skillswarm.protocol.transport.validation import (
    CLOCK_SKEW, MAX_TTL, OwnerSignatureValidator, StorePolicy, _signed_message,
)
from tests.net_helpers import store_at

NET = "clocks"
coordinator = Identity.generate()


# ---- values as any program speaking hivemind's protocol can make them --------------------------------
def _peer(who: Identity, created: float) -> PeerRecord:
    return who.sign_record(PeerRecord(network=NET, peer_id=who.peer_id, role="worker"), created=created)


def _provider(who: Identity, created: float) -> ProviderRecord:
    return who.sign_record(ProviderRecord(network=NET, peer_id=who.peer_id, blob="e" * 64, size=3), created=created)


def _checkpoint(who: Identity, version: int, created: float | None = None) -> CheckpointManifest:
    parent = dict(parent_version=version - 1, parent_hash="a" * 64) if version else {}
    return who.sign_record(CheckpointManifest(network=NET, version=version, weights_hash="b" * 64,
                                              files=[FileEntry(path="model.safetensors", sha256="c" * 64, size=1)],
                                              **parent), created=created)


def _raw(who: Identity, record: Record, ttl: float) -> tuple[bytes, bytes, bytes, float]:
    """(key id, msgpack subkey, value, expiration), the owner signature made directly by `who`: exactly these
    record bytes, whatever their `created` (a node's own store path would re-sign a stale record first)."""
    key, subkey = keys.locations(record)[0]
    body = msgspec.msgpack.encode(encode_record(record))
    unsigned = DHTRecord(DHTID.generate(source=key).to_bytes(), msgspec.msgpack.encode(subkey), body, time.time() + ttl)
    return unsigned.key, unsigned.subkey, body + who.sign(_signed_message(unsigned, body)), unsigned.expiration_time


def _as_dht_record(item: tuple[bytes, bytes, bytes, float]) -> DHTRecord:
    return DHTRecord(*item)


# ---- the validator, called as hivemind calls it ----------------------------------------------------
def test_the_validator_checks_created_against_its_own_clock() -> None:
    who, check = Identity.generate(), OwnerSignatureValidator().validate
    now = time.time()
    assert check(_as_dht_record(_raw(who, _peer(who, now), ttl=30)))
    assert check(_as_dht_record(_raw(who, _peer(who, now + CLOCK_SKEW / 2), ttl=30)))  # a clock a little ahead
    assert not check(_as_dht_record(_raw(who, _peer(who, 1e11), ttl=30)))  # the year 5138
    assert not check(_as_dht_record(_raw(who, _peer(who, now + 2 * CLOCK_SKEW), ttl=30)))
    assert not check(_as_dht_record(_raw(who, _peer(who, now - MAX_TTL["peer"] - 2 * CLOCK_SKEW), ttl=30)))  # stale
    # a value may expire at most its kind's lifetime after its record was created, however often it is re-stored
    lifetime = MAX_TTL["provider"]
    assert check(_as_dht_record(_raw(who, _provider(who, now - lifetime + 600), ttl=600)))
    assert not check(_as_dht_record(_raw(who, _provider(who, now - lifetime + 400), ttl=600)))


def test_a_nodes_own_stale_record_is_re_signed_fresh_when_stored() -> None:
    me = Identity.generate()
    signer = OwnerSignatureValidator(me)
    old = _checkpoint(me, 4, created=time.time() - 3 * 86400)  # a version kept for days, re-stored as it was
    expiration, signed = time.time() + 86400, []  # node/roles/coordinator.py MANIFEST_TTL
    for key, subkey in keys.locations(old):  # both places one put writes, signed one after the other
        unsigned = DHTRecord(DHTID.generate(source=key).to_bytes(), msgspec.msgpack.encode(subkey),
                             msgspec.msgpack.encode(encode_record(old)), expiration)
        signed.append(DHTRecord(unsigned.key, unsigned.subkey, signer.sign_value(unsigned), expiration))
        time.sleep(0.01)
    trusting = OwnerSignatureValidator(policy=StorePolicy(NET, frozenset({"arith"}), frozenset({me.public_key_hex})))
    assert all(trusting.validate(r) for r in signed)
    bodies = {signer.strip_value(r) for r in signed}
    assert len(bodies) == 1  # the same record at both locations
    fresh = decode_record(msgspec.msgpack.decode(bodies.pop(), type=bytes), CheckpointManifest)
    assert time.time() - 60 < fresh.created <= time.time()
    assert msgspec.structs.replace(fresh, created=old.created, signature=old.signature) == old
    # someone else's record is signed as given (every honest peer will refuse it if stale)
    other = Identity.generate()
    stale = _raw(other, _peer(other, time.time() - 3600), ttl=30)
    unsigned = DHTRecord(stale[0], stale[1], stale[2][:-64], stale[3])
    assert OwnerSignatureValidator(other).sign_value(unsigned)[:-64] != unsigned.value  # its own: refreshed
    assert signer.sign_value(unsigned) == unsigned.value  # not mine: untouched, unsigned


# ---- the caps: a full key never asks `created` -----------------------------------------------------
def _put(storage: CappedStorage, item: tuple[bytes, bytes, bytes, float]) -> bool:
    key, subkey, value, expiration = item
    return storage.store(DHTID.from_bytes(key), value, expiration, subkey=msgspec.msgpack.decode(subkey))


def _held(storage: CappedStorage, key: str) -> set[str]:
    item = storage.get(DHTID.generate(source=key))
    return {s for s, _ in item.value.items()} if item is not None else set()


def test_a_full_key_drops_the_value_it_stored_first_whatever_its_created(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(storage_caps, "MAX_SUBKEYS_PER_KEY", 4)
    storage = CappedStorage()
    now = time.time()
    boaster, *others = [Identity.generate() for _ in range(5)]
    # stored first, claiming to be the newest there is (no validator here: the caps alone must not believe it)
    assert _put(storage, _raw(boaster, _peer(boaster, 1e11), ttl=300))
    for who in others[:3]:
        assert _put(storage, _raw(who, _peer(who, now - 500), ttl=300))
    late = others[3]
    assert _put(storage, _raw(late, _peer(late, 0.0), ttl=300))  # claims to be the oldest there is
    assert _held(storage, keys.peers_key(NET)) == {w.public_key_hex for w in others}
    # the same record stored again (a republish, a later expiration) keeps its place; a new record is new
    first = others[0]
    again = _peer(first, now - 500)
    assert _put(storage, _raw(first, again, ttl=400))
    newcomer = Identity.generate()
    assert _put(storage, _raw(newcomer, _peer(newcomer, now), ttl=300))
    assert first.public_key_hex not in _held(storage, keys.peers_key(NET))


def test_the_author_holding_most_of_a_full_key_loses_first(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(storage_caps, "MAX_SUBKEYS_PER_KEY", 6)
    storage = CappedStorage()
    honest, flooder = Identity.generate(), Identity.generate()

    def delta(who: Identity, skill: str, created: float) -> DeltaManifest:
        return who.sign_record(DeltaManifest(network=NET, skill=skill, base_version=1, base_hash="a" * 64,
                                             blob="b" * 64, size=1, codec="int8", norm=1.0, num_tensors=1),
                               created=created)

    now = time.time()
    assert _put(storage, _raw(honest, delta(honest, "arith", now - 100), ttl=600))  # the oldest value of all
    for i in range(5):
        assert _put(storage, _raw(flooder, delta(flooder, f"s{i}", now + i), ttl=600))
    for i in range(5, 10):  # each displaces the flooder's own oldest, never the honest value stored before them
        assert _put(storage, _raw(flooder, delta(flooder, f"s{i}", now + i), ttl=600))
    held = _held(storage, keys.deltas_key(NET, 1))
    assert f"{honest.public_key_hex}:arith" in held
    assert held - {f"{honest.public_key_hex}:arith"} == {f"{flooder.public_key_hex}:s{i}" for i in range(5, 10)}


def test_a_full_keys_bytes_stay_far_below_a_message() -> None:
    from hivemind.p2p.p2p_daemon_bindings.control import DEFAULT_MAX_MSG_SIZE

    assert storage_caps.MAX_BYTES_PER_KEY <= DEFAULT_MAX_MSG_SIZE // 4


# ---- a real peer ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def pair() -> Iterator[tuple[SwarmDHT, SwarmDHT]]:
    spec = NetworkSpec(network=NET, base_model="m", base_hash="a" * 64, skills=["arith"],
                       coordinators=[coordinator.public_key_hex])
    host = SwarmDHT(NET, Identity.generate(), policy=StorePolicy.from_spec(spec)).start()
    try:
        sender = SwarmDHT(NET, coordinator, initial_peers=host.visible_maddrs(), policy=StorePolicy.from_spec(spec))
        try:
            yield host, sender.start()
        finally:
            sender.shutdown()
    finally:
        host.shutdown()


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_real_peer_refuses_records_from_the_future_and_stale_ones(pair: tuple[SwarmDHT, SwarmDHT]) -> None:
    host, sender = pair
    now = time.time()
    future, stale, honest, skewed = (Identity.generate() for _ in range(4))
    items = [_raw(future, _peer(future, 1e11), ttl=300), _raw(stale, _peer(stale, now - 3600), ttl=300),
             _raw(honest, _peer(honest, now), ttl=300), _raw(skewed, _peer(skewed, now + 20), ttl=300)]
    assert sender.run_coroutine(store_at, peer=host.peer_id, items=items) == [False, False, True, True]
    seen = {p.author for p in host.get_peers()}
    assert {honest.public_key_hex, skewed.public_key_hex} <= seen
    assert not seen & {future.public_key_hex, stale.public_key_hex}
    assert not {future.public_key_hex, stale.public_key_hex} & set(host.storage_usage()["storage"]["authors"])


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_an_honest_node_republishing_an_old_record_still_gets_it_stored(pair: tuple[SwarmDHT, SwarmDHT]) -> None:
    host, coord = pair
    started = time.time()
    old = _checkpoint(coordinator, 7, created=started - 3 * 86400)  # a version a coordinator keeps for days
    assert coord.put(old, ttl=86400)  # node/roles/coordinator.py MANIFEST_TTL, re-stored as it was signed
    trusted = [coordinator.public_key_hex]
    [got] = [c for c in host.get_checkpoints(trusted=trusted) if c.version == 7]  # one, at both of its locations
    assert got.created >= started - 1 and got.weights_hash == old.weights_hash
    assert host.latest_checkpoint(trusted=trusted).signature == got.signature
    provider = _provider(coordinator, started - MAX_TTL["provider"] - 600)  # announced long ago, still kept
    assert coord.put(provider, ttl=600)
    [found] = host.get_providers("e" * 64)
    assert found.created >= started - 1
