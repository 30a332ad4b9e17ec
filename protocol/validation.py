"""The record validator every skillswarm DHT peer runs: only a record's author can write it, only where
its content says it belongs, and only a well-formed, signed, size-capped skillswarm record is kept.

hivemind calls `validate` when a peer asks us to store a value and when a peer returns a value we asked
for; anything that fails is dropped, so a malformed or forged value never reaches the application.
"""

from __future__ import annotations

import functools
import logging
import time

import msgspec
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord, RecordValidatorBase

from skillswarm.protocol.codec import decode_record
from skillswarm.protocol.errors import RecordError
from skillswarm.protocol.identity import Identity, peer_id_from_public_key, verify_raw, verify_record
from skillswarm.protocol.keys import locations, subkey_owner
from skillswarm.protocol.records import PeerRecord, ProviderRecord, Record, kind_of

logger = logging.getLogger(__name__)

SIGNATURE_BYTES = 64
# The DHT-level signature covers the location and the expiration time, so nobody can replay an old value
# of another peer with a later expiration (keeping a dead peer "online") or move it to another key.
_DOMAIN = b"skillswarm/dht-value/v1\x00"
# How far in the future a value may expire, per kind: short-lived announcements stay short-lived.
MAX_TTL: dict[str, float] = {
    "peer": 600.0,
    "skill_stats": 3600.0,
    "provider": 86400.0,
    "delta": 7 * 86400.0,
    "checkpoint": 30 * 86400.0,
}
CLOCK_SKEW = 60.0
_encoder = msgspec.msgpack.Encoder()


def _signed_message(record: DHTRecord, body: bytes) -> bytes:
    return _DOMAIN + _encoder.encode((record.key, record.subkey, body, float(record.expiration_time)))


@functools.lru_cache(maxsize=4096)
def _key_id(key: str) -> bytes:
    """The DHT id hivemind stores a key under (the validator sees ids, never the key strings)."""
    return DHTID.generate(source=key).to_bytes()


def _subkey_bytes(subkey: str) -> bytes:
    return msgspec.msgpack.encode(subkey)


class OwnerSignatureValidator(RecordValidatorBase):
    """Ed25519 owner signatures on DHT values plus the skillswarm record checks.

    Signing: a value stored under this node's own subkey gets 64 bytes appended, an Ed25519 signature over
    (key id, subkey, value, expiration). Validation requires, for every value: an owner subkey; a valid
    signature by that owner; a value that decodes as a skillswarm record within its size cap and schema;
    a valid record signature whose author is the owner; a location equal to where the record's content
    says it lives (network, protocol version, kind, version, skill, blob); a peer id that is the author's;
    and an expiration within the kind's maximum lifetime.
    """

    def __init__(self, identity: Identity | None = None) -> None:
        self._identity = identity

    def validate(self, record: DHTRecord) -> bool:
        """Called when a peer asks us to store `record` and when a peer returns it: False drops it."""
        try:
            self._check(record)
            return True
        except (RecordError, ValueError, TypeError, msgspec.MsgspecError) as e:
            logger.debug("dropped a DHT value: %s", e)
            return False

    def _check(self, record: DHTRecord) -> Record:
        subkey = msgspec.msgpack.decode(record.subkey) if record.subkey else None
        owner = subkey_owner(subkey)
        if owner is None:
            raise ValueError(f"subkey {subkey!r} is not an owner subkey")
        value = record.value
        if len(value) <= SIGNATURE_BYTES:
            raise ValueError("value carries no owner signature")
        body, signature = value[:-SIGNATURE_BYTES], value[-SIGNATURE_BYTES:]
        if not verify_raw(owner, signature, _signed_message(record, body)):
            raise ValueError(f"owner signature of {owner[:16]} does not verify")
        data = msgspec.msgpack.decode(body, type=bytes)
        rec = decode_record(data)
        kind = kind_of(type(rec))
        verify_record(rec, network=rec.network)
        if rec.author != owner:
            raise ValueError(f"{kind} record by {rec.author[:16]} stored under the subkey of {owner[:16]}")
        where = {(_key_id(k), _subkey_bytes(s)) for k, s in locations(rec)}
        if (bytes(record.key), bytes(record.subkey)) not in where:
            raise ValueError(f"{kind} record stored under a key its content does not name")
        if isinstance(rec, (PeerRecord, ProviderRecord)) and rec.peer_id != peer_id_from_public_key(bytes.fromhex(rec.author)):
            raise ValueError(f"{kind} record names peer {rec.peer_id}, which is not its author's peer id")
        if record.expiration_time > time.time() + MAX_TTL[kind] + CLOCK_SKEW:
            raise ValueError(f"{kind} record expires later than the {MAX_TTL[kind]:g} s a {kind} may live")
        return rec

    def sign_value(self, record: DHTRecord) -> bytes:
        """Called when this node stores a value: sign it if it sits under this node's own subkey."""
        if self._identity is None or not record.subkey:
            return record.value
        if subkey_owner(msgspec.msgpack.decode(record.subkey)) != self._identity.public_key_hex:
            return record.value  # not ours to sign: every honest peer will drop it
        return record.value + self._identity.sign(_signed_message(record, record.value))

    def strip_value(self, record: DHTRecord) -> bytes:
        """Called after a successful `validate`, before the value reaches the application."""
        return record.value[:-SIGNATURE_BYTES]

    @property
    def priority(self) -> int:
        return 10  # validate (and strip) before any validator that deserializes the value

    def merge_with(self, other: RecordValidatorBase) -> bool:
        return isinstance(other, OwnerSignatureValidator)  # one instance per node is enough
