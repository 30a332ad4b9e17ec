"""The DHT key layout, the owner-signature validator every peer runs and the network's store policy (no
network: the validator is called exactly as hivemind calls it, on DHTRecords made the way hivemind makes them)."""

from __future__ import annotations

import time

import msgspec
import pytest
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord

from skillswarm.protocol import keys
from skillswarm.protocol.codec import encode_record
from skillswarm.protocol.identity import Identity
from skillswarm.protocol.records import (
    CheckpointManifest, DeltaManifest, FileEntry, NetworkSpec, PeerRecord, ProviderRecord, Record, SkillStats,
    TrainStats, TrustPolicy,
)
from skillswarm.protocol.transport.validation import MAX_TTL, OwnerSignatureValidator, StorePolicy
from skillswarm.protocol.version import PROTOCOL_VERSION
from tests.net_helpers import signed_dht_record

NET = "demo"
V = f"skillswarm/v{PROTOCOL_VERSION}"  # this protocol's key prefix
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
    assert keys.locations(_peer(alice)) == [(f"{V}/demo/peers", me)]
    assert keys.locations(delta) == [(f"{V}/demo/deltas/4", f"{me}:rev")]
    assert keys.locations(_checkpoint(alice)) == [(f"{V}/demo/checkpoints/3", me),
                                                  (f"{V}/demo/checkpoints/latest", me)]
    assert keys.locations(stats) == [(f"{V}/demo/skills/arith", me)]
    assert keys.locations(provider) == [(f"{V}/demo/providers/{'d' * 64}", me)]
    # a record keeps the protocol it was written under: an older one lives under that protocol's keys
    older = msgspec.structs.replace(_checkpoint(alice), protocol=PROTOCOL_VERSION - 1)
    assert keys.locations(older)[0] == (f"skillswarm/v{PROTOCOL_VERSION - 1}/demo/checkpoints/3", me)
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
    other = f"skillswarm/v{PROTOCOL_VERSION + 1}"
    for key in [f"{V}/other/peers", f"{other}/demo/peers", f"{V}/demo/deltas/0", "anything"]:
        assert not validator.validate(signed_dht_record(alice, encode_record(peer), key, me))
    # a checkpoint of version 3 under version 4's key
    assert not validator.validate(signed_dht_record(alice, encode_record(_checkpoint(alice)), f"{V}/demo/checkpoints/4", me))
    # a delta under the right key with another skill's subkey
    delta = alice.sign_record(DeltaManifest(network=NET, skill="rev", base_version=4, base_hash="a" * 64, blob="b" * 64,
                                            size=1, codec="dense_bf16", norm=1.0, num_tensors=1))
    assert validator.validate(_stored(delta))
    assert not validator.validate(signed_dht_record(alice, encode_record(delta), f"{V}/demo/deltas/4", f"{me}:arith"))


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
    # Without a network file nobody is trusted: a checkpoint manifest lives an hour at most.
    assert validator.validate(_stored(_checkpoint(alice), ttl=3000))
    assert not validator.validate(_stored(_checkpoint(alice), ttl=7200))
    # A coordinator of the network may keep its manifests a day (node/roles/coordinator.py MANIFEST_TTL), not more.
    trusting = OwnerSignatureValidator(policy=StorePolicy.from_spec(_spec(coordinators=[alice.public_key_hex])))
    assert trusting.validate(_stored(_checkpoint(alice), ttl=86400))
    assert not trusting.validate(_stored(_checkpoint(alice), ttl=2 * 86400))


def test_the_lifetimes_nodes_use_are_within_the_caps() -> None:
    from skillswarm.node.roles.coordinator import MANIFEST_TTL
    from skillswarm.node.checkpoints.pull import SHARE_TTL
    from skillswarm.node.roles.worker import DELTA_TTL, STATS_TTL

    assert DELTA_TTL <= MAX_TTL["delta"] and STATS_TTL <= MAX_TTL["skill_stats"]
    assert MANIFEST_TTL <= MAX_TTL["checkpoint"] and max(SHARE_TTL, 600.0) <= MAX_TTL["provider"]
    assert 3 * 10.0 <= MAX_TTL["peer"]  # heartbeats: 3 beats of 10 s


def _spec(**trust_and_more) -> NetworkSpec:
    fields = {"network": NET, "base_model": "m", "base_hash": "a" * 64, "skills": ["arith", "rev"], **trust_and_more}
    return NetworkSpec(**fields)


def _delta(who: Identity, skill: str = "arith", network: str = NET) -> DeltaManifest:
    return who.sign_record(DeltaManifest(network=network, skill=skill, base_version=1, base_hash="a" * 64,
                                         blob="b" * 64, size=1, codec="dense_bf16", norm=1.0, num_tensors=1))


def test_a_policy_keeps_only_what_its_network_admits() -> None:
    policy = StorePolicy.from_spec(_spec(coordinators=[alice.public_key_hex]))
    assert policy.workers is None and policy.skills == {"arith", "rev"}
    check = OwnerSignatureValidator(policy=policy).validate
    stats = bob.sign_record(SkillStats(network=NET, skill="arith", checkpoint_version=1, stats=TrainStats()))
    for good in (_delta(bob), _delta(bob, "rev"), stats, _peer(bob), _checkpoint(alice)):
        assert check(_stored(good, bob if good.author == bob.public_key_hex else alice)), type(good).__name__
    invented = bob.sign_record(SkillStats(network=NET, skill="poetry", checkpoint_version=1, stats=TrainStats()))
    for bad, signer in [(_delta(bob, "poetry"), bob), (invented, bob), (_checkpoint(bob), bob),
                        (_delta(bob, network="other"), bob)]:
        assert not check(_stored(bad, signer)), bad
    # a policy binds one network; the bare validator (a bootstrap peer with no file) takes any network's records
    assert validator.validate(_stored(_delta(bob, network="other"), bob))


def test_an_allowlist_network_stores_deltas_of_listed_workers_only() -> None:
    with pytest.raises(ValueError, match="at least one key"):
        TrustPolicy(admission="allowlist")
    spec = _spec(trust=TrustPolicy(admission="allowlist", workers=[alice.public_key_hex]))
    policy = StorePolicy.from_spec(spec)
    assert policy.workers == {alice.public_key_hex}
    check = OwnerSignatureValidator(policy=policy).validate
    assert check(_stored(_delta(alice), alice))
    assert not check(_stored(_delta(bob), bob))
    stats = bob.sign_record(SkillStats(network=NET, skill="arith", checkpoint_version=1, stats=TrainStats()))
    assert not check(_stored(stats, bob))  # nor the training progress of a key that may not train
    # heartbeats (and provider records) too: only the network's members announce themselves, so no flood from
    # outside fills its keys
    assert not check(_stored(_peer(bob), bob))
    assert check(_stored(_peer(alice), alice))
    # the open network that lists the same keys admits anyone
    open_spec = _spec(trust=TrustPolicy(admission="open", workers=[alice.public_key_hex]))
    assert OwnerSignatureValidator(policy=StorePolicy.from_spec(open_spec)).validate(_stored(_delta(bob), bob))


def test_only_own_subkeys_get_signed() -> None:
    key, bob_sub = keys.locations(_peer(bob))[0]
    rec = DHTRecord(DHTID.generate(source=key).to_bytes(), msgspec.msgpack.encode(bob_sub), b"value", time.time() + 5)
    assert OwnerSignatureValidator(alice).sign_value(rec) == b"value"
    assert OwnerSignatureValidator(None).sign_value(rec) == b"value"


def test_a_subkey_nested_deeper_than_any_parser_goes_is_dropped_not_raised() -> None:
    # 100,000 nested msgpack arrays: an untyped decode recursed until RecursionError, which escaped the validator
    deep = b"\x91" * 100_000 + b"\xc0"
    rec = DHTRecord(key=DHTID.generate(source="k").to_bytes(), subkey=deep, value=b"x" * 100,
                    expiration_time=time.time() + 60)
    assert validator.validate(rec) is False
    assert OwnerSignatureValidator(Identity.generate()).sign_value(rec) == rec.value
