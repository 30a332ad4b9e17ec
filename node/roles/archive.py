"""The archive role (`net serve --archive DIR`): a long-lived peer that keeps a network's history alive.

It pins every checkpoint the network accepted (the manifests its coordinators signed, its files and its merged
delta) to disk, within a quota, and serves them; and it keeps their signed manifests findable in the DHT by
storing its own `ArchivedCheckpoint` records, which carry the coordinators' manifests unchanged (the DHT forgets
a record when its author stops re-storing it, and only a manifest's author can re-store the manifest itself).
Readers check every manifest's own signature and the network's quorum, so an archive vouches for nothing.

It re-stores those records at start (after its own restart), every `refresh_s`, and as soon as a peer it had not
seen connects (a restarted bootstrap comes back empty). Like a BitTorrent seed or an IPFS pinning node, one
running archive is enough for every version it holds to stay pullable after every other peer is gone.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from pathlib import Path

import msgspec

from skillswarm.node.checkpoints.pull import pull, share
from skillswarm.node.checkpoints.store import CheckpointStore
from skillswarm.protocol.atomic import atomic_write_bytes
from skillswarm.protocol.codec import decode_record, encode_record
from skillswarm.protocol.errors import RecordError, SkillswarmError
from skillswarm.protocol.identity import Identity
from skillswarm.protocol.quorum import Endorsement, accepted
from skillswarm.protocol.records import MAX_BYTES, ArchivedCheckpoint, CheckpointManifest, NetworkSpec
from skillswarm.protocol.transport.blobs import BlobStore
from skillswarm.protocol.transport.validation import MAX_TTL, archived_manifests

log = logging.getLogger(__name__)

ARCHIVE_TTL = MAX_TTL["archived"]
DEFAULT_REFRESH_S = 600.0  # well inside the shortest lifetime it re-stores (provider records: SHARE_TTL)


class Archive:
    """One archive node of one network, its checkpoints and records under `root` (`checkpoints/`, `blobs/`,
    `records/`). `quota_bytes`: the most its blobs may take; the oldest versions' files go first, never the newest."""

    def __init__(self, spec: NetworkSpec, identity: Identity, dht, root: Path, *, quota_bytes: int | None = None,
                 refresh_s: float = DEFAULT_REFRESH_S, poll: float = 10.0, progress: bool = False) -> None:
        self.spec, self.identity, self.dht = spec, identity, dht
        self.root = Path(root)
        self.store = CheckpointStore(spec.network, self.root)
        self.blobs = BlobStore(self.root / "blobs")
        self.records_dir = self.root / "records"
        self.records_dir.mkdir(parents=True, exist_ok=True)
        self.quota_bytes, self.refresh_s, self.poll, self.progress = quota_bytes, refresh_s, poll, progress
        self.state, self.note = "starting", ""
        self._peers: set[str] = set()
        self._last_refresh = 0.0
        self._gone: set[int] = set()  # versions no peer had when last looked for

    # ---- what is pinned ----------------------------------------------------------------------------
    def versions(self) -> list[int]:
        """The versions whose signed manifests this archive holds (files or not), ascending."""
        out = [int(p.stem[1:]) for p in self.records_dir.glob("v*.msgpack") if p.stem[1:].isdigit()]
        return sorted(out)

    def record(self, version: int) -> ArchivedCheckpoint | None:
        """The archived copy of `version` held on disk (None when absent or unreadable: it is fetched again)."""
        try:
            rec = decode_record((self.records_dir / f"v{version}.msgpack").read_bytes(), ArchivedCheckpoint)
            archived_manifests(rec, set(self.spec.coordinators))
            return rec
        except (OSError, RecordError) as e:
            log.warning("archived record of v%d is unreadable (%s); it will be fetched again", version, e)
            return None

    def _own(self, rec: ArchivedCheckpoint) -> ArchivedCheckpoint:
        """`rec` signed by this node (a directory archived under another key is carried on under this one)."""
        if rec.author == self.identity.public_key_hex:
            return rec
        mine = self.identity.sign_record(msgspec.structs.replace(rec, author="", created=0.0, signature=b""))
        atomic_write_bytes(self.records_dir / f"v{rec.version}.msgpack", encode_record(mine))
        return mine

    def held_bytes(self) -> int:
        """Bytes of blobs pinned here."""
        return self.blobs.usage()

    # ---- the loop ----------------------------------------------------------------------------------
    def run(self, stop: threading.Event) -> None:
        """Re-store what is on disk, then pin each new accepted version and keep the records alive, until `stop`."""
        restored, rejoins = False, self.dht.rejoins
        while not stop.is_set():
            try:
                if not restored:
                    self.restore()
                    restored = True
                self.collect()
                peers = set(self.dht.connected_peers())
                if peers - self._peers or self.dht.rejoins != rejoins \
                        or time.monotonic() - self._last_refresh >= self.refresh_s:
                    rejoins = self.dht.rejoins
                    self.refresh()
                self._peers = peers
                self.state = "idle"
            except SkillswarmError as e:
                self.state, self.note = "waiting", f"archiving failed: {e}"[:200]
                log.warning("%s", self.note)
            except Exception as e:  # noqa: BLE001 - a bug or a hostile input must not end the archive: retried
                self.state, self.note = "waiting", f"archiving failed: {type(e).__name__}: {e}"[:200]
                log.exception("archiving failed")
            stop.wait(self.poll)

    def restore(self) -> None:
        """At start: serve every version held on disk and store every archived record again."""
        for v in self.store.versions():
            try:
                share(self.dht, self.store, self.blobs, self.store.manifest(v))
            except SkillswarmError as e:  # a damaged version is deleted by the check: fetched again by `collect`
                log.warning("v%d is not served: %s", v, e)
        self.refresh()

    def refresh(self) -> None:
        """Store every archived record again, oldest first, so the newest is the one left under the latest key."""
        for v in self.versions():
            if (rec := self.record(v)) is not None:
                self.dht.put(self._own(rec), ARCHIVE_TTL)
        self._last_refresh = time.monotonic()
        self._gone.clear()

    def collect(self) -> list[int]:
        """Pin every accepted version not yet pinned (and refetch files of a pinned one found damaged); returns the
        versions pinned now."""
        latest = self.dht.latest_checkpoint(trusted=self.spec.coordinators, quorum=self.spec.quorum_k())
        if latest is None:
            self.note = "no checkpoint on the network yet"
            return []
        held, kept = set(self.versions()), self.store.versions()
        oldest_kept = kept[0] if kept else 0  # older versions' files were dropped for the quota, and stay so
        done, failed = [], []
        for v in range(0, latest.version + 1):
            if v in self._gone or (v in held and (self.store.has(v) or v < oldest_kept)):
                continue
            found = accepted(self._endorsed(v), self.spec.quorum_k()).get(v)
            if found is None:
                self._gone.add(v)  # expired everywhere: looked for again at the next refresh
                continue
            try:
                self.pin(found)
                done.append(v)
            except SkillswarmError as e:  # a version whose files no peer serves now: tried again next poll
                failed.append(f"v{v}: {e}")
        if done:
            self.evict()
        self.note = f"holding v{min(held | set(done))}-v{max(held | set(done))}" if held | set(done) else ""
        if failed:
            raise SkillswarmError(f"could not archive {len(failed)} version(s); {failed[0]}")
        return done

    def _endorsed(self, version: int) -> list[CheckpointManifest]:
        found = self.dht.checkpoint_endorsements(version, trusted=self.spec.coordinators)
        return [m for e in found for m in e.copies]

    def pin(self, found: Endorsement) -> None:
        """Fetch one accepted version (files and merged delta), serve it, and store its signatures on disk and in
        the DHT."""
        manifest = found.manifest
        self.state = "pulling"
        pull(self.dht, self.spec, manifest, self.store, self.blobs, progress=self.progress)
        md = manifest.merged_delta
        if md is not None and not self.blobs.has(md.sha256, md.size):
            self.dht.fetch(md.sha256, size=md.size, max_size=md.size, store=self.blobs, progress=self.progress,
                           tree=md.tree)
        share(self.dht, self.store, self.blobs, manifest)
        rec = self.identity.sign_record(ArchivedCheckpoint(network=self.spec.network, version=manifest.version,
                                                           manifests=self._fitting(found)))
        atomic_write_bytes(self.records_dir / f"v{manifest.version}.msgpack", encode_record(rec))
        self.dht.put(rec, ARCHIVE_TTL)
        log.info("archived v%d (%d signature(s))", manifest.version, len(rec.manifests))

    def _fitting(self, found: Endorsement) -> list[bytes]:
        """The signers' manifests, as many as fit one record (the quorum's first)."""
        out: list[bytes] = []
        room = MAX_BYTES["archived"] - 1024
        for m in found.copies or (found.manifest,):
            data = encode_record(m)
            if len(data) > room or len(out) >= 32:
                break
            out.append(data)
            room -= len(data) + 8
        return out

    def evict(self) -> None:
        """Within the quota: drop the files of the oldest versions (never the newest), blobs shared with a kept
        version excepted. Their signed records stay (they are small): history stays verifiable."""
        if self.quota_bytes is None:
            return
        versions = self.store.versions()
        blobs_of = {v: {f.sha256 for f in m.files} | ({m.merged_delta.sha256} if m.merged_delta else set())
                    for v in versions for m in [self.store.manifest(v)]}
        refs = Counter(sha for v in versions for sha in blobs_of[v])  # how many kept versions use each blob
        held = self.held_bytes()
        while len(versions) > 1 and held > self.quota_bytes:
            old = versions.pop(0)
            self.store.remove(old)
            for sha in blobs_of[old]:
                refs[sha] -= 1
                if refs[sha] == 0 and self.blobs.path(sha).is_file():
                    held -= self.blobs.size(sha)
                    self.dht.unprovide(sha)
                    self.blobs.remove(sha)
            log.info("quota: dropped the files of v%d (%d bytes held now)", old, held)
        if held > self.quota_bytes:
            self.note = f"the newest version alone takes {held} bytes, over the quota of {self.quota_bytes}"
            log.warning("%s", self.note)
