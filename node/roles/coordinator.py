"""The coordinator role: each round, collect the deltas trained on the current checkpoint, screen them
through the network's round strategy (manifest checks, caps, fetch, file checks, consensus, usefulness,
weights: `node/roles/rounds/`), merge what passes (robustly within a skill, then across skills with the network's
method; the merge guard takes a delta out and merges again while a skill ends worse than the parent),
evaluate every skill on the result, and publish checkpoint V+1 with a signed manifest that lists
every inclusion and rejection with its figures.

A round never stalls on a peer: only online workers' deltas count, downloads have deadlines and a budget,
an empty round says so and keeps waiting, and an all-rejected round backs off (`net status` shows why)
and retries only when new deltas arrive; once every online worker's delta has been tried, it ends the
round with the weights unchanged (`skip_round`), so honest workers train on instead of the network
waiting for deltas nobody will send. Rejected blobs are deleted.

No input stops the loop: the round steps turn what a delta's bytes break into that delta's rejection, and an
error they did not foresee (a bug, or a hostile input no check caught) fails only the attempt: its deltas are
recorded as rejected with the error (not held against their keys: which one caused it is unknown), never tried
again, and the round goes on as an all-rejected one. A crash would restart into the same delta.

Several coordinators (the network's `coordinators`, with a `quorum` k): one leads each round
(node/roles/leadership.py); the others recompute its merge from its manifest and, when the weights and the merged
delta hash the same, sign the same manifest with their own key. Nodes accept a version once k coordinators signed
it (protocol/quorum.py). A coordinator signs at most one manifest per version, ever (its store holds what it
signed), and a leader that finds another's manifest for its version before committing its own drops it.

Crash safety: a checkpoint is built in a staging dir and committed (with its signed manifest) by a
rename before it is published; on restart, staging debris is removed and a committed but unpublished
version is published as it was signed, so a version is never merged or published twice.
"""

from __future__ import annotations

import logging
import secrets
import shutil
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import msgspec

from skillswarm.merge.screening import short_reason
from skillswarm.node.roles import failpoints
from skillswarm.node.roles.leadership import round_leader, round_order
from skillswarm.node.roles.verification import MergeOptions, merge_params, verify_checkpoint
from skillswarm.node.checkpoints.pull import find_checkpoint, local_base, pull, share, wait_for_copies
from skillswarm.node.rl.config import EVAL_N
from skillswarm.node.roles.rounds import Candidate, RoundInputs, RoundStrategy, evaluate_all
from skillswarm.node.checkpoints.store import CheckpointStore, checkpoint_files, link_or_copy, with_trees
from skillswarm.protocol.codec import encode_record
from skillswarm.protocol.errors import RecordError, SkillswarmError, SpecError
from skillswarm.protocol.hashing import weights_hash
from skillswarm.protocol.identity import Identity, fingerprint
from skillswarm.protocol.quorum import Endorsement, body_digest
from skillswarm.protocol.records import (
    CheckpointManifest,
    DeltaManifest,
    FileEntry,
    NetworkSpec,
    Rejection,
)
from skillswarm.protocol.transport.blobs import BlobStore

log = logging.getLogger(__name__)

MANIFEST_TTL = 24 * 3600.0  # re-stored every ttl/3 while the coordinator runs
KEEP_DELTA_ROUNDS = 8  # a merged round's deltas stay here (and served, for --verify) this many versions

__all__ = ["Coordinator", "RoundReport", "RoundRejected", "Superseded", "evaluate_all", "fit_manifest",
           "genesis_manifest"]


@dataclass
class RoundReport:
    """What one merge round did (for logs, the CLI, the demo and the poisoning bench)."""

    manifest: CheckpointManifest
    seconds: float
    fetched: int
    rejected: list[Rejection] = field(default_factory=list)
    step_seconds: dict[str, float] = field(default_factory=dict)


class Superseded(SkillswarmError):
    """Another coordinator's manifest for this version appeared before this node signed its own: it checks that
    one instead of publishing a second."""


class RoundRejected(SkillswarmError):
    """Every candidate of a round was rejected; nothing to merge until new deltas arrive."""

    def __init__(self, version: int, rejected: list[Rejection], eval_seed: int | None = None) -> None:
        reasons = "; ".join(f"{r.skill} {r.blob[:8]}: {r.reason}" for r in rejected[:4])
        super().__init__(f"every delta of round v{version} was rejected ({len(rejected)}): {reasons}"[:1000])
        self.rejected, self.eval_seed = rejected, eval_seed


def genesis_manifest(spec: NetworkSpec, identity: Identity, base: Path,
                     blobs: BlobStore | None = None) -> CheckpointManifest:
    """Checkpoint v0 = the network's base model, checked against the spec's base hash (its files' piece lists
    cached in `blobs` when given)."""
    got = weights_hash(base)
    if got != spec.base_hash:
        raise SpecError(f"{base} hashes to {got[:12]}, but the network file says the base is {spec.base_hash[:12]}; "
                        "point --model / base_model at the right directory")
    return identity.sign_record(CheckpointManifest(network=spec.network, version=0, weights_hash=got,
                                                   files=with_trees(checkpoint_files(base), base, blobs)))


def fit_manifest(manifest: CheckpointManifest, identity: Identity) -> CheckpointManifest:
    """Sign `manifest`, leaving out listed rejections (counted in `omitted`) until it fits its size cap."""
    rejected = list(manifest.rejected)
    while True:
        left_out = len(manifest.rejected) - len(rejected)
        m = identity.sign_record(msgspec.structs.replace(manifest, rejected=rejected, omitted=manifest.omitted + left_out))
        try:
            encode_record(m)
            return m
        except RecordError:
            if not rejected:
                raise
            rejected = rejected[:len(rejected) * 3 // 4]


def failed_round(deltas: list[DeltaManifest], error: BaseException, listed: set[str]) -> list[Rejection]:
    """The rejections of deltas whose round attempt failed on an unforeseen error: not harmful (which delta caused
    it is unknown), so no key's reputation pays for it; deltas already `listed` are left out."""
    reason = f"the round failed while judging it: {type(error).__name__}: {error}"
    return [Rejection(blob=d.blob, author=d.author, skill=d.skill, reason=short_reason(reason), step="round",
                      figures={"harmful": 0.0}) for d in deltas if d.blob not in listed]


class Coordinator:
    """One coordinator of one network. `run()` merges rounds until `stop` is set or `max_rounds` are done."""

    def __init__(self, spec: NetworkSpec, identity: Identity, dht, store: CheckpointStore, blobs: BlobStore, *,
                 eval_n: int = EVAL_N, poll: float = 2.0, progress: bool = False,
                 on_event: Callable[[str, dict], None] | None = None, merge_options: MergeOptions | None = None,
                 strategy: RoundStrategy | None = None) -> None:
        if identity.public_key_hex not in spec.coordinators:
            raise SpecError("this node's key is not among the network's coordinators; workers would ignore its "
                            "checkpoints (add its public key from `skillswarm id` to `coordinators`)")
        self.spec, self.identity, self.dht, self.store, self.blobs = spec, identity, dht, store, blobs
        self.eval_n, self.poll, self.progress = eval_n, poll, progress
        self.on_event = on_event or (lambda kind, data: None)
        self.merge_options = merge_options or MergeOptions()
        self.strategy = strategy or RoundStrategy()
        self.state = "starting"
        self.note = ""  # why the current round waits (shown by `net status`)
        # when this node first saw each delta manifest, (author, blob) -> its clock's time: which of two equal deltas
        # came first (a copy's original), an order no author can write into its manifest
        self.first_seen: dict[tuple[str, str], float] = {}
        self.current: CheckpointManifest | None = None  # the latest version this node holds and serves
        self.refused: set[str] = set()  # body digests of other coordinators' manifests whose merge did not recompute
        self.took_over: set[int] = set()  # rounds (by parent version) this node led in place of one offline or silent

    @property
    def shared(self) -> bool:
        """Whether the network has other coordinators (leadership and co-signing apply)."""
        return len(self.spec.coordinators) > 1

    def signed(self, version: int) -> CheckpointManifest | None:
        """The manifest of `version` this node signed (led or co-signed), if any: it never signs another."""
        if self.store.has(version):
            m = self.store.manifest(version)
            if m.author == self.identity.public_key_hex:
                return m
        return None

    def proposals(self, version: int) -> list[Endorsement]:
        """Other coordinators' manifests of `version` not yet refused here, most signed first."""
        return [e for e in self.dht.checkpoint_endorsements(version, trusted=self.spec.coordinators)
                if e.digest not in self.refused]

    def leader(self, current: CheckpointManifest, elapsed_s: float) -> str | None:
        """Who leads the round on `current` now, among the trusted coordinators online (this one counts as online)."""
        online = {p.author for p in self.dht.get_peers() if p.role == "coordinator"} & set(self.spec.coordinators)
        online.add(self.identity.public_key_hex)
        return round_leader(self.spec.coordinators, current.version, online, elapsed_s, self.spec.round.overdue_s())

    def cosign(self, current: CheckpointManifest, proposal: Endorsement) -> RoundReport | None:
        """Recompute another coordinator's merge of `current` from its manifest; when both the weights and the merged
        delta hash the same, keep the checkpoint and publish the same manifest signed by this node. A mismatch is
        refused for good (logged, shown in `net status`). Returns the co-signature's report, or None."""
        t0 = time.monotonic()
        theirs = proposal.manifest
        self.state = "merging"
        found = self.dht.get_deltas(current.version)
        offered = {(d.blob, d.author, d.skill) for d in found}
        trees = {d.blob: d.tree for d in found if d.tree is not msgspec.UNSET}
        unknown = [r for r in theirs.included if (r.blob, r.author, r.skill) not in offered]
        if theirs.parent_version != current.version or theirs.parent_hash != current.weights_hash or unknown:
            self.refused.add(proposal.digest)
            why = (f"merges {len(unknown)} delta(s) no worker offered for v{current.version}" if unknown
                   else f"is not a child of v{current.version} held here")
            self._wait(f"v{theirs.version} by {fingerprint(theirs.author)} {why}: not co-signed")
            self.on_event("refused", {"version": theirs.version, "author": theirs.author})
            return None
        mine = self.identity.sign_record(msgspec.structs.replace(theirs, author="", created=0.0, signature=b""))
        check = verify_checkpoint(self.spec, self.dht, self.store, self.blobs, theirs, progress=self.progress,
                                  options=self.merge_options, commit_as=mine, trees=trees)
        if not check.match:
            self.refused.add(proposal.digest)
            self._wait(f"v{theirs.version} by {fingerprint(theirs.author)} does not recompute here (weights "
                       f"{check.weights_hash[:12]}, manifest says {theirs.weights_hash[:12]}): not co-signed")
            self.on_event("refused", {"version": theirs.version, "author": theirs.author})
            return None
        if not self.store.has(mine.version):  # a round that kept its parent's weights: the same files
            pull(self.dht, self.spec, mine, self.store, self.blobs, progress=self.progress)
        self.publish(mine)
        self.state = "idle"
        self.on_event("cosigned", {"version": mine.version, "leader": theirs.author,
                                   "signers": len(proposal.signers) + 1})
        return RoundReport(mine, time.monotonic() - t0, 0)

    def _claim(self, version: int) -> None:
        """Before signing `version` as its leader: raise Superseded when another coordinator's manifest of it is out."""
        if self.shared and self.proposals(version):
            raise Superseded(f"another coordinator published v{version} first; checking its merge instead")

    def hold(self, leave: threading.Event | None = None) -> int:
        """Before leaving: keep serving the latest checkpoint until the network's `replicas` other peers hold a
        copy of it or `replica_wait_s` passes (or `leave` is set), so pulls still find it once this node is gone.
        Returns the copies seen."""
        if self.current is None:
            return 0
        wanted, wait_s = self.spec.round.copies_wanted(), self.spec.round.copies_wait_s()
        self.state, self.note = "waiting", f"leaving once {wanted} other peer(s) hold v{self.current.version}"
        return wait_for_copies(self.dht, self.current, wanted, wait_s, poll=self.poll, leave=leave)

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
            genesis = genesis_manifest(self.spec, self.identity, base, self.blobs)
            for f in genesis.files:
                self.blobs.add_file(base / f.path)  # a copy: the user may edit their base dir
            self.store.assemble(genesis, self.blobs)
            self.publish(genesis)
            current = genesis
        local = max(mine, key=lambda m: m.version, default=None)
        # a version signed here but not yet by the quorum is no parent: the run loop waits for its other signatures
        unaccepted = self.shared and self.spec.quorum_k() > 1
        if current is None or (local is not None and local.version > current.version and not unaccepted):
            current = local
        assert current is not None
        pull(self.dht, self.spec, current, self.store, self.blobs, progress=self.progress)
        return current

    # ---- one round ----------------------------------------------------------------------------------
    def collect(self, current: CheckpointManifest) -> list[DeltaManifest]:
        """The round's candidate deltas: for the current version and one of the network's skills (each noted in
        `first_seen` the first time it comes back)."""
        deltas = [d for d in self.dht.get_deltas(current.version) if d.skill in self.spec.skills]
        now = time.time()
        for d in deltas:
            self.first_seen.setdefault((d.author, d.blob), now)
        return deltas

    def online_workers(self) -> set[str]:
        """Keys of the workers whose peer record is alive (a stopped worker's deltas stop counting)."""
        return {p.author for p in self.dht.get_peers() if p.role == "worker"}

    def ready(self, deltas: list[DeltaManifest], waited: float) -> bool:
        """The round policy: enough deltas, or the wait is over and there is at least one."""
        policy = self.spec.round
        return len(deltas) >= policy.min_deltas or (waited >= policy.max_wait_s and len(deltas) > 0)

    def history(self, current: CheckpointManifest) -> list[CheckpointManifest]:
        """Trusted manifests of recent versions up to `current` (what reputations and norm bounds read)."""
        depth = max(self.spec.trust.reputation_rounds, self.spec.screen.history_rounds)
        since = max(0, current.version - depth + 1)
        found = {m.version: m for m in self.dht.get_checkpoints(trusted=self.spec.coordinators, since=since,
                                                                        quorum=self.spec.quorum_k())}
        for v in self.store.versions():
            if since <= v <= current.version:
                found.setdefault(v, self.store.manifest(v))
        found[current.version] = current
        return [found[v] for v in sorted(found) if v <= current.version]

    def merge_round(self, current: CheckpointManifest, deltas: list[DeltaManifest], online: set[str] | None = None,
                    earlier: list[Rejection] = ()) -> RoundReport:
        """Screen, merge, evaluate, commit and publish version current+1; `RoundRejected` if nothing passes.
        `earlier`: this round's rejections from attempts that merged nothing (listed in the manifest too)."""
        t0 = time.monotonic()
        self.state = "merging"
        inputs = RoundInputs(spec=self.spec, parent=current, base_dir=self.store.path(current.version),
                             blobs=self.blobs, history=self.history(current), online=online, dht=self.dht,
                             eval_seed=secrets.randbits(63), progress=self.progress,
                             first_seen={(d.author, d.blob): self.first_seen.get((d.author, d.blob), time.time())
                                         for d in deltas})
        state = self.strategy.screen(inputs, [Candidate(d) for d in sorted(deltas, key=lambda d: d.blob)])
        staging = self.store.staging()
        try:
            out = staging / "ckpt"
            if state.candidates:
                failpoints.hit("coordinator.before_merge")
                result, state = self.strategy.merge_guarded(inputs, state, out, staging / "merged.safetensors",
                                                            **self.merge_options.kwargs())
                failpoints.hit("coordinator.after_merge")
            accepted = state.candidates  # what the last merge holds
            now = {r.rejection.blob for r in state.rejected}
            rejected = [r for r in earlier if r.blob not in now] + [r.rejection for r in state.rejected]
            # a rejected blob is never merged: do not keep it (nor let it fill the disk)
            self._remove_blobs({r.candidate.manifest.blob for r in state.rejected}
                               - {c.manifest.blob for c in accepted}, current)
            if not accepted:
                raise RoundRejected(current.version, rejected, inputs.eval_seed)
            self.state = "evaluating"
            metrics = self.strategy.evaluate(out, list(self.spec.skills), self.eval_n)
            delta_sha = self.blobs.add_file(staging / "merged.safetensors", move=True)
            manifest = fit_manifest(CheckpointManifest(
                network=self.spec.network, version=current.version + 1, parent_version=current.version,
                parent_hash=current.weights_hash, weights_hash=result.weights_hash,
                files=with_trees(result.files, out, self.blobs),
                merged_delta=FileEntry(path="merged_delta.safetensors", sha256=delta_sha, size=self.blobs.size(delta_sha),
                                       tree=self.blobs.tree(delta_sha)),
                method=self.spec.merge.method, aggregator=self.spec.merge.aggregator,
                params=merge_params(state.merge_policy or self.spec.merge, current.version),
                included=[c.to_ref() for c in accepted],
                rejected=rejected[:128], omitted=state.omitted + max(0, len(rejected) - 128),
                eval_seed=inputs.eval_seed,
                metrics=metrics,
            ), self.identity)
            self._claim(manifest.version)
            self.store.commit(manifest, out, verify=False)  # the merge computed the hashes it wrote
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        failpoints.hit("coordinator.after_commit")
        self.publish(manifest)
        self._drop_old_deltas(manifest.version)
        self.state = "idle"
        report = RoundReport(manifest, time.monotonic() - t0, len(accepted) + len(rejected), rejected,
                             dict(state.seconds))
        self.on_event("merged", {"version": manifest.version, "included": len(accepted), "rejected": len(rejected),
                                 "metrics": {k: v.accuracy for k, v in metrics.items()}, "seconds": report.seconds,
                                 "lambda": manifest.params.get("lambda")})
        return report

    def skip_round(self, current: CheckpointManifest, rejected: list[Rejection], eval_seed: int | None) -> RoundReport:
        """Publish version current+1 with current's weights: every delta of the round was rejected and no online
        worker has another to send (as a Flower round without results ends with the parameters unchanged). The
        manifest lists the rejections; workers train on from the same weights."""
        t0 = time.monotonic()
        staging = self.store.staging()
        try:
            out = staging / "ckpt"
            out.mkdir()
            for f in current.files:
                link_or_copy(self.store.path(current.version) / f.path, out / f.path)
            manifest = fit_manifest(CheckpointManifest(
                network=self.spec.network, version=current.version + 1, parent_version=current.version,
                parent_hash=current.weights_hash, weights_hash=current.weights_hash,
                files=with_trees(current.files, out, self.blobs), method=self.spec.merge.method,
                aggregator=self.spec.merge.aggregator, params=merge_params(self.spec.merge, current.version),
                rejected=rejected[:128], omitted=max(0, len(rejected) - 128), eval_seed=eval_seed,
                metrics=current.metrics,  # the same weights: the same figures
            ), self.identity)
            self._claim(manifest.version)
            self.store.commit(manifest, out, verify=False)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        self.publish(manifest)
        self.state = "idle"
        log.info("round v%d ended with the weights unchanged: all %d delta(s) rejected", current.version, len(rejected))
        self.on_event("merged", {"version": manifest.version, "included": 0, "rejected": len(rejected),
                                 "metrics": {k: v.accuracy for k, v in manifest.metrics.items()}, "seconds": 0.0})
        return RoundReport(manifest, time.monotonic() - t0, len(rejected), rejected, {})

    def run(self, stop: threading.Event | None = None, max_rounds: int | None = None) -> list[RoundReport]:
        """Merge rounds until `stop` is set or `max_rounds` merges are done. Survives any error of one attempt (the
        module docstring): it is logged, shown in `net status`, and backed off."""
        stop = stop or threading.Event()
        current = self.current = self.recover()
        reports: list[RoundReport] = []
        round_start, seen, tried, backoff = time.monotonic(), -1, set(), self.poll
        tried_by: set[str] = set()  # authors of this round's tried deltas
        earlier: list[Rejection] = []
        while not stop.is_set() and (max_rounds is None or len(reports) < max_rounds):
            fresh: list[DeltaManifest] = []
            try:
                if self.state != "waiting":
                    self.state = "idle"
                newest = find_checkpoint(self.dht, self.spec)
                if newest is not None and newest.version > current.version:  # another coordinator moved on
                    if (lost := self.signed(newest.version)) is not None and body_digest(lost) != body_digest(newest):
                        self.dht.forget(lost)  # the network accepted another manifest of that version
                        log.warning("v%d: the network accepted another coordinator's manifest; dropping this node's",
                                    newest.version)
                    pull(self.dht, self.spec, newest, self.store, self.blobs, progress=self.progress)
                    share(self.dht, self.store, self.blobs, newest)
                    current, round_start, backoff = newest, time.monotonic(), self.poll
                    self.current = current
                    tried, tried_by, earlier = set(), set(), []
                    self.first_seen.clear()
                if self.shared:
                    nxt, k = current.version + 1, self.spec.quorum_k()
                    if (mine := self.signed(nxt)) is not None:  # signed: wait for the quorum's other signatures
                        signers = next((len(e.signers) for e in self.dht.checkpoint_endorsements(
                            nxt, trusted=self.spec.coordinators) if e.digest == body_digest(mine)), 1)
                        self._wait(f"v{nxt}: signed by {signers} of the {k} coordinator(s) it needs")
                        stop.wait(self.poll)
                        continue
                    if proposals := self.proposals(nxt):
                        if (cosigned := self.cosign(current, proposals[0])) is not None:
                            reports.append(cosigned)
                        continue
                    leader = self.leader(current, time.monotonic() - round_start)
                    if leader != self.identity.public_key_hex:
                        self._wait(f"round v{current.version}: led by {fingerprint(leader) if leader else 'nobody online'}; "
                                   "this node checks its merge when it publishes")
                        stop.wait(self.poll)
                        continue
                    if round_order(self.spec.coordinators, current.version)[0] != leader \
                            and current.version not in self.took_over:
                        self.took_over.add(current.version)
                        self.on_event("failover", {"version": current.version})
                online = self.online_workers()
                fresh = [d for d in self.collect(current) if d.blob not in tried and d.author in online]
                if len(fresh) != seen:
                    seen = len(fresh)
                    log.info("round v%d: %d delta(s) so far", current.version, seen)
                    self.on_event("round", {"version": current.version, "deltas": seen})
                waited = time.monotonic() - round_start
                if not self.ready(fresh, waited):
                    if waited >= self.spec.round.max_wait_s and not fresh:
                        self._wait(f"round v{current.version}: no new deltas from online workers after {waited:.0f} s; "
                                   "still waiting")
                    stop.wait(self.poll)
                    continue
                report: RoundReport | None = None
                try:
                    report = self.merge_round(current, fresh, online, earlier)
                except RoundRejected as e:
                    rejected, eval_seed = e.rejected, e.eval_seed
                except Superseded as e:
                    log.info("%s", e)
                    continue
                except SkillswarmError:
                    raise
                except Exception as e:  # noqa: BLE001 - no input may stop the loop (module docstring)
                    log.error("round v%d failed on an unforeseen error; its %d delta(s) count as rejected",
                              current.version, len(fresh), exc_info=True)
                    rejected, eval_seed = earlier + failed_round(fresh, e, {r.blob for r in earlier}), None
                    self._remove_blobs({d.blob for d in fresh}, current)
                if report is None:
                    tried |= {d.blob for d in fresh}
                    tried_by |= {d.author for d in fresh}
                    earlier = rejected
                    if not online <= tried_by:  # an online worker has yet to send its delta: wait for it
                        backoff = min(2 * backoff, self.spec.round.max_backoff_s)
                        self._wait(f"round v{current.version}: all {len(fresh)} new delta(s) rejected; waiting for new "
                                   f"ones (next look in {backoff:.0f} s). {rejected[-1].reason if rejected else ''}")
                        stop.wait(backoff)
                        continue
                    report = self.skip_round(current, rejected, eval_seed)
            except SkillswarmError as e:
                backoff = min(2 * backoff, self.spec.round.max_backoff_s)
                self._wait(f"round v{current.version} failed: {e}; retrying in {backoff:.0f} s")
                log.error("round v%d failed: %s", current.version, e)
                stop.wait(backoff)
                continue
            except Exception as e:  # noqa: BLE001 - a bug outside a round's deltas: retried, never a crash loop
                backoff = min(2 * backoff, self.spec.round.max_backoff_s)
                self._wait(f"round v{current.version} failed: {type(e).__name__}: {str(e)[:160]}; retrying in "
                           f"{backoff:.0f} s")
                log.error("round v%d failed", current.version, exc_info=True)
                stop.wait(backoff)
                continue
            reports.append(report)
            if self.shared and self.spec.quorum_k() > 1:
                continue  # signed, not yet accepted: the loop waits for the quorum, then moves on with the network
            current, round_start, seen, backoff = report.manifest, time.monotonic(), -1, self.poll
            self.current = current
            tried, tried_by, earlier = set(), set(), []
            self.first_seen.clear()
            self.note = ""
        return reports

    def _remove_blobs(self, blobs: set[str], current: CheckpointManifest) -> None:
        """Delete rejected deltas' blobs, except one a kept version merged (a copy re-signed by another key names
        the same blob, and `--verify` needs the original)."""
        merged = {ref.blob for v in self.store.versions() if v >= current.version - KEEP_DELTA_ROUNDS
                  for ref in self.store.manifest(v).included}
        for blob in blobs - merged:
            self.blobs.remove(blob)

    def _drop_old_deltas(self, version: int) -> None:
        """Delete (and stop serving) the deltas merged into version - KEEP_DELTA_ROUNDS: the blob store holds a
        bounded window of rounds, whatever the network's age."""
        old = version - KEEP_DELTA_ROUNDS
        if old >= 1 and self.store.has(old):
            for ref in self.store.manifest(old).included:
                self.dht.unprovide(ref.blob)
                self.blobs.remove(ref.blob)

    def _wait(self, note: str) -> None:
        note = short_reason(note)  # it may quote a hostile input, and the heartbeat carries it: one line, capped
        if note != self.note:
            log.info("%s", note)
            self.on_event("waiting", {"note": note})
        self.state, self.note = "waiting", note
