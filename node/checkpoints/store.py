"""The local checkpoint store of one network: complete checkpoint directories by version, each with
the signed manifest it was verified against. A directory appears whole (temp dir + rename) or not at all, and
is checked again before it is used (`check`: its files are hard links to blobs, which can be damaged in place)."""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import uuid
from pathlib import Path

import msgspec

from skillswarm.protocol.atomic import atomic_write_bytes
from skillswarm.protocol.codec import decode_record, encode_record
from skillswarm.protocol.errors import HashMismatchError, RecordError
from skillswarm.protocol.hashing import sha256_file, weights_hash
from skillswarm.protocol.paths import cache_dir
from skillswarm.protocol.records import CheckpointManifest, FileEntry
from skillswarm.protocol.transport.blobs import BlobStore, file_problem
from skillswarm.protocol.transport.pieces import file_pieces, tree_hash

log = logging.getLogger(__name__)

MANIFEST_NAME = "manifest.msgpack"
# Files of a base model that a checkpoint carries (weights in other formats and hidden files are left out).
_SKIP_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".gguf", ".h5", ".msgpack", ".lock")


def link_or_copy(src: Path, dst: Path) -> None:
    """`dst` as a hard link to `src` (no bytes copied), or a copy where the file system cannot link."""
    try:
        os.link(src, dst)
    except OSError:
        shutil.copyfile(src, dst)


def checkpoint_files(model_dir: Path) -> list[FileEntry]:
    """FileEntries (name, sha256, size) of the top-level files a Hugging Face model directory needs."""
    out = []
    for p in sorted(Path(model_dir).iterdir()):
        if p.is_file() and not p.name.startswith(".") and not p.name.endswith(_SKIP_SUFFIXES):
            out.append(FileEntry(path=p.name, sha256=sha256_file(p), size=p.stat().st_size))
    if not any(f.path == "config.json" for f in out):
        raise FileNotFoundError(f"{model_dir} has no config.json; it is not a Hugging Face model directory")
    return out


def with_trees(files: list[FileEntry], model_dir: Path, blobs: BlobStore | None = None) -> list[FileEntry]:
    """The entries with the tree hash of each file in `model_dir`, so pullers fetch it from every provider at
    once; the piece lists go into `blobs`' cache, ready to serve."""
    out = []
    for f in files:
        piece_list = file_pieces(Path(model_dir) / f.path)
        if blobs is not None:
            blobs.save_pieces(f.sha256, piece_list)
        out.append(msgspec.structs.replace(f, tree=tree_hash(piece_list)))
    return out


def network_dir(network: str, home: Path | None = None) -> Path:
    """Where a node keeps one network's checkpoints and runs (this node's, or that of the node whose home is `home`)."""
    return cache_dir(home) / "networks" / network


def round_dir(network_root: Path, skill: str, version: int) -> Path:
    """Where a worker trains its round on checkpoint `version` (its trained model is `<dir>/model`)."""
    return network_root / "runs" / f"{skill}-v{version}"


class CheckpointStore:
    """Checkpoints of one network under `root/checkpoints/v{N}/` (HF files + `manifest.msgpack`)."""

    def __init__(self, network: str, root: Path | str | None = None) -> None:
        self.network = network
        self.root = Path(root) if root else network_dir(network)
        self.dir = self.root / "checkpoints"
        self.dir.mkdir(parents=True, exist_ok=True)

    def path(self, version: int) -> Path:
        """Where version `version` lives (whether or not it is there)."""
        return self.dir / f"v{version}"

    def has(self, version: int) -> bool:
        """True when version `version` is complete here."""
        return (self.path(version) / MANIFEST_NAME).is_file()

    def check(self, version: int) -> bool:
        """Whether version `version` is here and each of its files still matches its manifest (size on every call,
        sha256 once per process: `blobs.file_problem`); a damaged one is deleted with a warning, to be fetched again."""
        if not self.has(version):
            return False
        for f in self.manifest(version).files:
            try:
                problem = file_problem(self.path(version) / f.path, f.sha256, f.size)
            except FileNotFoundError:
                problem = "it is missing"
            if problem is not None:
                log.warning("local checkpoint v%d is damaged (%s: %s): deleted, to be fetched again", version, f.path,
                            problem)
                self.remove(version)
                return False
        return True

    def remove(self, version: int) -> None:
        """Delete local version `version` (no error if absent): renamed out of place first, so it is never seen half gone."""
        target = self.path(version)
        gone = self.dir / f".staging-removed-{uuid.uuid4().hex}"
        try:
            os.rename(target, gone)
        except FileNotFoundError:
            return
        shutil.rmtree(gone, ignore_errors=True)

    def versions(self) -> list[int]:
        """Complete local versions, ascending."""
        out = []
        for p in self.dir.glob("v*"):
            if p.name[1:].isdigit() and (p / MANIFEST_NAME).is_file():
                out.append(int(p.name[1:]))
        return sorted(out)

    def latest(self) -> int | None:
        """The newest complete local version."""
        versions = self.versions()
        return versions[-1] if versions else None

    def manifest(self, version: int) -> CheckpointManifest:
        """The signed manifest stored with a local version."""
        try:
            return decode_record((self.path(version) / MANIFEST_NAME).read_bytes(), CheckpointManifest)
        except FileNotFoundError:
            raise RecordError(f"no local checkpoint v{version} in {self.dir}") from None

    def staging(self) -> Path:
        """A fresh temp directory on the store's filesystem, for building a checkpoint before `commit`."""
        return Path(tempfile.mkdtemp(dir=self.dir, prefix=".staging-"))

    def commit(self, manifest: CheckpointManifest, built: Path, *, verify: bool = True) -> Path:
        """Move a fully built checkpoint directory into place as `manifest.version`, after checking that its
        files and weights match the manifest (a mismatch deletes nothing of what was there)."""
        if verify:
            verify_dir(built, manifest)
        atomic_write_bytes(built / MANIFEST_NAME, encode_record(manifest))
        target = self.path(manifest.version)
        if target.exists():
            if self.has(manifest.version) and self.manifest(manifest.version).weights_hash == manifest.weights_hash:
                shutil.rmtree(built, ignore_errors=True)
                return target
            shutil.rmtree(target)
        os.rename(built, target)
        return target

    def assemble(self, manifest: CheckpointManifest, blobs: BlobStore) -> Path:
        """Build a version from blobs already in `blobs` (hard links where possible) and commit it."""
        built = self.staging()
        try:
            for f in manifest.files:
                link_or_copy(blobs.path(f.sha256), built / f.path)
            return self.commit(manifest, built)
        except BaseException:
            shutil.rmtree(built, ignore_errors=True)
            raise

    def clean_staging(self) -> None:
        """Remove what a crash left half-built."""
        for p in self.dir.glob(".staging-*"):
            shutil.rmtree(p, ignore_errors=True)


def verify_dir(model_dir: Path, manifest: CheckpointManifest) -> None:
    """Check every file of `manifest` is in `model_dir` with its size and sha256 (`blobs.file_problem`: a file
    hard-linked from a blob checked in this process is not hashed again), and the weights hash matches."""
    for f in manifest.files:
        p = model_dir / f.path
        if not p.is_file():
            raise HashMismatchError(f"checkpoint v{manifest.version} is missing {f.path}")
        if (problem := file_problem(p, f.sha256, f.size)) is not None:
            raise HashMismatchError(f"{f.path} of checkpoint v{manifest.version} does not match its manifest ({problem})")
    got = weights_hash(model_dir)
    if got != manifest.weights_hash:
        raise HashMismatchError(f"weights of checkpoint v{manifest.version} hash to {got[:12]}, "
                                f"manifest says {manifest.weights_hash[:12]}")
