"""The DHT key layout and the owner-signature validator every peer runs (no network: the validator is
called exactly as hivemind calls it, on DHTRecords made the way hivemind makes them)."""

from __future__ import annotations

import time

import msgspec
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord

from skillswarm.protocol import keys
from skillswarm.protocol.codec import encode_record
from skillswarm.protocol.identity import Identity
from skillswarm.protocol.records import (
    CheckpointManifest, DeltaManifest, FileEntry, PeerRecord, ProviderRecord, Record, SkillStats, TrainStats,
)
from skillswarm.protocol.validation import OwnerSignatureValidator
from tests.net_helpers import signed_dht_record

NET = "demo"
alice, bob = Identity.generate(), Identity.generate()


def _peer(who: Identity, **over) -> PeerRecord:
    return who.sign_record(PeerRecord(**{"network": NET, "peer_id": who.peer_id, "role": "worker", "skills": ["arith"], **over}),
                           validate=False)  # some tests forge bad records


def _checkpoint(who: Identity, version: int = 3) -> CheckpointManifest:
    return who.sign_record(CheckpointManifest(
        network=NET, version=version, parent_version=version - 1, parent_hash="a" * 64, weights_hash="b" * 64,
        files=[FileEntry(path="model.safetensors", sha256="c" * 64, size=10)]))


def _stored(record: Record, signer: Identity | None = None, where: int = 0, **kw) -> DHTRecord:
    key, subkey = keys.locations(record)[where]
    return signed_dht_record(signer or alice, encode_record(record), key, subkey, **kw)


validator = OwnerSignatureValidator()


def test_every_dht_record_kind_has_a_namespaced_location() -> None:
    stats = alice.sign_record(SkillStats(network=NET, skill="arith", checkpoint_version=2, stats=TrainStats()))
    delta = alice.sign_record(DeltaManifest(network=NET, skill="rev", base_version=4, base_hash="a" * 64, blob="b" * 64,
                                            size=1, codec="dense_bf16", norm=1.0, num_tensors=1))
    provider = alice.sign_record(ProviderRecord(network=NET, peer_id=alice.peer_id, blob="d" * 64, size=5))
    me = alice.public_key_hex
    assert keys.locations(_peer(alice)) == [("skillswarm/v1/demo/peers", me)]
    assert keys.locations(delta) == [("skillswarm/v1/demo/deltas/4", f"{me}:rev")]
    assert keys.locations(_checkpoint(alice)) == [("skillswarm/v1/demo/checkpoints/3", me),
                                                  ("skillswarm/v1/demo/checkpoints/latest", me)]
    assert keys.locations(stats) == [("skillswarm/v1/demo/skills/arith", me)]
    assert keys.locations(provider) == [(f"skillswarm/v1/demo/providers/{'d' * 64}", me)]
    assert keys.subkey_owner(f"{me}:rev") == me and keys.subkey_owner(me) == me
    for bad in (None, b"x", "x" * 64, f"{me}:Bad Tag", me.upper()):
        assert keys.subkey_owner(bad) is None


def test_a_record_under_its_authors_subkey_at_its_own_location_is_accepted() -> None:
    for record, where in [(_peer(alice), 0), (_checkpoint(alice), 0), (_checkpoint(alice), 1)]:
        stored = _stored(record, where=where)
        assert validator.validate(stored)
        assert msgspec.msgpack.decode(validator.strip_value(stored)) == encode_record(record)


def test_only_the_owner_can_write_its_subkey() -> None:
    key, alice_sub = keys.locations(_peer(alice))[0]
    # Bob's own valid record, put under Alice's subkey: Bob cannot sign for Alice's key.
    assert not validator.validate(signed_dht_record(bob, encode_record(_peer(bob)), key, alice_sub))
    # Even signed at the DHT level by Alice's key, a record authored by Bob does not belong there.
    assert not validator.validate(signed_dht_record(alice, encode_record(_peer(bob)), key, alice_sub))
    # A signature by Bob over a value for Alice's subkey (forged owner signature).
    good = _stored(_peer(alice))
    forged = good.value[:-64] + bob.sign(b"anything")
    assert not validator.validate(DHTRecord(good.key, good.subkey, forged, good.expiration_time))


def test_a_replayed_value_with_a_later_expiration_is_rejected() -> None:
    good = _stored(_peer(alice), ttl=10)
    assert validator.validate(good)
    assert not validator.validate(DHTRecord(good.key, good.subkey, good.value, good.expiration_time + 500))


def test_records_are_bound_to_the_location_their_content_names() -> None:
    peer = _peer(alice)
    me = alice.public_key_hex
    for key in ["skillswarm/v1/other/peers", "skillswarm/v2/demo/peers", "skillswarm/v1/demo/deltas/0", "anything"]:
        assert not validator.validate(signed_dht_record(alice, encode_record(peer), key, me))
    # a checkpoint of version 3 under version 4's key
    assert not validator.validate(signed_dht_record(alice, encode_record(_checkpoint(alice)), "skillswarm/v1/demo/checkpoints/4", me))
    # a delta under the right key with another skill's subkey
    delta = alice.sign_record(DeltaManifest(network=NET, skill="rev", base_version=4, base_hash="a" * 64, blob="b" * 64,
                                            size=1, codec="dense_bf16", norm=1.0, num_tensors=1))
    assert validator.validate(_stored(delta))
    assert not validator.validate(signed_dht_record(alice, encode_record(delta), "skillswarm/v1/demo/deltas/4", f"{me}:arith"))


def test_a_peer_record_must_name_its_authors_peer_id() -> None:
    assert not validator.validate(_stored(_peer(alice, peer_id=bob.peer_id)))


def test_malformed_oversized_and_unsigned_values_are_dropped() -> None:
    key, sub = keys.locations(_peer(alice))[0]
    for junk in [b"junk", b"\x00" * 20_000, {"not": "bytes"}, 42]:
        assert not validator.validate(signed_dht_record(alice, junk, key, sub))
    # schema violation (a role that does not exist), properly signed at both levels
    assert not validator.validate(_stored(_peer(alice, role="king")))
    # content altered after the record was signed (its DHT-level signature is fresh and valid)
    tampered = msgspec.structs.replace(_peer(alice), skills=["rev"])
    assert not validator.validate(_stored(tampered))
    # no owner subkey at all (hivemind's plain values and whole-dictionary stores)
    data = msgspec.msgpack.encode(encode_record(_peer(alice)))
    for subkey in (msgspec.msgpack.encode(None), b""):
        assert not validator.validate(DHTRecord(DHTID.generate(source=key).to_bytes(), subkey, data + b"s" * 64, time.time() + 5))


def test_expiration_beyond_a_kinds_lifetime_is_rejected() -> None:
    assert validator.validate(_stored(_peer(alice), ttl=300))
    assert not validator.validate(_stored(_peer(alice), ttl=3600))  # a PeerRecord lives minutes, not hours
    assert validator.validate(_stored(_checkpoint(alice), ttl=86400))


def test_only_own_subkeys_get_signed() -> None:
    key, bob_sub = keys.locations(_peer(bob))[0]
    rec = DHTRecord(DHTID.generate(source=key).to_bytes(), msgspec.msgpack.encode(bob_sub), b"value", time.time() + 5)
    assert OwnerSignatureValidator(alice).sign_value(rec) == b"value"
    assert OwnerSignatureValidator(None).sign_value(rec) == b"value"
