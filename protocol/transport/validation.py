"""The record validator every skillswarm DHT peer runs: only a record's author can write it, only where
its content says it belongs, and only a well-formed, signed, size-capped skillswarm record is kept.
A peer that knows its network (`StorePolicy`, from the network file) also keeps only what that network
admits: its skills, its coordinators' checkpoints, and in an allowlist network only its members' records.

No author's clock is trusted: a record's `created` may lie at most `CLOCK_SKEW` ahead of the peer's clock,
and a value may live at most its kind's `MAX_TTL` past its record's `created` (a record older than that is
stale and refused). A node republishing its own record keeps within that window without thinking of it:
`OwnerSignatureValidator.sign_value` re-signs, with a fresh `created`, an own record that would not.

hivemind calls `validate` when a peer asks us to store a value and when a peer returns a value we asked
for; anything that fails is dropped, so a malformed or forged value never reaches the application.
How much each author may store is not decided here (a validator sees one value at a time): see
`storage_caps`.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import re
import time
from dataclasses import dataclass, field

import msgspec
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord, RecordValidatorBase

from skillswarm.protocol.codec import decode_record, encode_record
from skillswarm.protocol.errors import RecordError
from skillswarm.protocol.identity import Identity, peer_id_from_public_key, verify_raw, verify_record
from skillswarm.protocol.keys import locations, subkey_owner
from skillswarm.protocol.records import (
    ArchivedCheckpoint, CheckpointManifest, DeltaManifest, NetworkSpec, PeerRecord, ProviderRecord, Record, SkillStats, kind_of,
)

logger = logging.getLogger(__name__)

SIGNATURE_BYTES = 64
# The DHT-level signature covers the location and the expiration time, so nobody can replay an old value
# of another peer with a later expiration (keeping a dead peer "online") or move it to another key.
_DOMAIN = b"skillswarm/dht-value/v1\x00"
# How far in the future a value may expire, per kind: each a little above what the nodes use, so a value
# outlives its author by at most that long. Also how old a record may get: a value may expire at most this long
# after its record's `created` (so a record older than this is stale), however often it is re-stored.
MAX_TTL: dict[str, float] = {
    "peer": 600.0,  # heartbeats live 3 beats (30 s by default); 600 s allows beats up to 200 s apart
    "skill_stats": 600.0,  # workers re-put them while training, with a 300 s lifetime (node/roles/worker.py)
    "provider": 3600.0,  # re-announced every ttl/3; nodes use 120-600 s
    "delta": 86400.0,  # workers keep deltas 24 h (node/roles/worker.py DELTA_TTL)
    "checkpoint": 86400.0,  # coordinators keep manifests 24 h, re-stored every 8 h (node/roles/coordinator.py)
    "archived": 86400.0,  # archive nodes keep their copies as long, re-stored more often (node/roles/archive.py)
}
# A peer without a network file cannot tell a trusted coordinator from anyone else, so the checkpoint
# manifests it keeps live at most this long (an untrusted manifest cannot squat in the DHT for a day).
UNTRUSTED_CHECKPOINT_TTL = 3600.0
# How far apart the clocks of an author and a peer may be: a record `created` further ahead of the peer's clock is
# refused, and the lifetimes above are allowed this much slack.
CLOCK_SKEW = 60.0
# The peer id a network file's bootstrap address names (`.../p2p/<peer id>`).
_P2P_TAIL = re.compile(r"/p2p/([1-9A-HJ-NP-Za-km-z]{32,64})$")
_encoder = msgspec.msgpack.Encoder()


def _signed_message(record: DHTRecord, body: bytes) -> bytes:
    return _DOMAIN + _encoder.encode((record.key, record.subkey, body, float(record.expiration_time)))


@functools.lru_cache(maxsize=4096)
def _key_id(key: str) -> bytes:
    """The DHT id hivemind stores a key under (the validator sees ids, never the key strings)."""
    return DHTID.generate(source=key).to_bytes()


def _subkey_bytes(subkey: str) -> bytes:
    return msgspec.msgpack.encode(subkey)


@dataclass(frozen=True)
class StorePolicy:
    """What one network's peers store, from its network file.

    Every network: only records of this network; deltas and skill stats only for its skills; checkpoint
    manifests only signed by its coordinators.

    An allowlist network (`trust.admission == "allowlist"`) admits records from its members only:
    - deltas and skill stats by its allowlisted workers (`trust.workers`);
    - peer records (heartbeats) and provider records by its workers and its coordinators, and by the bootstrap
      peers its file names (the `/p2p/<peer id>` of each `bootstrap` address: `net serve --network` heartbeats
      under that key, and an archive node, `net serve --archive`, serves checkpoints under it).
    Anyone else's heartbeat or provider record is refused, so nobody outside the network can fill its keys: its
    honest members stay visible under any flood from outside. The price: a node outside the list (an observer,
    a `pull` with a throwaway key) can still read and download, but cannot announce itself or serve what it
    pulled to others. An open network admits every key's records (the storage caps bound each author and key).
    """

    network: str
    skills: frozenset[str]
    coordinators: frozenset[str]
    workers: frozenset[str] | None = None  # None: open admission, any key may publish deltas
    bootstrap_peers: frozenset[str] = field(default_factory=frozenset)  # peer ids of the file's bootstrap addresses

    @classmethod
    def from_spec(cls, spec: NetworkSpec) -> StorePolicy:
        """The policy a network file states (`trust.admission == "allowlist"`: only its members publish)."""
        workers = frozenset(spec.trust.workers) if spec.trust.admission == "allowlist" else None
        boot = frozenset(m.group(1) for m in map(_P2P_TAIL.search, spec.bootstrap) if m)
        return cls(network=spec.network, skills=frozenset(spec.skills), coordinators=frozenset(spec.coordinators),
                   workers=workers, bootstrap_peers=boot)

    def check(self, record: Record, inner: list[CheckpointManifest] | None = None) -> None:
        """Raise `ValueError` saying why this network does not store `record` (an archived copy: with its manifests,
        `inner` when the caller has already decoded and verified them)."""
        kind = kind_of(type(record))
        if record.network != self.network:
            raise ValueError(f"{kind} record of network `{record.network}`, this peer stores `{self.network}`")
        if isinstance(record, (DeltaManifest, SkillStats)):
            if record.skill not in self.skills:
                raise ValueError(f"{kind} record for skill `{record.skill}`, which network {self.network} lacks")
            if self.workers is not None and record.author not in self.workers:
                raise ValueError(f"{kind} record by {record.author[:16]}, a key the network's allowlist lacks")
        if isinstance(record, CheckpointManifest) and record.author not in self.coordinators:
            raise ValueError(f"checkpoint manifest by {record.author[:16]}, not one of the network's coordinators")
        if isinstance(record, ArchivedCheckpoint):
            for m in archived_manifests(record) if inner is None else inner:
                self.check(m)
        if isinstance(record, (PeerRecord, ProviderRecord)) and self.workers is not None \
                and record.author not in self.workers and record.author not in self.coordinators \
                and record.peer_id not in self.bootstrap_peers:
            raise ValueError(f"{kind} record by {record.author[:16]}, neither a worker the network's allowlist names "
                             "nor one of its coordinators or bootstrap peers")


def archived_manifests(record: ArchivedCheckpoint, trusted: frozenset[str] | set[str] | None = None) -> list[CheckpointManifest]:
    """The checkpoint manifests an archive's copy holds, each decoded and its own signature verified (by a `trusted`
    key, when given); RecordError (a SignatureError) if any is malformed, forged, or of another version or network."""
    out = []
    for data in record.manifests:
        m = decode_record(data, CheckpointManifest)
        verify_record(m, network=record.network, trusted=trusted)
        if m.version != record.version:
            raise RecordError(f"an archived copy of v{record.version} holds a manifest of v{m.version}")
        out.append(m)
    return out


class OwnerSignatureValidator(RecordValidatorBase):
    """Ed25519 owner signatures on DHT values plus the skillswarm record checks.

    Signing: a value stored under this node's own subkey gets 64 bytes appended, an Ed25519 signature over
    (key id, subkey, value, expiration). Validation requires, for every value: an owner subkey; a valid
    signature by that owner; a value that decodes as a skillswarm record within its size cap and schema;
    a valid record signature whose author is the owner; a location equal to where the record's content
    says it lives (network, protocol version, kind, version, skill, blob); a peer id that is the author's;
    a `created` no later than `CLOCK_SKEW` ahead of this peer's clock and no older than the kind's maximum
    lifetime; and an expiration within that lifetime, both from now and from `created`. With a `policy`,
    the record must also be one the network admits; without one, a checkpoint manifest may live at most
    `UNTRUSTED_CHECKPOINT_TTL`.
    """

    def __init__(self, identity: Identity | None = None, policy: StorePolicy | None = None) -> None:
        self._identity = identity
        self._policy = policy
        # own records re-signed with a fresh `created`: (record bytes, expiration) -> the re-signed bytes, so the two
        # locations of one checkpoint manifest, signed one after the other, get the same record
        self._refreshed: dict[tuple[bytes, float], bytes] = {}

    def validate(self, record: DHTRecord) -> bool:
        """Called when a peer asks us to store `record` and when a peer returns it: False drops it."""
        try:
            self._check(record)
            return True
        except (RecordError, ValueError, TypeError, msgspec.MsgspecError) as e:
            logger.debug("dropped a DHT value: %s", e)
            return False

    def _check(self, record: DHTRecord) -> Record:
        # typed: an owner subkey is a string, and an untyped decode of hostile bytes may nest as deep as they like
        subkey = msgspec.msgpack.decode(record.subkey, type=str) if record.subkey else None
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
        now = time.time()
        if record.expiration_time > now + MAX_TTL[kind] + CLOCK_SKEW:
            raise ValueError(f"{kind} record expires later than the {MAX_TTL[kind]:g} s a {kind} may live")
        if rec.created > now + CLOCK_SKEW:
            raise ValueError(f"{kind} record created {rec.created - now:.0f} s in the future (this peer's clock)")
        if now - rec.created > MAX_TTL[kind] + CLOCK_SKEW:
            raise ValueError(f"stale {kind} record: created {now - rec.created:.0f} s ago, over the {MAX_TTL[kind]:g} s "
                             f"a {kind} may live")
        if record.expiration_time - rec.created > MAX_TTL[kind] + CLOCK_SKEW:
            raise ValueError(f"{kind} record would live {record.expiration_time - rec.created:.0f} s past its creation, "
                             f"over the {MAX_TTL[kind]:g} s a {kind} may live")
        # an archived copy: each of its manifests well-formed, signed, and of its version (decoded once, here)
        inner = archived_manifests(rec) if isinstance(rec, ArchivedCheckpoint) else None
        if self._policy is not None:
            self._policy.check(rec, inner)
        elif isinstance(rec, (CheckpointManifest, ArchivedCheckpoint)) and record.expiration_time > now + UNTRUSTED_CHECKPOINT_TTL + CLOCK_SKEW:
            raise ValueError(f"checkpoint manifest expires later than the {UNTRUSTED_CHECKPOINT_TTL:g} s an untrusted "
                             "one may live (this peer has no network file to tell a coordinator by)")
        return rec

    def sign_value(self, record: DHTRecord) -> bytes:
        """Called when this node stores a value: sign it if it sits under this node's own subkey. A record of
        this node's own that would break the time rules (one kept and re-stored past its kind's lifetime, or
        signed long before it is stored) is first re-signed with `created` = now, so honest republishing
        always passes every peer's validator; the caller's copy of the record is left as it was."""
        if self._identity is None or not record.subkey:
            return record.value
        try:
            owner = subkey_owner(msgspec.msgpack.decode(record.subkey, type=str))
        except msgspec.MsgspecError:
            owner = None
        if owner != self._identity.public_key_hex:
            return record.value  # not ours to sign: every honest peer will drop it
        body = self._fresh(record)
        return body + self._identity.sign(_signed_message(record, body))

    def _fresh(self, record: DHTRecord) -> bytes:
        """`record.value`, or, for an own record too old (or too far ahead) for its expiration, the same record
        re-signed now (the same bytes for every location of one store)."""
        try:
            data = msgspec.msgpack.decode(record.value, type=bytes)
            rec = decode_record(data)
        except (RecordError, ValueError, TypeError, msgspec.MsgspecError):
            return record.value  # not a record (tests forging junk): sign what was given
        kind = kind_of(type(rec))
        if kind not in MAX_TTL or rec.author != self._identity.public_key_hex:
            return record.value
        now = time.time()
        if record.expiration_time - rec.created <= MAX_TTL[kind] + CLOCK_SKEW / 2 and rec.created <= now + CLOCK_SKEW / 2:
            return record.value
        at = (hashlib.sha256(record.value).digest(), float(record.expiration_time))
        if at not in self._refreshed:
            if len(self._refreshed) >= 256:
                self._refreshed.pop(next(iter(self._refreshed)))
            try:
                fresh = self._identity.sign_record(rec, created=now)
                self._refreshed[at] = msgspec.msgpack.encode(encode_record(fresh))
            except RecordError:  # cannot happen to a record that decoded (same size): store it as given
                return record.value
        return self._refreshed[at]

    def strip_value(self, record: DHTRecord) -> bytes:
        """Called after a successful `validate`, before the value reaches the application."""
        return record.value[:-SIGNATURE_BYTES]

    @property
    def priority(self) -> int:
        return 10  # validate (and strip) before any validator that deserializes the value

    def merge_with(self, other: RecordValidatorBase) -> bool:
        return isinstance(other, OwnerSignatureValidator)  # one instance per node is enough
