"""Reading checkpoint manifests from the DHT under a quorum: `SwarmDHT`'s checkpoint queries (a mixin).

A version's manifests are the coordinators' own records and the copies archive nodes keep
(`ArchivedCheckpoint`); every one is decoded, placed and signature-checked, and a version counts only once the
network's quorum of trusted coordinators signed one body (`protocol.quorum`).
"""

from __future__ import annotations

import logging
from typing import Callable, Iterable, Iterator, Sequence

from skillswarm.protocol.codec import decode_record
from skillswarm.protocol.errors import RecordError
from skillswarm.protocol.identity import verify_record
from skillswarm.protocol.keys import checkpoint_key, latest_checkpoint_key
from skillswarm.protocol.quorum import Endorsement, accepted, endorsements
from skillswarm.protocol.records import ArchivedCheckpoint, CheckpointManifest, Record, kind_of

logger = logging.getLogger(__name__)

LATEST_LOOKBACK = 8  # versions below the newest signed one a reader looks at for one its quorum accepted


class CheckpointReads:
    """The checkpoint queries of a DHT handle (`SwarmDHT`), which provides `_net` (its network) and `_placed` (the
    records under some keys that decode and sit where they belong)."""

    _net: str
    _placed: Callable[[Sequence[str], Callable[[bytes], Record]], Iterator[Record]]

    def _checkpoint_manifests(self, keys: Sequence[str], trusted: Iterable[str] | None) -> list[CheckpointManifest]:
        """Every good CheckpointManifest under `keys` by a `trusted` key (None: any), the coordinators' own and those
        held in archive nodes' copies (`ArchivedCheckpoint`), once each."""
        from skillswarm.protocol.transport.validation import archived_manifests

        trusted = None if trusted is None else set(trusted)

        def decode(data: bytes) -> Record:
            record = decode_record(data)
            if isinstance(record, CheckpointManifest):
                verify_record(record, network=self._net, trusted=trusted)
            elif isinstance(record, ArchivedCheckpoint):
                verify_record(record, network=self._net)  # its author vouches for nothing: each manifest is checked
            else:
                raise RecordError(f"a {kind_of(type(record))} record under a checkpoint key")
            return record

        out: dict[tuple[str, int, bytes], CheckpointManifest] = {}
        for record in self._placed(keys, decode):
            if isinstance(record, ArchivedCheckpoint):
                try:
                    manifests = [m for m in archived_manifests(record) if trusted is None or m.author in trusted]
                except RecordError as e:
                    logger.debug("dropped an archived copy of v%d: %s", record.version, e)
                    continue
            else:
                manifests = [record]  # type: ignore[list-item]
            for m in manifests:
                out.setdefault((m.author, m.version, m.signature), m)
        return list(out.values())

    def checkpoint_endorsements(self, version: int, *, trusted: Iterable[str] | None) -> list[Endorsement]:
        """Every body of checkpoint `version` some `trusted` coordinator signed, with its signers (`quorum`)."""
        return endorsements(self._checkpoint_manifests([checkpoint_key(self._net, version)], trusted))

    def latest_checkpoint(self, *, trusted: Iterable[str] | None, quorum: int = 1) -> CheckpointManifest | None:
        """The newest checkpoint at least `quorum` `trusted` keys (None: any valid signature) signed."""
        trusted = None if trusted is None else list(trusted)
        found = self._checkpoint_manifests([latest_checkpoint_key(self._net)], trusted)
        if not found:
            return None
        top = max(m.version for m in found)
        ok = accepted(found, quorum)
        if top in ok:
            return ok[top].manifest
        # the newest versions still gather signatures (or split): look at each version's own key, newest first
        for v in range(top, max(-1, top - LATEST_LOOKBACK), -1):
            m = self.get_checkpoint(v, trusted=trusted, quorum=quorum)
            if m is not None:
                return m
        return None

    def get_checkpoint(self, version: int, *, trusted: Iterable[str] | None, quorum: int = 1) -> CheckpointManifest | None:
        """The checkpoint of one version at least `quorum` `trusted` coordinators signed (`quorum.accepted`)."""
        found = self._checkpoint_manifests([checkpoint_key(self._net, version)], trusted)
        e = accepted(found, quorum).get(version)
        return None if e is None else e.manifest

    def get_checkpoints(self, *, trusted: Iterable[str] | None, since: int = 0,
                        quorum: int = 1) -> list[CheckpointManifest]:
        """Every accepted checkpoint (`quorum` `trusted` signatures) from version `since` up to the latest, in
        version order (a version nobody keeps alive any more is simply missing)."""
        trusted = None if trusted is None else list(trusted)
        latest = self.latest_checkpoint(trusted=trusted, quorum=quorum)
        if latest is None:
            return []
        keys = [checkpoint_key(self._net, v) for v in range(since, latest.version + 1)]
        ok = accepted(self._checkpoint_manifests(keys, trusted), quorum)
        ok.setdefault(latest.version, Endorsement(latest, (latest.author,), ""))
        return [ok[v].manifest for v in sorted(ok) if since <= v <= latest.version]
