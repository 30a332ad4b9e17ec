"""The DHT key layout: where each record kind lives, namespaced by protocol version and network name.

Every key is a string under `skillswarm/v{protocol}/{network}/`, and every value sits under an *owner
subkey* that starts with its author's Ed25519 public key (hex), so the validator every peer runs
(`skillswarm.protocol.transport.validation`) lets only that author write it:

    key                                        subkey                 value
    skillswarm/v1/{net}/peers                  {author}               PeerRecord (one per node)
    skillswarm/v1/{net}/deltas/{base_version}  {author}:{skill}       DeltaManifest (one per author and skill)
    skillswarm/v1/{net}/checkpoints/{version}  {author}               CheckpointManifest (by the coordinator)
    skillswarm/v1/{net}/checkpoints/latest     {author}               the same manifest, for its newest version
    skillswarm/v1/{net}/skills/{skill}         {author}               SkillStats (one per worker and skill)
    skillswarm/v1/{net}/providers/{sha256}     {author}               ProviderRecord (who serves that blob)
    skillswarm/v1/{net}/checkpoints/{version}  {author}:archive       ArchivedCheckpoint (an archive node's copy)
    skillswarm/v1/{net}/checkpoints/latest     {author}:archive       the same, for the newest version it holds

A record's location is a function of its content (`locations`), so a validator recomputes it and drops
a record stored anywhere else: a record of network A can never appear under network B's keys, nor a
delta for version 3 under version 4. NetworkSpecs are shared as files, never through the DHT.
"""

from __future__ import annotations

import re

from skillswarm.protocol.records import (
    ArchivedCheckpoint, CheckpointManifest, DeltaManifest, PeerRecord, ProviderRecord, Record, SkillStats,
)
from skillswarm.protocol.version import PROTOCOL_VERSION

ARCHIVE_TAG = "archive"  # the subkey tag of an archive node's copies of checkpoint manifests
_OWNER_SUBKEY = re.compile(r"^([0-9a-f]{64})(?::([a-z0-9][a-z0-9_.-]{0,63}))?$")


def namespace(network: str, protocol: int = PROTOCOL_VERSION) -> str:
    """The prefix of every key of one network under one protocol version."""
    return f"skillswarm/v{protocol}/{network}"


def peers_key(network: str, protocol: int = PROTOCOL_VERSION) -> str:
    """Where PeerRecords live (one subkey per node)."""
    return f"{namespace(network, protocol)}/peers"


def deltas_key(network: str, base_version: int, protocol: int = PROTOCOL_VERSION) -> str:
    """Where the DeltaManifests trained on checkpoint `base_version` live."""
    return f"{namespace(network, protocol)}/deltas/{base_version}"


def checkpoint_key(network: str, version: int, protocol: int = PROTOCOL_VERSION) -> str:
    """Where the CheckpointManifest(s) of one version live (one subkey per coordinator)."""
    return f"{namespace(network, protocol)}/checkpoints/{version}"


def latest_checkpoint_key(network: str, protocol: int = PROTOCOL_VERSION) -> str:
    """Where each coordinator keeps its newest CheckpointManifest, so nodes find the latest version in one get."""
    return f"{namespace(network, protocol)}/checkpoints/latest"


def skill_key(network: str, skill: str, protocol: int = PROTOCOL_VERSION) -> str:
    """Where workers' live SkillStats for one skill live."""
    return f"{namespace(network, protocol)}/skills/{skill}"


def providers_key(network: str, sha256: str, protocol: int = PROTOCOL_VERSION) -> str:
    """Where the ProviderRecords of one blob live."""
    return f"{namespace(network, protocol)}/providers/{sha256}"


def owner_subkey(author: str, tag: str = "") -> str:
    """The subkey an author writes under: its public key, plus `:tag` where one author may hold several values."""
    return f"{author}:{tag}" if tag else author


def subkey_owner(subkey: object) -> str | None:
    """The author a subkey belongs to, or None if it is not a well-formed owner subkey."""
    if not isinstance(subkey, str):
        return None
    m = _OWNER_SUBKEY.match(subkey)
    return m.group(1) if m else None


def locations(record: Record) -> list[tuple[str, str]]:
    """Every (key, subkey) this record may be stored under; the first is where `SwarmDHT.put` writes it first.

    Raises `ValueError` for a kind that never travels through the DHT (a NetworkSpec).
    """
    net, proto, author = record.network, record.protocol, record.author
    if isinstance(record, PeerRecord):
        return [(peers_key(net, proto), owner_subkey(author))]
    if isinstance(record, DeltaManifest):
        return [(deltas_key(net, record.base_version, proto), owner_subkey(author, record.skill))]
    if isinstance(record, CheckpointManifest):
        sub = owner_subkey(author)
        return [(checkpoint_key(net, record.version, proto), sub), (latest_checkpoint_key(net, proto), sub)]
    if isinstance(record, ArchivedCheckpoint):
        sub = owner_subkey(author, ARCHIVE_TAG)
        return [(checkpoint_key(net, record.version, proto), sub), (latest_checkpoint_key(net, proto), sub)]
    if isinstance(record, SkillStats):
        return [(skill_key(net, record.skill, proto), owner_subkey(author))]
    if isinstance(record, ProviderRecord):
        return [(providers_key(net, record.blob, proto), owner_subkey(author))]
    raise ValueError(f"{type(record).__name__} records are not stored in the DHT")
