"""Identities and signatures: key files, peer ids, and every way a signed record can be wrong."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import msgspec
import pytest

from skillswarm.protocol.codec import decode_record, encode_record
from skillswarm.protocol.errors import IdentityError, SignatureError
from skillswarm.protocol.identity import Identity, peer_id_from_public_key, verify_raw, verify_record
from skillswarm.protocol.paths import default_key_path
from skillswarm.protocol.records import PeerRecord, TrainStats, SkillStats


def _peer(ident: Identity, network: str = "alpha") -> PeerRecord:
    return PeerRecord(network=network, peer_id=ident.peer_id, role="worker", skills=["arith"], engine="hf")


def test_key_file_created_on_first_use_with_0600(isolated_home: Path) -> None:
    ident = Identity.load_or_create()
    path = default_key_path()
    assert path.is_relative_to(isolated_home)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    again = Identity.load_or_create()
    assert again.public_key_hex == ident.public_key_hex  # same key on the next start
    assert not [p for p in path.parent.iterdir() if p.name.startswith(".key-")]  # no temp file left


def test_key_path_overridable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    explicit = Identity.load_or_create(tmp_path / "sub" / "node.key")
    assert (tmp_path / "sub" / "node.key").exists() and explicit.path == tmp_path / "sub" / "node.key"
    monkeypatch.setenv("SKILLSWARM_KEY", str(tmp_path / "env.key"))
    assert Identity.load_or_create().path == tmp_path / "env.key"


def test_bad_key_files_give_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(IdentityError, match="does not exist"):
        Identity.load(tmp_path / "missing.key")
    junk = tmp_path / "junk.key"
    junk.write_bytes(b"not a key")
    os.chmod(junk, 0o600)
    with pytest.raises(IdentityError, match="no readable private key"):
        Identity.load(junk)
    Identity.load_or_create(tmp_path / "open.key")
    os.chmod(tmp_path / "open.key", 0o644)
    with pytest.raises(IdentityError, match="chmod 600"):
        Identity.load(tmp_path / "open.key")


def test_peer_id_is_the_libp2p_id_of_the_key() -> None:
    # Cross-check against independent implementations (the base58 and multihash packages hivemind uses):
    # libp2p inlines small keys as an identity multihash of PublicKey{Type: Ed25519, Data: key}.
    import base58
    import multihash

    ident = Identity.generate()
    proto = b"\x08\x01\x12\x20" + ident.public_key
    assert ident.peer_id == base58.b58encode(multihash.encode(proto, "id")).decode()
    assert peer_id_from_public_key(bytes(32)) == base58.b58encode(multihash.encode(b"\x08\x01\x12\x20" + bytes(32), "id")).decode()
    assert ident.peer_id.startswith("12D3KooW") and ident.peer_id != Identity.generate().peer_id


def test_signed_record_verifies_and_survives_the_wire() -> None:
    ident = Identity.generate()
    rec = ident.sign_record(_peer(ident))
    assert rec.author == ident.public_key_hex and len(rec.signature) == 64 and rec.created > 0
    verify_record(decode_record(encode_record(rec)), network="alpha", trusted=[ident.public_key_hex])


@pytest.mark.parametrize("change", [
    {"skills": ["sort"]}, {"role": "coordinator"}, {"created": 1.0}, {"engine": "vllm"}, {"protocol": 1, "peer_id": "12D3KooW9pNUkUnEtMSrbCzC8QNfQCEAF9m7Dbc1UKMtQWWG7DkJ"},
])
def test_a_changed_field_breaks_the_signature(change: dict) -> None:
    ident = Identity.generate()
    rec = ident.sign_record(_peer(ident))
    with pytest.raises(SignatureError, match="bad signature"):
        verify_record(msgspec.structs.replace(rec, **change), network="alpha")


def test_a_wrong_key_is_rejected() -> None:
    alice, mallory = Identity.generate(), Identity.generate()
    rec = mallory.sign_record(_peer(mallory))
    forged = msgspec.structs.replace(rec, author=alice.public_key_hex)  # claims alice wrote it
    with pytest.raises(SignatureError, match="bad signature"):
        verify_record(forged, network="alpha")
    with pytest.raises(SignatureError, match="does not trust"):  # valid signature, untrusted author
        verify_record(rec, network="alpha", trusted=[alice.public_key_hex])


def test_a_record_signed_for_another_network_is_rejected() -> None:
    ident = Identity.generate()
    rec = ident.sign_record(_peer(ident, network="alpha"))
    with pytest.raises(SignatureError, match="network `alpha`, not `beta`"):
        verify_record(rec, network="beta")
    moved = msgspec.structs.replace(rec, network="beta")  # relabelled to replay it elsewhere
    with pytest.raises(SignatureError, match="bad signature"):
        verify_record(moved, network="beta")


def test_signature_binds_the_record_kind_and_unsigned_is_rejected() -> None:
    ident = Identity.generate()
    stats = SkillStats(network="alpha", skill="arith", checkpoint_version=0, stats=TrainStats())
    with pytest.raises(SignatureError, match="not signed"):
        verify_record(stats, network="alpha")
    signed = ident.sign_record(stats)
    verify_record(signed, network="alpha")
    assert not verify_raw(ident.public_key_hex, signed.signature, b"anything else")
    assert verify_raw(ident.public_key_hex, ident.sign(b"blob"), b"blob")


def test_signing_refuses_an_invalid_record_unless_told_not_to_validate() -> None:
    from skillswarm.protocol.errors import RecordError
    from skillswarm.protocol.records import PeerRecord
    key = Identity.generate()
    bad = PeerRecord(network="n", peer_id=key.peer_id, role="king")  # type: ignore[arg-type]
    with pytest.raises(RecordError, match="role"):
        key.sign_record(bad)
    assert key.sign_record(bad, validate=False).role == "king"  # forged on purpose; every reader drops it
