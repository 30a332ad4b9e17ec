"""Pulling checkpoints: find the latest (or a given) version signed by a trusted coordinator, and make
it complete in the local store, verifying every hash. A node that holds the parent version fetches only
the merged delta and applies it; everything else is fetched file by file by content hash. Nothing on disk is
taken as good unchecked: local versions and cached blobs are checked first (a damaged one is deleted and
fetched again), and an export is checked against the manifest before it takes its place."""

from __future__ import annotations

import errno
import glob
import hashlib
import logging
import os
import shutil
import stat
import tempfile
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from skillswarm.node.checkpoints.store import CheckpointStore, checkpoint_files, verify_dir
from skillswarm.protocol.transport.blobs import BlobStore
from skillswarm.protocol.errors import BlobError, HashMismatchError, NetworkError, SkillswarmError
from skillswarm.protocol.records import CheckpointManifest, NetworkSpec

if TYPE_CHECKING:
    from skillswarm.protocol.transport.dht import SwarmDHT

log = logging.getLogger(__name__)


def find_checkpoint(dht: "SwarmDHT", spec: NetworkSpec, version: int | None = None) -> CheckpointManifest | None:
    """The manifest of `version` (default: the latest) signed by as many of the spec's coordinators as its quorum
    asks, and consistent with the spec's base model; untrusted or inconsistent manifests are ignored."""
    trusted, k = spec.coordinators, spec.quorum_k()
    found = (dht.latest_checkpoint(trusted=trusted, quorum=k) if version is None
             else dht.get_checkpoint(version, trusted=trusted, quorum=k))
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
        if store.manifest(manifest.version).weights_hash != manifest.weights_hash:
            log.warning("local v%d differs from the network's; fetching it again", manifest.version)
        elif store.check(manifest.version):  # a damaged one is deleted: fetched again below
            return store.path(manifest.version)
    if manifest.version == 0 and (base := local_base(spec)) is not None:
        try:
            return _from_local_base(manifest, base, store, blobs)
        except (HashMismatchError, FileNotFoundError) as e:
            log.info("local base model does not match the genesis checkpoint (%s); fetching it", e)
    parent = manifest.parent_version
    if manifest.merged_delta is not None and parent is not None and store.check(parent):
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
        if not blobs.has(f.sha256, f.size):
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
        if blobs.has(f.sha256, f.size):  # checked: a bad cached copy is deleted and fetched again
            continue
        try:
            dht.fetch(f.sha256, size=f.size, max_size=f.size, store=blobs, progress=progress, tree=f.tree)
        except (BlobError, NetworkError) as e:
            raise BlobError(f"cannot fetch {f.path} of checkpoint v{manifest.version}: {e}") from None
    return store.assemble(manifest, blobs)


def export(store: CheckpointStore, version: int, out: Path) -> Path:
    """Copy a local version to `out` as a plain HF directory with its signed manifest beside it
    (`manifest.msgpack`, verifiable) and a readable copy (`manifest.json`). `out` may be new, empty, or an
    earlier pull, which is replaced whole (`write_out`); anything else is refused. Each file's copy is hashed as it
    is written and must match the manifest before the directory takes `out`'s place."""
    import json

    import msgspec

    from skillswarm.protocol.atomic import atomic_write_text

    def build(new: Path) -> None:
        if not store.check(version):
            raise HashMismatchError(f"local checkpoint v{version} is missing or damaged (a damaged one is deleted); "
                                    "pull it again")
        manifest = store.manifest(version)
        written: dict[str, tuple[int, str]] = {}

        def copy(src: str, dst: str) -> str:
            written[os.path.relpath(dst, new)] = _copy_hashing(Path(src), Path(dst))
            return dst

        shutil.copytree(store.path(version), new, copy_function=copy)
        for f in manifest.files:
            size, sha = written.get(f.path, (-1, ""))
            if (size, sha) != (f.size, f.sha256):
                store.remove(version)
                got = "missing" if size < 0 else f"{size:,} bytes hashing to {sha[:12]}"
                raise HashMismatchError(f"{f.path} of local checkpoint v{version} does not match its manifest ({got}, "
                                        f"not {f.size:,} bytes hashing to {f.sha256[:12]}); it is deleted: pull it again")
        readable = msgspec.to_builtins(manifest) | {"signature": manifest.signature.hex()}
        atomic_write_text(new / "manifest.json", json.dumps(readable, indent=2, sort_keys=True) + "\n")

    return write_out(out, build, version=version)


def _copy_hashing(src: Path, dst: Path) -> tuple[int, str]:
    """Copy a file (with its times and mode, as `shutil.copy2`) and return the size and sha256 of the bytes written."""
    h, size = hashlib.sha256(), 0
    with open(src, "rb") as fin, open(dst, "xb") as fout:
        while block := fin.read(1 << 20):
            h.update(block)
            fout.write(block)
            size += len(block)
    shutil.copystat(src, dst)
    return size, h.hexdigest()


# ------------------------------------------------------------------------------------- pull --out DIR
# `pull --out` never deletes what it did not write. Each pull leaves PULL_MARKER in its directory, listing
# every file it wrote (size and mtime); a later pull replaces that directory only while it holds exactly
# those files, unchanged. Anything else that is not empty is refused. The new copy is built in a hidden
# sibling (`.NAME.pull-*`) and renamed into place (swapped atomically with the earlier pull where the
# filesystem can), so an interrupted pull leaves the earlier one whole.

PULL_MARKER = ".skillswarm-pull.json"
_STAGING_MARK = ".skillswarm-pull-staging"  # in a staging sibling: the pid of the pull that made it
_SHOWN = 3  # entries named in an error


def _listing(root: Path) -> dict[str, list[int]]:
    """Everything under `root` but the marker: relative path -> [size, mtime_ns] for a file or symlink,
    [-1, 0] for a directory."""
    found: dict[str, list[int]] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in [*filenames, *dirnames]:
            path = os.path.join(dirpath, name)
            rel = os.path.relpath(path, root)
            st = os.lstat(path)
            if rel != PULL_MARKER:
                found[rel] = [-1, 0] if stat.S_ISDIR(st.st_mode) else [st.st_size, st.st_mtime_ns]
    return found


def _some(names: list[str]) -> str:
    shown = ", ".join(sorted(names)[:_SHOWN])
    return shown + (f" and {len(names) - _SHOWN} more" if len(names) > _SHOWN else "")


def check_out(out: Path) -> dict[str, list[int]] | None:
    """Whether `pull --out` may write `out`: None when it is new or empty; the files of the earlier pull it
    holds (to replace) when it is one, untouched. Else a SkillswarmError that says why and what to do."""
    import json

    out = Path(out)
    fix = "pick an empty or new directory for --out"
    if not out.exists():
        if out.is_symlink():
            raise SkillswarmError(f"--out {out} is a symlink to nothing; {fix}")
        return None
    if not out.is_dir():
        raise SkillswarmError(f"--out {out} is a file, not a directory; {fix}")
    try:
        entries = os.listdir(out)
    except OSError as e:
        raise SkillswarmError(f"cannot read --out {out}: {e.strerror}; {fix}") from None
    if not entries:
        return None
    try:
        marker = json.loads((out / PULL_MARKER).read_text())
        written = {str(k): [int(v[0]), int(v[1])] for k, v in marker["files"].items()}
    except (OSError, ValueError, TypeError, KeyError, IndexError, AttributeError):
        raise SkillswarmError(f"--out {out} is not empty ({_some(entries)}) and is not an earlier `skillswarm pull`; "
                              f"pull never deletes what it did not write: {fix}") from None
    try:
        have = _listing(out)
    except OSError as e:
        raise SkillswarmError(f"cannot read --out {out}: {e.strerror}; {fix}") from None
    extra = [name for name in have if name not in written]
    if extra:
        raise SkillswarmError(f"--out {out} is an earlier pull but also holds files it did not write "
                              f"({_some(extra)}): move them out, or {fix}")
    changed = [name for name, seen in written.items() if have.get(name) != seen]
    if changed:
        raise SkillswarmError(f"--out {out} is an earlier pull whose files were changed or removed since "
                              f"({_some(changed)}): move what you want to keep out, or {fix}")
    return written


def _exchange(a: Path, b: Path) -> bool:
    """Swap two directories in one step (Linux renameat2 RENAME_EXCHANGE); False where this system or
    filesystem cannot."""
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    renameat2.argtypes = (ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint)
    at_fdcwd, rename_exchange = -100, 2
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(b))


def _remove_pull(root: Path, written: dict[str, list[int]]) -> bool:
    """Delete an earlier pull: the files and directories it listed, its marker, and `root` once empty.
    What it did not list stays; whether nothing did."""
    files = [n for n, (size, _) in written.items() if size >= 0] + [PULL_MARKER]
    dirs = sorted((n for n, (size, _) in written.items() if size < 0), key=len, reverse=True) + ["."]
    for name in files:
        try:
            (root / name).unlink()
        except OSError:
            pass
    for name in dirs:
        try:
            (root / name).rmdir()
        except OSError:
            pass
    return not root.exists()


def _clean_staging(out: Path) -> None:
    """Remove the staging siblings of pulls into `out` that died before they finished (their mark names
    a process that is gone)."""
    for stage in out.parent.glob(f".{glob.escape(out.name)}.pull-*"):
        try:
            pid = int((stage / _STAGING_MARK).read_text())
        except (OSError, ValueError):
            continue  # not ours
        if pid != os.getpid() and not Path(f"/proc/{pid}").exists():
            shutil.rmtree(stage, ignore_errors=True)


def write_out(out: Path, build: "Callable[[Path], object]", *, version: int | None = None) -> Path:
    """Write a pull into `out`: `build(path)` makes the new directory at `path` (which does not exist yet),
    in a hidden sibling of `out`; then it takes `out`'s place, and an earlier pull there is removed. `out`
    must be new, empty or an earlier pull (`check_out`); nothing else in it is ever deleted."""
    import json

    from skillswarm.protocol.atomic import atomic_write_text

    out = Path(os.path.abspath(out))
    if out.is_symlink() and out.exists():
        out = out.resolve()  # a link to the directory to use: write there, keep the link
    check_out(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    _clean_staging(out)
    stage = Path(tempfile.mkdtemp(prefix=f".{out.name}.pull-", dir=out.parent))
    (stage / _STAGING_MARK).write_text(str(os.getpid()))
    new = stage / "new"
    earlier_at = None  # where the earlier pull is once it has left `out`
    try:
        build(new)
        like = out if out.is_dir() else stage / "mode"  # an empty or earlier directory keeps its mode; a new
        like.mkdir(exist_ok=True)  # one gets the mode any new directory gets here (the umask's)
        os.chmod(new, stat.S_IMODE(os.stat(like).st_mode))
        marker = {"written_by": "skillswarm pull", "version": version, "files": _listing(new)}
        atomic_write_text(new / PULL_MARKER, json.dumps(marker, indent=1, sort_keys=True) + "\n")
        earlier = check_out(out)  # again: the directory may have changed while this pull ran
        if earlier is None:
            try:
                os.rename(new, out)  # over a missing or empty directory
            except OSError as e:
                raise SkillswarmError(f"cannot write --out {out}: {e.strerror}; pick an empty or new directory "
                                      "for --out") from None
        elif _exchange(new, out):
            earlier_at = new  # swapped in one step
        else:
            earlier_at = stage / "old"
            os.rename(out, earlier_at)
            os.rename(new, out)
    except BaseException:
        if earlier_at is not None and not os.path.lexists(out):  # between the two renames: put it back
            try:
                os.rename(earlier_at, out)
                earlier_at = None
            except OSError:
                pass
        if earlier_at is None:
            shutil.rmtree(stage, ignore_errors=True)  # this pull's copy only
        else:
            (stage / _STAGING_MARK).unlink(missing_ok=True)  # never removed as a dead pull's
            log.warning("the earlier pull in %s is kept in %s", out, earlier_at)
        raise
    if earlier_at is not None and earlier is not None and not _remove_pull(earlier_at, earlier):
        (stage / _STAGING_MARK).unlink(missing_ok=True)
        log.warning("%s holds files the earlier pull in %s did not write (they appeared while it was replaced); "
                    "they are kept there", earlier_at, out)
        return out
    shutil.rmtree(stage, ignore_errors=True)  # its mark only
    return out


SHARE_TTL = 120.0  # short: a node that leaves stops being offered to fetchers soon


def share(dht: "SwarmDHT", store: CheckpointStore, blobs: BlobStore, manifest: CheckpointManifest) -> None:
    """Serve the files of a local version (and its merged delta when held), so pulls spread over every
    node that has it instead of all hitting the coordinator. Each is re-announced every third of SHARE_TTL while
    this node runs (`SwarmDHT.provide`), so a leaving coordinator counts this node's copy (`copy_holders`)."""
    if not store.check(manifest.version):
        raise BlobError(f"local checkpoint v{manifest.version} is missing or damaged (a damaged one is deleted); "
                        "pull it again before serving it")
    ckpt = store.path(manifest.version)
    for f in manifest.files:
        if not blobs.has(f.sha256, f.size):
            blobs.add_file(ckpt / f.path, link=True)
        dht.provide(f.sha256, store=blobs, ttl=SHARE_TTL)
    if manifest.merged_delta is not None and blobs.has(manifest.merged_delta.sha256):
        dht.provide(manifest.merged_delta.sha256, store=blobs, ttl=SHARE_TTL)


def copy_holders(dht: "SwarmDHT", manifest: CheckpointManifest) -> set[str]:
    """The other peers that hold a verified copy of every file of `manifest` now: each announces the file (a
    provider record) and, asked, says it holds every piece of it."""
    held: set[str] | None = None
    for f in manifest.files:
        others = [p for p in dht.get_providers(f.sha256, limit=256) if held is None or p.peer_id in held]
        held = set(dht.holders(f.sha256, f.size, others)) if others else set()
        if not held:
            break
    return held or set()


def wait_for_copies(dht: "SwarmDHT", manifest: CheckpointManifest, wanted: int, timeout: float, *, poll: float = 3.0,
                    leave: threading.Event | None = None) -> int:
    """Keep serving `manifest` (the caller's node does) until `wanted` other peers hold a copy of every file of it
    (`copy_holders`), `timeout` seconds pass or `leave` is set, so that its last holder does not leave with it. Logs
    what it waits for and the outcome, each in one line; returns how many copies it saw."""
    v = manifest.version
    if wanted <= 0:
        return 0
    log.info("v%d: waiting up to %g s for %d other peer(s) to hold a copy before leaving", v, timeout, wanted)
    start = time.monotonic()
    seen = 0
    while True:
        try:
            seen = len(copy_holders(dht, manifest))
        except (SkillswarmError, OSError) as e:  # a DHT hiccup: ask again on the next look
            log.debug("could not count the copies of v%d: %s", v, e)
        if seen >= wanted:
            log.info("v%d held by %d other peer%s", v, seen, "" if seen == 1 else "s")
            return seen
        waited = time.monotonic() - start
        if waited >= timeout or (leave is not None and leave.is_set()):
            log.warning("v%d: only %d of %d copies after %g s; leaving", v, seen, wanted, round(waited, 1))
            return seen
        pause = min(poll, timeout - waited)
        if leave is not None:
            leave.wait(pause)
        else:
            time.sleep(pause)
