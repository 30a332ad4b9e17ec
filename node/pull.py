"""Pulling checkpoints: find the latest (or a given) version signed by a trusted coordinator, and make
it complete in the local store, verifying every hash. A node that holds the parent version fetches only
the merged delta and applies it; everything else is fetched file by file by content hash."""

from __future__ import annotations

import logging
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING

from skillswarm.node.store import CheckpointStore, checkpoint_files, verify_dir
from skillswarm.protocol.transport.blobs import BlobStore
from skillswarm.protocol.errors import BlobError, HashMismatchError, NetworkError, SkillswarmError
from skillswarm.protocol.records import CheckpointManifest, NetworkSpec

if TYPE_CHECKING:
    from skillswarm.protocol.transport.dht import SwarmDHT

log = logging.getLogger(__name__)


def find_checkpoint(dht: "SwarmDHT", spec: NetworkSpec, version: int | None = None) -> CheckpointManifest | None:
    """The manifest of `version` (default: the latest), signed by one of the spec's coordinators and
    consistent with the spec's base model; untrusted or inconsistent manifests are ignored."""
    trusted = spec.coordinators
    found = dht.latest_checkpoint(trusted=trusted) if version is None else dht.get_checkpoint(version, trusted=trusted)
    if found is not None and found.version == 0 and found.weights_hash != spec.base_hash:
        log.warning("ignoring a genesis checkpoint whose weights are not the network's base model")
        return None
    return found


def wait_for_checkpoint(dht: "SwarmDHT", spec: NetworkSpec, *, newer_than: int = -1, timeout: float | None = None,
                        poll: float = 2.0, stop: "object | None" = None) -> CheckpointManifest | None:
    """Poll until a trusted checkpoint newer than `newer_than` appears (None on timeout or when `stop` is set)."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        found = find_checkpoint(dht, spec)
        if found is not None and found.version > newer_than:
            return found
        if stop is not None and stop.is_set():  # type: ignore[attr-defined]
            return None
        if deadline is not None and time.monotonic() >= deadline:
            return None
        time.sleep(poll)


def local_base(spec: NetworkSpec) -> Path | None:
    """The base model as a local directory, when `spec.base_model` is one (hash checked later)."""
    path = Path(spec.base_model).expanduser()
    return path if path.is_dir() else None


def pull(dht: "SwarmDHT", spec: NetworkSpec, manifest: CheckpointManifest, store: CheckpointStore,
         blobs: BlobStore, *, progress: bool = True) -> Path:
    """Make `manifest`'s version complete in `store` (verified) and return its directory."""
    if store.has(manifest.version):
        if store.manifest(manifest.version).weights_hash == manifest.weights_hash:
            return store.path(manifest.version)
        log.warning("local v%d differs from the network's; fetching it again", manifest.version)
    if manifest.version == 0 and (base := local_base(spec)) is not None:
        try:
            return _from_local_base(manifest, base, store, blobs)
        except (HashMismatchError, FileNotFoundError) as e:
            log.info("local base model does not match the genesis checkpoint (%s); fetching it", e)
    parent = manifest.parent_version
    if manifest.merged_delta is not None and parent is not None and store.has(parent):
        try:
            return _from_parent(dht, manifest, store, blobs, progress)
        except (SkillswarmError, OSError) as e:
            log.warning("could not rebuild v%d from v%d and its merged delta (%s); fetching all files",
                        manifest.version, parent, e)
    return _fetch_all(dht, manifest, store, blobs, progress)


def _from_local_base(manifest: CheckpointManifest, base: Path, store: CheckpointStore, blobs: BlobStore) -> Path:
    wanted = {f.path: (f.sha256, f.size) for f in manifest.files}
    have = {f.path: (f.sha256, f.size) for f in checkpoint_files(base) if f.path in wanted}
    if have != wanted:
        raise HashMismatchError("file list or hashes differ")
    for f in manifest.files:
        if not blobs.has(f.sha256):
            blobs.add_file(base / f.path)  # a copy: the user may edit their base dir
    return store.assemble(manifest, blobs)


def _from_parent(dht: "SwarmDHT", manifest: CheckpointManifest, store: CheckpointStore, blobs: BlobStore,
                 progress: bool) -> Path:
    from skillswarm.merge import apply_delta

    delta = manifest.merged_delta
    assert delta is not None and manifest.parent_version is not None
    path = dht.fetch(delta.sha256, size=delta.size, max_size=delta.size, store=blobs, progress=progress, tree=delta.tree)
    built = store.staging()
    try:
        apply_delta(store.path(manifest.parent_version), path, built / "ckpt", expected_base_hash=manifest.parent_hash,
                    progress=progress)
        out = built / "ckpt"
        verify_dir(out, manifest)
        final = store.commit(manifest, out, verify=False)
    finally:
        shutil.rmtree(built, ignore_errors=True)
    log.info("v%d rebuilt from v%d + merged delta (%d bytes fetched)", manifest.version, manifest.parent_version, delta.size)
    return final


def _fetch_all(dht: "SwarmDHT", manifest: CheckpointManifest, store: CheckpointStore, blobs: BlobStore,
               progress: bool) -> Path:
    for f in manifest.files:
        if blobs.has(f.sha256):
            continue
        try:
            dht.fetch(f.sha256, size=f.size, max_size=f.size, store=blobs, progress=progress, tree=f.tree)
        except (BlobError, NetworkError) as e:
            raise BlobError(f"cannot fetch {f.path} of checkpoint v{manifest.version}: {e}") from None
    return store.assemble(manifest, blobs)


def export(store: CheckpointStore, version: int, out: Path) -> Path:
    """Copy a local version to `out` as a plain HF directory with its signed manifest beside it
    (`manifest.msgpack`, verifiable) and a readable copy (`manifest.json`)."""
    import json

    import msgspec

    from skillswarm.protocol.atomic import atomic_write_text

    src = store.path(version)
    out = Path(out)
    tmp = out.with_name(f".{out.name}.pulling")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(src, tmp)
    readable = msgspec.to_builtins(store.manifest(version)) | {"signature": store.manifest(version).signature.hex()}
    atomic_write_text(tmp / "manifest.json", json.dumps(readable, indent=2, sort_keys=True) + "\n")
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    return out


SHARE_TTL = 120.0  # short: a node that leaves stops being offered to fetchers soon


def share(dht: "SwarmDHT", store: CheckpointStore, blobs: BlobStore, manifest: CheckpointManifest) -> None:
    """Serve the files of a local version (and its merged delta when held), so pulls spread over every
    node that has it instead of all hitting the coordinator."""
    ckpt = store.path(manifest.version)
    for f in manifest.files:
        if not blobs.has(f.sha256):
            blobs.add_file(ckpt / f.path, link=True)
        dht.provide(f.sha256, store=blobs, ttl=SHARE_TTL)
    if manifest.merged_delta is not None and blobs.has(manifest.merged_delta.sha256):
        dht.provide(manifest.merged_delta.sha256, store=blobs, ttl=SHARE_TTL)
