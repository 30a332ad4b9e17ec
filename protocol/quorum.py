"""Which checkpoint of a version a node accepts: one that k of the network's n coordinators signed.

Each coordinator signs a version's manifest with its own key: the round's leader publishes it, and the others
recompute the merge from it (`coordinator run --verify`'s path) and publish the same manifest signed by
themselves. Two signatures are on the same checkpoint when the manifests are equal but for who signed them and
when (`body_digest`). A version is accepted once `quorum` distinct trusted coordinators signed one body; no honest
coordinator signs two bodies of one version, so with `quorum` > n/2 two checkpoints of one version can never both
be accepted (the majority rule of Raft and PBFT). With a smaller quorum, every reader that sees the same signatures
picks the same body (the most signed, then the lowest digest).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Iterable

import msgspec

from skillswarm.protocol.codec import canonical_bytes
from skillswarm.protocol.records import CheckpointManifest


def body_digest(manifest: CheckpointManifest) -> str:
    """The sha256 of what a manifest says, without who signed it and when: equal for every co-signer's copy."""
    bare = msgspec.structs.replace(manifest, author="", created=0.0, signature=b"")
    return hashlib.sha256(canonical_bytes(bare)).hexdigest()


@dataclass(frozen=True)
class Endorsement:
    """One body of one version and the coordinators that signed it (`manifest`: one of their copies, the earliest;
    `copies`: each signer's, in signer order)."""

    manifest: CheckpointManifest
    signers: tuple[str, ...]
    digest: str
    copies: tuple[CheckpointManifest, ...] = ()

    @property
    def version(self) -> int:
        """The checkpoint version signed."""
        return self.manifest.version


def endorsements(manifests: Iterable[CheckpointManifest]) -> list[Endorsement]:
    """Signed manifests grouped by (version, body), by version, then most signers first, then by digest."""
    groups: dict[tuple[int, str], dict[str, CheckpointManifest]] = {}
    for m in manifests:
        by_author = groups.setdefault((m.version, body_digest(m)), {})
        if m.author not in by_author or m.created < by_author[m.author].created:
            by_author[m.author] = m
    out = [Endorsement(min(by.values(), key=lambda m: (m.created, m.author)), tuple(sorted(by)), digest,
                       tuple(by[a] for a in sorted(by)))
           for (version, digest), by in groups.items()]
    return sorted(out, key=lambda e: (e.version, -len(e.signers), e.digest))


def accepted(manifests: Iterable[CheckpointManifest], quorum: int) -> dict[int, Endorsement]:
    """Per version, the body at least `quorum` distinct coordinators signed (the caller passes only trusted
    coordinators' manifests); a version no body reaches the quorum for is absent."""
    out: dict[int, Endorsement] = {}
    for e in endorsements(manifests):
        if len(e.signers) >= quorum and e.version not in out:
            out[e.version] = e
    return out
