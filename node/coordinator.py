"""The coordinator role: each round, collect the deltas trained on the current checkpoint, verify,
fetch and screen them, merge them (robustly within a skill, then across skills with the network's
method), evaluate every skill on the result, and publish checkpoint V+1 with a signed manifest.

Crash safety: a checkpoint is built in a staging dir and committed (with its signed manifest) by a
rename before it is published; on restart, staging debris is removed and a committed but unpublished
version is published as it was signed, so a version is never merged or published twice.
"""

from __future__ import annotations

import logging
import shutil
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from skillswarm.node import failpoints
from skillswarm.node.pull import find_checkpoint, local_base, pull, share
from skillswarm.node.store import CheckpointStore, checkpoint_files
from skillswarm.protocol.blobs import BlobStore
from skillswarm.protocol.errors import SkillswarmError, SpecError
from skillswarm.protocol.hashing import weights_hash
from skillswarm.protocol.identity import Identity
from skillswarm.protocol.records import (
    CheckpointManifest, DeltaManifest, DeltaRef, FileEntry, MergePolicy, NetworkSpec, Rejection, SkillMetrics,
)

log = logging.getLogger(__name__)

MANIFEST_TTL = 24 * 3600.0  # re-stored every ttl/3 while the coordinator runs
MAX_DELTA_BYTES = 64 << 30


@dataclass(frozen=True)
class MergeOptions:
    """How this machine runs a merge (never what it computes: any values give the same bits). None: the
    merge engine's defaults."""

    threads: int | None = None  # merge compute threads
    chunk_elems: int | None = None  # elements per row chunk: memory per input

    def kwargs(self) -> dict[str, int]:
        """The keyword arguments of `merge_checkpoint` these options set."""
        return {k: v for k, v in (("workers", self.threads), ("chunk_elems", self.chunk_elems)) if v}


@dataclass
class RoundReport:
    """What one merge round did (for logs, the CLI and the demo)."""

    manifest: CheckpointManifest
    seconds: float
    fetched: int
    rejected: list[Rejection] = field(default_factory=list)


def merge_params(policy: MergePolicy, seed: int) -> dict[str, float]:
    """Everything needed to recompute a merge, as recorded in the manifest's `params`."""
    return {"density": policy.density, "lambda": policy.scale, "trim_fraction": policy.trim_fraction,
            "max_norm_ratio": policy.max_norm_ratio, "seed": float(seed)}


def policy_from_manifest(m: CheckpointManifest) -> tuple[MergePolicy, int]:
    """The merge policy and seed a manifest says it was made with (for `--verify`)."""
    p = m.params
    policy = MergePolicy(method=m.method or "ties", aggregator=m.aggregator or "mean", density=p.get("density", 0.2),
                         scale=p.get("lambda", 1.0), trim_fraction=p.get("trim_fraction", 0.1),
                         max_norm_ratio=p.get("max_norm_ratio", 5.0))
    return policy, int(p.get("seed", m.parent_version or 0))


def dense_codec_for(model_dir: Path) -> str:
    """The dense delta codec in the checkpoint's own dtype, so applying the merged delta is bit-exact."""
    from safetensors import safe_open

    first = sorted(model_dir.glob("*.safetensors"))[0]
    with safe_open(str(first), framework="pt") as f:
        dtype = f.get_slice(next(iter(f.keys()))).get_dtype()
    return {"BF16": "dense_bf16", "F16": "dense_fp16"}.get(dtype, "dense_fp32")


def genesis_manifest(spec: NetworkSpec, identity: Identity, base: Path) -> CheckpointManifest:
    """Checkpoint v0 = the network's base model, checked against the spec's base hash."""
    got = weights_hash(base)
    if got != spec.base_hash:
        raise SpecError(f"{base} hashes to {got[:12]}, but the network file says the base is {spec.base_hash[:12]}; "
                        "point --model / base_model at the right directory")
    return identity.sign_record(CheckpointManifest(network=spec.network, version=0, weights_hash=got,
                                                   files=checkpoint_files(base)))


def evaluate_all(model_dir: Path, skills: list[str], n: int) -> dict[str, SkillMetrics]:
    """Held-out accuracy and mean reward of every skill on one checkpoint (greedy)."""
    from skillswarm.node.evaluation import evaluate
    from skillswarm.node.generation import HFEngine

    engine = HFEngine.load(model_dir)
    out = {}
    for skill in skills:
        r = evaluate(engine, skill, n=n)
        out[skill] = SkillMetrics(accuracy=r.accuracy, mean_reward=r.mean_reward, n=r.n)
    return out


class Coordinator:
    """One coordinator of one network. `run()` merges rounds until `stop` is set or `max_rounds` are done."""

    def __init__(self, spec: NetworkSpec, identity: Identity, dht, store: CheckpointStore, blobs: BlobStore, *,
                 eval_n: int = 64, poll: float = 2.0, progress: bool = False,
                 on_event: Callable[[str, dict], None] | None = None, merge_options: MergeOptions | None = None) -> None:
        if identity.public_key_hex not in spec.coordinators:
            raise SpecError("this node's key is not among the network's coordinators; workers would ignore its "
                            "checkpoints (add its public key from `skillswarm id` to `coordinators`)")
        self.spec, self.identity, self.dht, self.store, self.blobs = spec, identity, dht, store, blobs
        self.eval_n, self.poll, self.progress = eval_n, poll, progress
        self.merge_options = merge_options or MergeOptions()
        self.on_event = on_event or (lambda kind, data: None)
        self.state = "starting"

    # ---- publishing ---------------------------------------------------------------------------------
    def publish(self, manifest: CheckpointManifest) -> None:
        """Serve a committed version's files, merged delta and included deltas (so anyone can recompute the
        merge), and keep its manifest in the DHT."""
        share(self.dht, self.store, self.blobs, manifest)
        for ref in manifest.included:
            if self.blobs.has(ref.blob):
                self.dht.provide(ref.blob, store=self.blobs)
        self.dht.put(manifest, MANIFEST_TTL, keep=True)
        log.info("published checkpoint v%d (%s)", manifest.version, manifest.weights_hash[:12])
        self.on_event("published", {"version": manifest.version, "weights_hash": manifest.weights_hash})

    def recover(self) -> CheckpointManifest:
        """Start-up: drop staging debris, republish every version held here, create genesis if the network
        has none; return the current (latest) checkpoint."""
        self.store.clean_staging()
        mine = [self.store.manifest(v) for v in self.store.versions()]
        for m in mine:
            if m.author == self.identity.public_key_hex:
                self.publish(m)
        current = find_checkpoint(self.dht, self.spec)
        if current is None and not mine:
            base = local_base(self.spec)
            if base is None:
                raise SpecError(f"no checkpoint on the network yet and base_model {self.spec.base_model!r} is not a "
                                "local directory; the first coordinator needs the base model on disk")
            genesis = genesis_manifest(self.spec, self.identity, base)
            for f in genesis.files:
                self.blobs.add_file(base / f.path)  # a copy: the user may edit their base dir
            self.store.assemble(genesis, self.blobs)
            self.publish(genesis)
            current = genesis
        local = max(mine, key=lambda m: m.version, default=None)
        if current is None or (local is not None and local.version > current.version):
            current = local
        assert current is not None
        pull(self.dht, self.spec, current, self.store, self.blobs, progress=self.progress)
        return current

    # ---- one round ----------------------------------------------------------------------------------
    def collect(self, current: CheckpointManifest) -> list[DeltaManifest]:
        """The round's candidate deltas: for the current version and one of the network's skills."""
        return [d for d in self.dht.get_deltas(current.version) if d.skill in self.spec.skills]

    def ready(self, deltas: list[DeltaManifest], waited: float) -> bool:
        """The round policy: enough deltas, or the wait is over and there is at least one."""
        policy = self.spec.round
        return len(deltas) >= policy.min_deltas or (waited >= policy.max_wait_s and len(deltas) > 0)

    def merge_round(self, current: CheckpointManifest, deltas: list[DeltaManifest]) -> RoundReport:
        """Fetch, screen, merge, evaluate, commit and publish version current+1."""
        from skillswarm.merge import DeltaCandidate, merge_checkpoint, screen_deltas

        t0 = time.monotonic()
        self.state = "merging"
        base_dir = self.store.path(current.version)
        rejected: list[Rejection] = []
        candidates: list[tuple[DeltaManifest, DeltaCandidate]] = []
        for d in sorted(deltas, key=lambda d: d.blob):
            if d.base_hash != current.weights_hash:
                rejected.append(_reject(d, "trained on a different base than the round's checkpoint"))
                continue
            try:
                path = self.dht.fetch(d.blob, size=d.size, max_size=min(d.size, MAX_DELTA_BYTES), store=self.blobs,
                                      progress=self.progress)
            except SkillswarmError as e:
                rejected.append(_reject(d, f"blob unavailable: {e}"))
                continue
            candidates.append((d, DeltaCandidate(path, key=d.blob, skill=d.skill, base_hash=d.base_hash)))
        policy = self.spec.merge
        screened = screen_deltas(base_dir, [c for _, c in candidates], base_hash=current.weights_hash,
                                 max_norm_ratio=policy.max_norm_ratio)
        by_blob = {d.blob: d for d, _ in candidates}
        rejected += [_reject(by_blob[r.candidate.key], r.reason) for r in screened.rejected]
        accepted = [by_blob[a.candidate.key] for a in screened.accepted]
        if not accepted:
            raise SkillswarmError(f"every delta of round v{current.version} was rejected: "
                                  + "; ".join(r.reason for r in rejected)[:500])
        groups: dict[str, list[tuple[Path, float]]] = {}
        for d in accepted:
            groups.setdefault(d.skill, []).append((self.blobs.path(d.blob), 1.0))
        seed = current.version
        staging = self.store.staging()
        try:
            out = staging / "ckpt"
            failpoints.hit("coordinator.before_merge")
            result = merge_checkpoint(base_dir, groups, policy, out, seed=seed, delta_out=staging / "merged.safetensors",
                                      delta_codec=dense_codec_for(base_dir), base_hash=current.weights_hash,
                                      progress=self.progress, **self.merge_options.kwargs())
            failpoints.hit("coordinator.after_merge")
            self.state = "evaluating"
            metrics = evaluate_all(out, list(self.spec.skills), self.eval_n)
            delta_sha = self.blobs.add_file(staging / "merged.safetensors", move=True)
            manifest = self.identity.sign_record(CheckpointManifest(
                network=self.spec.network, version=current.version + 1, parent_version=current.version,
                parent_hash=current.weights_hash, weights_hash=result.weights_hash, files=result.files,
                merged_delta=FileEntry(path="merged_delta.safetensors", sha256=delta_sha, size=self.blobs.size(delta_sha)),
                method=policy.method, aggregator=policy.aggregator, params=merge_params(policy, seed),
                included=[DeltaRef(blob=d.blob, author=d.author, skill=d.skill, weight=1.0) for d in accepted],
                rejected=rejected[:256], metrics=metrics,
            ))
            self.store.commit(manifest, out, verify=False)  # the merge computed the hashes it wrote
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        failpoints.hit("coordinator.after_commit")
        self.publish(manifest)
        self.state = "idle"
        report = RoundReport(manifest, time.monotonic() - t0, len(candidates), rejected)
        self.on_event("merged", {"version": manifest.version, "included": len(accepted), "rejected": len(rejected),
                                 "metrics": {k: v.accuracy for k, v in metrics.items()}, "seconds": report.seconds})
        return report

    def run(self, stop: threading.Event | None = None, max_rounds: int | None = None) -> list[RoundReport]:
        """Merge rounds until `stop` is set or `max_rounds` merges are done."""
        stop = stop or threading.Event()
        current = self.recover()
        reports: list[RoundReport] = []
        round_start, seen = time.monotonic(), -1
        while not stop.is_set() and (max_rounds is None or len(reports) < max_rounds):
            self.state = "idle"
            newest = find_checkpoint(self.dht, self.spec)
            if newest is not None and newest.version > current.version:  # another coordinator moved on
                pull(self.dht, self.spec, newest, self.store, self.blobs, progress=self.progress)
                current, round_start = newest, time.monotonic()
            deltas = self.collect(current)
            if len(deltas) != seen:
                seen = len(deltas)
                log.info("round v%d: %d delta(s) so far", current.version, seen)
                self.on_event("round", {"version": current.version, "deltas": seen})
            if self.ready(deltas, time.monotonic() - round_start):
                try:
                    report = self.merge_round(current, deltas)
                except SkillswarmError as e:
                    log.error("round v%d failed: %s", current.version, e)
                    stop.wait(self.poll)
                    continue
                reports.append(report)
                current, round_start, seen = report.manifest, time.monotonic(), -1
                continue
            stop.wait(self.poll)
        return reports


def _reject(d: DeltaManifest, reason: str) -> Rejection:
    return Rejection(blob=d.blob, author=d.author, skill=d.skill, reason=reason[:256])


def merge_inputs(spec: NetworkSpec, dht, store: CheckpointStore, blobs: BlobStore, manifest: CheckpointManifest,
                 *, progress: bool = False) -> tuple[Path, dict[str, list[tuple[Path, float]]]]:
    """What a published merge was made from: its parent checkpoint (pulled if not local) and its included
    deltas (fetched), grouped by skill, to recompute it or re-merge it another way."""
    if manifest.parent_version is None:
        raise SkillswarmError(f"v{manifest.version} is the genesis checkpoint; it was not merged from anything")
    if not store.has(manifest.parent_version):
        parent = dht.get_checkpoint(manifest.parent_version, trusted=spec.coordinators)
        if parent is None:
            raise SkillswarmError(f"parent v{manifest.parent_version} is neither local nor on the network")
        pull(dht, spec, parent, store, blobs, progress=progress)
    groups: dict[str, list[tuple[Path, float]]] = {}
    for ref in manifest.included:
        path = dht.fetch(ref.blob, max_size=MAX_DELTA_BYTES, store=blobs, progress=progress)
        groups.setdefault(ref.skill, []).append((path, ref.weight))
    return store.path(manifest.parent_version), groups


@dataclass(frozen=True)
class Verification:
    """A recomputed merge against its manifest: the checkpoint's weights hash and the merged delta's sha256."""

    weights_hash: str
    merged_delta: str | None  # None for the genesis checkpoint, which has no merged delta
    match: bool


def verify_checkpoint(spec: NetworkSpec, dht, store: CheckpointStore, blobs: BlobStore, manifest: CheckpointManifest,
                      *, progress: bool = False, options: MergeOptions | None = None) -> Verification:
    """Recompute a published merge from its parent and included deltas, here, with this machine's threads and
    chunk size (`options`): both the checkpoint's weights hash and the merged delta workers apply must match."""
    from skillswarm.merge import merge_checkpoint

    if manifest.parent_version is None:
        return Verification(spec.base_hash, None, manifest.weights_hash == spec.base_hash)
    parent_dir, groups = merge_inputs(spec, dht, store, blobs, manifest, progress=progress)
    policy, seed = policy_from_manifest(manifest)
    staging = store.staging()
    try:
        result = merge_checkpoint(parent_dir, groups, policy, staging / "ckpt", seed=seed, progress=progress,
                                  delta_out=staging / "merged.safetensors", delta_codec=dense_codec_for(parent_dir),
                                  base_hash=manifest.parent_hash, **(options or MergeOptions()).kwargs())
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    assert result.delta is not None
    want_delta = manifest.merged_delta.sha256 if manifest.merged_delta else None
    ok = result.weights_hash == manifest.weights_hash and (want_delta is None or result.delta.sha256 == want_delta)
    return Verification(result.weights_hash, result.delta.sha256, ok)
