"""Recomputing a published merge: what a manifest says it was made from (its parent, its included deltas with their
weights and layers, its merge policy and seed), and the same merge run again here, with this machine's threads and
chunk size, whose weights and merged delta must hash as the manifest says. `coordinator run --verify` uses it, and
so does a coordinator co-signing another's checkpoint (node/roles/coordinator.py)."""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

from skillswarm.merge.rounds import RoundDelta, included_deltas, round_merge
from skillswarm.node.checkpoints.pull import pull
from skillswarm.node.checkpoints.store import CheckpointStore, with_trees
from skillswarm.protocol.errors import SkillswarmError
from skillswarm.protocol.records import CheckpointManifest, MergePolicy, NetworkSpec
from skillswarm.protocol.transport.blobs import BlobStore

MAX_DELTA_BYTES = 64 << 30


@dataclass(frozen=True)
class MergeOptions:
    """How this machine runs a merge (never what it computes: any values give the same bits). None: the
    merge engine's defaults."""

    threads: int | None = None  # merge compute threads
    chunk_elems: int | None = None  # elements per row chunk: memory per input

    def kwargs(self) -> dict[str, int]:
        """The keyword arguments of `round_merge` (and `merge_checkpoint`) these options set."""
        return {k: v for k, v in (("workers", self.threads), ("chunk_elems", self.chunk_elems)) if v}


def merge_params(policy: MergePolicy, seed: int) -> dict[str, float]:
    """Everything needed to recompute a merge, as recorded in the manifest's `params`."""
    return {"density": policy.density, "lambda": policy.scale, "trim_fraction": policy.trim_fraction,
            "max_norm_ratio": policy.max_norm_ratio, "seed": float(seed)}


def policy_from_manifest(m: CheckpointManifest) -> tuple[MergePolicy, int]:
    """The merge policy and seed a manifest says it was made with (for `--verify`)."""
    p, d = m.params, MergePolicy()  # what a manifest leaves out is the policy's default
    policy = MergePolicy(method=m.method or d.method, aggregator=m.aggregator or d.aggregator,
                         density=p.get("density", d.density), scale=p.get("lambda", d.scale),
                         trim_fraction=p.get("trim_fraction", d.trim_fraction),
                         max_norm_ratio=p.get("max_norm_ratio", d.max_norm_ratio))
    return policy, int(p.get("seed", m.parent_version or 0))


def merge_inputs(spec: NetworkSpec, dht, store: CheckpointStore, blobs: BlobStore, manifest: CheckpointManifest,
                 *, progress: bool = False, trees: dict[str, str] | None = None) -> tuple[Path, list[RoundDelta]]:
    """What a published merge was made from: its parent checkpoint (pulled if not local) and its included deltas
    (fetched, each with its weight and layers; from every holder at once where `trees` has its blob's tree hash), for
    `merge.round_merge` to recompute it or re-merge it another way."""
    if manifest.parent_version is None:
        raise SkillswarmError(f"v{manifest.version} is the genesis checkpoint; it was not merged from anything")
    if not store.has(manifest.parent_version):
        parent = dht.get_checkpoint(manifest.parent_version, trusted=spec.coordinators, quorum=spec.quorum_k())
        if parent is None:
            raise SkillswarmError(f"parent v{manifest.parent_version} is neither local nor on the network")
        pull(dht, spec, parent, store, blobs, progress=progress)
    trees = trees or {}
    deltas = included_deltas(manifest, lambda ref: dht.fetch(ref.blob, max_size=MAX_DELTA_BYTES, store=blobs,
                                                             progress=progress, tree=trees.get(ref.blob)))
    return store.path(manifest.parent_version), deltas


@dataclass(frozen=True)
class Verification:
    """A recomputed merge against its manifest: the checkpoint's weights hash and the merged delta's sha256."""

    weights_hash: str
    merged_delta: str | None  # None for the genesis checkpoint, which has no merged delta
    match: bool


def verify_checkpoint(spec: NetworkSpec, dht, store: CheckpointStore, blobs: BlobStore, manifest: CheckpointManifest,
                      *, progress: bool = False, options: MergeOptions | None = None,
                      commit_as: CheckpointManifest | None = None, trees: dict[str, str] | None = None) -> Verification:
    """Recompute a published merge from its parent and included deltas, here, with this machine's threads and
    chunk size (`options`): both the checkpoint's weights hash and the merged delta workers apply must match. A
    manifest of an older protocol verifies too (its deltas' layers are read from their figures). With `commit_as` (the
    same manifest, signed by this node), a match is kept: the recomputed checkpoint committed under it, the merged
    delta added to the blob store."""
    if manifest.parent_version is None:
        return Verification(spec.base_hash, None, manifest.weights_hash == spec.base_hash)
    if not manifest.included:  # a round that rejected everything keeps its parent's weights
        return Verification(manifest.weights_hash, None, manifest.weights_hash == manifest.parent_hash)
    parent_dir, deltas = merge_inputs(spec, dht, store, blobs, manifest, progress=progress, trees=trees)
    policy, seed = policy_from_manifest(manifest)
    staging = store.staging()
    try:
        result = round_merge(parent_dir, deltas, policy, staging / "ckpt", seed=seed,
                             delta_out=staging / "merged.safetensors", base_hash=manifest.parent_hash,
                             progress=progress, **(options or MergeOptions()).kwargs())
        assert result.delta is not None
        want_delta = manifest.merged_delta.sha256 if manifest.merged_delta else None
        ok = result.weights_hash == manifest.weights_hash and (want_delta is None or result.delta.sha256 == want_delta)
        if ok and commit_as is not None:
            blobs.add_file(staging / "merged.safetensors", move=True)
            with_trees(commit_as.files, staging / "ckpt", blobs)  # the files' piece lists, ready to serve
            store.commit(commit_as, staging / "ckpt")  # checks every file against the manifest
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return Verification(result.weights_hash, result.delta.sha256, ok)
