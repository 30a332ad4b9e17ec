"""The worker role: join, pull the latest trusted checkpoint, train a round of GRPO on one skill shard,
publish the delta (signed DeltaManifest + a blob it serves), wait for the next checkpoint, repeat.

A worker's progress lives in a small state file beside its checkpoints, so a restarted worker
re-announces a delta it already published instead of training the round again, and resumes an
interrupted training run from its last run checkpoint.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from skillswarm.node.checkpoints.pull import pull, share, wait_for_checkpoint
from skillswarm.node.rl.config import TrainConfig, WorkerSettings
from skillswarm.node.checkpoints.store import CheckpointStore, round_dir
from skillswarm.protocol.atomic import atomic_write_text
from skillswarm.protocol.codec import decode_record, encode_record
from skillswarm.protocol.errors import RecordError, SkillswarmError, SpecError
from skillswarm.protocol.hardware import probe_hardware
from skillswarm.protocol.identity import Identity
from skillswarm.protocol.records import CheckpointManifest, DeltaManifest, NetworkSpec, SkillStats, TrainStats
from skillswarm.protocol.transport.blobs import BlobStore
from skillswarm.skills.registry import check_network, skill_names

log = logging.getLogger(__name__)

DELTA_TTL = 24 * 3600.0
STATS_TTL = 300.0
# A round evaluates only before and after training: the two figures its delta manifest carries.
ROUND_EVAL_EVERY = 0
# A run checkpoint every 10 steps of a round, so a restarted worker loses little of it.
ROUND_SAVE_EVERY = 10
ROUND_RETRY_S = 5.0  # pause after a failed round; it doubles while rounds keep failing, up to RoundPolicy.max_backoff_s


@dataclass
class WorkerOptions:
    """This worker's shard, how it trains on it (the rest comes from the network's round policy), and whether it
    shows progress bars."""

    skill: str
    settings: WorkerSettings = field(default_factory=WorkerSettings)
    progress: bool = False


class Worker:
    """One worker on one skill of one network; `run()` loops over rounds until `stop` or `max_rounds`."""

    def __init__(self, spec: NetworkSpec, identity: Identity, dht, store: CheckpointStore, blobs: BlobStore,
                 options: WorkerOptions, on_event: Callable[[str, dict], None] | None = None) -> None:
        if options.skill not in spec.skills:
            raise SpecError(f"skill `{options.skill}` is not one of network {spec.network}'s skills "
                            f"({', '.join(spec.skills)}); pick one of those")
        check_network(spec, [options.skill])  # the shard's plugin must be the version the network pins
        self.spec, self.identity, self.dht, self.store, self.blobs, self.opt = spec, identity, dht, store, blobs, options
        self.on_event = on_event or (lambda kind, data: None)
        self.state = "starting"
        self.version: int | None = None
        self._state_file = store.root / f"worker-{options.skill}.json"
        self._stats: TrainStats | None = None
        self._last_stats_put = 0.0

    # ---- announcements ------------------------------------------------------------------------------
    def start_heartbeat(self, interval: float = 10.0) -> None:
        """Announce this worker (role, skill, engine, hardware, version, state) until the DHT stops."""
        hardware = probe_hardware()
        self.dht.start_heartbeat(
            lambda: self.dht.make_peer_record(role="worker", skills=[self.opt.skill], engine=self.opt.settings.engine,
                                              hardware=hardware, checkpoint_version=self.version, state=self.state),
            interval=interval, ttl=3 * interval)

    def _put_stats(self, stats: TrainStats, force: bool = False) -> None:
        if self.version is None or (not force and time.monotonic() - self._last_stats_put < 10.0):
            return
        self._last_stats_put = time.monotonic()
        self.dht.put(SkillStats(network=self.spec.network, skill=self.opt.skill, checkpoint_version=self.version,
                                stats=stats), STATS_TTL)

    # ---- local state --------------------------------------------------------------------------------
    def _published(self, version: int) -> DeltaManifest | None:
        """The delta this worker already published for `version` (from its state file), if any."""
        try:
            state = json.loads(self._state_file.read_text())
            manifest = decode_record(bytes.fromhex(state["delta_manifest"]), DeltaManifest)
        except (FileNotFoundError, KeyError, ValueError, RecordError):
            return None
        ok = manifest.base_version == version and manifest.author == self.identity.public_key_hex
        return manifest if ok and self.blobs.has(manifest.blob) else None

    def _remember(self, manifest: DeltaManifest) -> None:
        atomic_write_text(self._state_file, json.dumps({"version": manifest.base_version,
                                                        "delta_manifest": encode_record(manifest).hex()}) + "\n")

    # ---- one round ----------------------------------------------------------------------------------
    def publish(self, manifest: DeltaManifest) -> None:
        """Serve the delta's blob and keep its manifest in the DHT."""
        self.dht.provide(manifest.blob, store=self.blobs)
        self.dht.put(manifest, DELTA_TTL, keep=True)
        self.on_event("published", {"version": manifest.base_version, "blob": manifest.blob,
                                    "accuracy_before": manifest.stats.accuracy_before,
                                    "accuracy_after": manifest.stats.accuracy_after})

    def round_seed(self, version: int) -> int:
        """The seed of this worker's round on `version`: new tasks every round (a round that ended with the weights
        unchanged is not replayed), and other tasks than another worker's on the same shard."""
        digest = hashlib.sha256(f"{self.identity.public_key_hex}:{self.opt.skill}:{version}".encode()).digest()
        return int.from_bytes(digest[:4], "big") >> 1

    def round_config(self, current: CheckpointManifest) -> TrainConfig:
        """This worker's training settings for its round on `current`: the network's steps, codec and learning-rate
        schedule (RoundPolicy.lr_decay), this round's seed, the other skills to retain, the node's own settings."""
        s = self.opt.settings
        run_dir = round_dir(self.store.root, self.opt.skill, current.version)
        return TrainConfig(
            model_dir=self.store.path(current.version), skill=self.opt.skill, out_dir=run_dir, resume=run_dir.exists(),
            steps=s.steps_per_round or self.spec.round.steps_per_round, max_minutes=s.minutes_per_round,
            seed=self.round_seed(current.version), eval_every=ROUND_EVAL_EVERY, save_every=ROUND_SAVE_EVERY,
            retain_skills=tuple(k for k in self.spec.skills if k in skill_names()), retain=s.retain,
            lr=s.lr * self.spec.round.lr_factor(current.version), engine=s.engine, lora=s.lora,
            codec="lora" if s.lora else self.spec.codec,  # LoRA: the PEFT adapter itself
            group_size=s.group_size, batch=s.batch, threads=s.threads, eval_n=s.eval_n, report_to=s.report_to)

    def train_round(self, current: CheckpointManifest, stop: threading.Event) -> DeltaManifest | None:
        """Train on the shard from `current`, encode the delta, publish it; None when stopped early."""
        from skillswarm.node.rl.run import train

        self.state = "training"
        cfg = self.round_config(current)
        steps = cfg.steps

        def on_step(metrics: dict) -> None:
            self._put_stats(TrainStats(steps=int(metrics.get("step", 0)), samples=int(metrics.get("samples", 0)),
                                       mean_reward=float(metrics.get("reward", 0.0)), engine=self.opt.settings.engine,
                                       lora=self.opt.settings.lora))

        result = train(cfg, progress=self.opt.progress, on_step=on_step, stop=stop)
        if stop.is_set() and result.stats.steps < steps:
            return None
        self.state = "publishing"
        info = result.delta  # encoded by the run against base_dir, whose hash is current.weights_hash (verified)
        sha = self.blobs.add_file(info.path, move=True)
        manifest = self.identity.sign_record(DeltaManifest(
            network=self.spec.network, skill=self.opt.skill, base_version=current.version,
            base_hash=current.weights_hash, blob=sha, size=info.size, codec=info.codec,
            codec_params=dict(info.params), norm=info.norm, num_tensors=info.num_tensors, stats=result.stats,
            tree=self.blobs.tree(sha)))
        self._remember(manifest)
        self.publish(manifest)
        self._put_stats(result.stats, force=True)
        log.info("published delta for v%d (%s, accuracy %s -> %s)", current.version, sha[:12],
                 result.stats.accuracy_before, result.stats.accuracy_after)
        return manifest

    def run(self, stop: threading.Event | None = None, max_rounds: int | None = None,
            wait_timeout: float | None = None) -> int:
        """Rounds until `stop` is set, `max_rounds` deltas are published (then it waits for, and pulls, the
        checkpoint that merges the last one, serving its delta meanwhile), or no new checkpoint comes within
        `wait_timeout` seconds; returns the number of rounds it contributed to. A round that raises (unless `stop`
        was set meanwhile) is logged with its reason and tried again after a pause."""
        stop = stop or threading.Event()
        self.store.clean_staging()
        published, newer_than, failures = 0, -1, 0
        last: DeltaManifest | None = None
        while not stop.is_set():
            current: CheckpointManifest | None = None
            try:
                self.state = "idle"
                current = wait_for_checkpoint(self.dht, self.spec, newer_than=newer_than, timeout=wait_timeout,
                                              stop=stop)
                if current is None:
                    break
                self.state = "pulling"
                pull(self.dht, self.spec, current, self.store, self.blobs, progress=self.opt.progress)
                share(self.dht, self.store, self.blobs, current)
                self.version = current.version
                self.on_event("pulled", {"version": current.version})
                if last is not None and last.base_version < current.version:
                    self.dht.forget(last)  # its round is over: stop re-storing it (it expires on its own)
                    last = None
                if max_rounds is not None and published >= max_rounds:
                    break
                done = self._published(current.version)
                if done is not None:
                    log.info("already published a delta for v%d; announcing it again", current.version)
                    self.publish(done)
                    last = done
                elif (last := self.train_round(current, stop)) is None:
                    break
            except Exception as e:
                if stop.is_set():  # the user stopped the worker while the round ran: not a failure to retry
                    raise
                # a bad checkpoint or blob from a peer, a network or training error: this round attempt is lost,
                # not the worker; after a pause (doubling while rounds keep failing) it looks for a checkpoint again
                failures += 1
                pause = min(ROUND_RETRY_S * 2 ** min(failures - 1, 20), self.spec.round.max_backoff_s)
                where = f"v{current.version}" if current is not None else "waiting for a checkpoint"
                reason = f"{type(e).__name__}: {e}"
                log.warning("round %s failed (%s); retrying in %.0f s", where, reason, pause,
                            exc_info=not isinstance(e, SkillswarmError))
                self.state = "idle"
                self.on_event("round_failed", {"version": current.version if current is not None else None,
                                               "error": reason, "retry_in": pause})
                stop.wait(pause)
                continue
            failures = 0
            published += 1
            newer_than = current.version
        self.state = "idle"
        return published
