"""A flood of heartbeats from fresh keys, between real hivemind peers on 127.0.0.1: 1,100 PeerRecords of 7.3 KB
(as big as a PeerRecord gets), each from its own key, sent straight to the network's peers as any program speaking
hivemind's protocol can. It used to fill the peers key at every peer (1,024 values, 7.5 MB): a read of the key then
overflowed hivemind's 4 MiB message, so an inspector saw no peer at all and a coordinator none of its workers.

- An allowlist network stores none of it, and its workers and coordinator stay visible.
- An open network keeps each read of the key far below a message, and a worker that heartbeats after the flood
  is seen, as is one that heartbeated before it.
"""

from __future__ import annotations

import time
from typing import Any, Iterator

import msgspec
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord
from hivemind.p2p.p2p_daemon_bindings.control import DEFAULT_MAX_MSG_SIZE
from hivemind.utils.serializer import MSGPackSerializer

from skillswarm.protocol import keys
from skillswarm.protocol.codec import encode_record
from skillswarm.protocol.identity import Identity
from skillswarm.protocol.records import MAX_BYTES, Hardware, NetworkSpec, PeerRecord, ProviderRecord, TrustPolicy
from skillswarm.protocol.transport.dht import SwarmDHT
from skillswarm.protocol.transport import storage_caps
from skillswarm.protocol.transport.validation import OwnerSignatureValidator, StorePolicy, _signed_message
from tests.net_helpers import store_at, wait_for

NET = "flooded"
FLOOD = 1100
coordinator, alice = Identity.generate(), Identity.generate()


def _spec(**more: Any) -> NetworkSpec:
    return NetworkSpec(network=NET, base_model="m", base_hash="a" * 64, skills=["arith"],
                       coordinators=[coordinator.public_key_hex], **more)


def _fresh_key(i: int) -> Identity:
    return Identity(Ed25519PrivateKey.from_private_bytes((1_000_003 + i).to_bytes(32, "big")))


def _fat_heartbeat(i: int) -> tuple[bytes, bytes, bytes, float]:
    """Flooder i's PeerRecord, every field at its longest, as the value a peer stores: (key id, msgpack subkey,
    value with the owner signature, expiration)."""
    who = _fresh_key(i)
    record = who.sign_record(PeerRecord(
        network=NET, peer_id=who.peer_id, role="worker", note="n" * 256, software="v" * 64,
        addrs=[f"/dns4/{'a' * 200}{j:02d}.example/tcp/{4000 + j}/p2p/{who.peer_id}"[:256] for j in range(16)],
        skills=[f"{j:02d}{'s' * 62}" for j in range(32)], hardware=Hardware(device="cuda", accelerator="g" * 256)))
    return _signed(who, record, ttl=300)


def _signed(who: Identity, record: Any, ttl: float) -> tuple[bytes, bytes, bytes, float]:
    """`record` as the value a peer stores under its location, with `who`'s owner signature."""
    key, subkey = keys.locations(record)[0]
    body = msgspec.msgpack.encode(encode_record(record))
    unsigned = DHTRecord(DHTID.generate(source=key).to_bytes(), msgspec.msgpack.encode(subkey), body, time.time() + ttl)
    return unsigned.key, unsigned.subkey, body + who.sign(_signed_message(unsigned, body)), unsigned.expiration_time


@pytest.fixture(scope="module")
def flood() -> list[tuple[bytes, bytes, bytes, float]]:
    items = [_fat_heartbeat(i) for i in range(FLOOD)]
    assert MAX_BYTES["peer"] - 1024 < len(items[0][2]) < MAX_BYTES["peer"] + 128
    return items


async def _peers_key_read(_dht: Any, node: Any) -> tuple[int, int]:
    """(values, bytes) of what this peer sends for a read of the peers key: its storage's or its cache's
    dictionary, the one expiring later, as `rpc_find` serializes it."""
    key = DHTID.generate(source=keys.peers_key(NET))
    found = [item for item in (node.protocol.storage.get(key), node.protocol.cache.get(key)) if item is not None]
    if not found:
        return 0, 0
    item = max(found, key=lambda item: item.expiration_time)
    return len(list(item.value.items())), len(MSGPackSerializer.dumps(item.value))


def _send(attacker: SwarmDHT, to: SwarmDHT, items: list) -> list[bool]:
    out: list[bool] = []
    for i in range(0, len(items), 275):  # a few MB per call into the attacker's DHT process
        out += attacker.run_coroutine(store_at, peer=to.peer_id, items=items[i:i + 275], timeout=120)
    return out


@pytest.fixture
def started() -> Iterator[list[SwarmDHT]]:
    peers: list[SwarmDHT] = []
    try:
        yield peers
    finally:
        for dht in reversed(peers):
            dht.shutdown()


def _authors(reader: SwarmDHT) -> set[str]:
    return {p.author for p in reader.get_peers()}


def test_an_allowlist_network_admits_heartbeats_and_providers_of_its_members_only() -> None:
    boot_key, stranger = Identity.generate(), Identity.generate()
    spec = _spec(trust=TrustPolicy(admission="allowlist", workers=[alice.public_key_hex]),
                 bootstrap=[f"/ip4/10.0.0.1/tcp/31337/p2p/{boot_key.peer_id}"])
    check = OwnerSignatureValidator(policy=StorePolicy.from_spec(spec)).validate
    open_check = OwnerSignatureValidator(policy=StorePolicy.from_spec(_spec())).validate

    def stored(who: Identity, record: Any) -> DHTRecord:
        return DHTRecord(*_signed(who, who.sign_record(record), ttl=60))

    def heartbeat(who: Identity, role: str) -> PeerRecord:
        return PeerRecord(network=NET, peer_id=who.peer_id, role=role)

    def provider(who: Identity) -> ProviderRecord:
        return ProviderRecord(network=NET, peer_id=who.peer_id, blob="f" * 64, size=1)

    for who, role in [(alice, "worker"), (coordinator, "coordinator"), (boot_key, "bootstrap")]:
        assert check(stored(who, heartbeat(who, role))), role
    assert check(stored(alice, provider(alice))) and check(stored(coordinator, provider(coordinator)))
    assert not check(stored(stranger, heartbeat(stranger, "observer")))
    assert not check(stored(stranger, provider(stranger)))  # a `pull` with a throwaway key serves nobody here
    assert check(stored(boot_key, provider(boot_key)))  # a bootstrap peer may serve blobs: an archive node
    assert open_check(stored(stranger, heartbeat(stranger, "worker"))) and open_check(stored(stranger, provider(stranger)))


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_an_allowlist_network_stores_no_flood_and_its_members_stay_visible(flood: list, started: list[SwarmDHT]) -> None:
    policy = StorePolicy.from_spec(_spec(trust=TrustPolicy(admission="allowlist", workers=[alice.public_key_hex])))
    started.append(boot := SwarmDHT(NET, Identity.generate(), policy=policy).start())
    join = boot.visible_maddrs()
    started.append(worker := SwarmDHT(NET, alice, initial_peers=join, policy=policy).start())
    started.append(coord := SwarmDHT(NET, coordinator, initial_peers=join, policy=policy).start())
    worker.start_heartbeat(lambda: worker.make_peer_record(role="worker", skills=["arith"]), interval=2, ttl=6)
    coord.start_heartbeat(lambda: coord.make_peer_record(role="coordinator"), interval=2, ttl=6)
    members = {alice.public_key_hex, coordinator.public_key_hex}
    wait_for(lambda: _authors(coord) >= members, 20, "the members' heartbeats")
    started.append(attacker := SwarmDHT(NET, Identity.generate(), initial_peers=join, client_mode=True).start())
    for peer in (boot, worker, coord):
        assert not any(_send(attacker, peer, flood)), "a peer of an allowlist network stored a stranger's heartbeat"
        assert set(peer.storage_usage()["storage"]["authors"]) <= members
    # an inspector (`net status` reads in client mode, from the others' storage) and the coordinator see the members
    started.append(reader := SwarmDHT(NET, Identity.generate(), initial_peers=join, policy=policy,
                                      client_mode=True).start())
    assert wait_for(lambda: _authors(reader) == members, 20, "the members, read by an inspector")
    assert wait_for(lambda: alice.public_key_hex in _authors(coord), 20, "the worker, read by the coordinator")


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_an_open_network_keeps_reads_small_and_sees_workers_through_a_flood(flood: list, started: list[SwarmDHT]) -> None:
    policy = StorePolicy.from_spec(_spec())
    started.append(boot := SwarmDHT(NET, Identity.generate(), policy=policy).start())
    join = boot.visible_maddrs()
    started.append(before := SwarmDHT(NET, Identity.generate(), initial_peers=join, policy=policy).start())
    before.start_heartbeat(lambda: before.make_peer_record(role="worker", skills=["arith"]), interval=2, ttl=6)
    started.append(attacker := SwarmDHT(NET, Identity.generate(), initial_peers=join, client_mode=True).start())
    for peer in (boot, before):
        _send(attacker, peer, flood)
        values, size = peer.run_coroutine(_peers_key_read)
        assert 0 < values < FLOOD and size <= DEFAULT_MAX_MSG_SIZE // 4, (values, size)  # a full key's read
    # a new worker heartbeats after the flood: the flood's oldest values make room for it
    started.append(after := SwarmDHT(NET, Identity.generate(), initial_peers=join, policy=policy).start())
    after.start_heartbeat(lambda: after.make_peer_record(role="worker", skills=["arith"]), interval=2, ttl=6)
    started.append(reader := SwarmDHT(NET, Identity.generate(), initial_peers=join, policy=policy,
                                      client_mode=True).start())
    workers = {before.identity.public_key_hex, after.identity.public_key_hex}
    seen = wait_for(lambda: (found := _authors(reader)) >= workers and found, 30, "both workers, read by an inspector")
    assert len(seen) > len(workers)  # the flood is there too, within the key's caps: the read did not fail
    for peer in (boot, before, after):
        values, size = peer.run_coroutine(_peers_key_read)
        assert size <= storage_caps.MAX_BYTES_PER_KEY <= DEFAULT_MAX_MSG_SIZE // 4, (values, size)
