"""A coordinator's round on real peers (127.0.0.1): only online workers' deltas count, an empty round says
so in `net status`, and a round whose deltas are all rejected backs off, deletes their blobs, does not
retry them, and lists them in the manifest of the round that finally merges. No delta stops the coordinator: a
crafted file is rejected with its reason, and an error no step foresaw fails only that round's attempt."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Iterator

import msgspec
import pytest
import torch
from safetensors.torch import load_file

from skillswarm.merge.deltas import encode_delta
from skillswarm.node.roles.coordinator import Coordinator
from skillswarm.node.checkpoints.store import CheckpointStore
from skillswarm.protocol.transport.blobs import BlobStore
from skillswarm.protocol.transport.dht import SwarmDHT
from skillswarm.protocol.hashing import weights_hash
from skillswarm.protocol.identity import Identity
from skillswarm.protocol.netspec import save_spec
from skillswarm.protocol.records import CheckpointManifest, DeltaManifest, NetworkSpec, RoundPolicy, ScreenPolicy
from skillswarm.protocol.transport.validation import StorePolicy
from tests.conftest import run_cli
from tests.net_helpers import wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
NET = "rounds"


class Swarm:
    """A bootstrap, a running coordinator (in a thread) and helpers to publish deltas as workers."""

    def __init__(self, base: Path, tmp: Path) -> None:
        self.base, self.tmp = base, tmp
        self.coord_id = Identity.generate()
        self.spec = self.coord_id.sign_record(NetworkSpec(
            network=NET, base_model=str(base), base_hash=weights_hash(base), skills=["reverse", "sort"],
            coordinators=[self.coord_id.public_key_hex], codec="dense_fp32",
            round=RoundPolicy(min_deltas=1, max_wait_s=1.0, max_backoff_s=2.0), screen=ScreenPolicy(eval_n=0)))
        self.spec_file = save_spec(self.spec, tmp / "net.toml")
        self.policy = StorePolicy.from_spec(self.spec)
        self.peers: list[SwarmDHT] = []
        self.boot = self.peer(Identity.generate())
        self.maddr = self.boot.visible_maddrs()[0]
        self.dht = self.peer(self.coord_id)
        self.blobs = BlobStore(tmp / "coord-blobs")
        self.dht.serve_blobs(self.blobs)
        self.coordinator = Coordinator(self.spec, self.coord_id, self.dht, CheckpointStore(NET, tmp / "coord"),
                                       self.blobs, eval_n=4, poll=0.3)
        self.dht.start_heartbeat(lambda: self.dht.make_peer_record(role="coordinator", state=self.coordinator.state,
                                                                   note=self.coordinator.note), interval=1.0, ttl=3.0)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.coordinator.run, args=(self.stop, 1), daemon=True)
        self.thread.start()

    def peer(self, identity: Identity) -> SwarmDHT:
        dht = SwarmDHT(NET, identity, initial_peers=[self.maddr] if self.peers else (), policy=self.policy).start()
        self.peers.append(dht)
        return dht

    def worker(self, online: bool) -> SwarmDHT:
        dht = self.peer(Identity.generate())
        dht.serve_blobs(BlobStore(self.tmp / f"w-{dht.identity.peer_id[:8]}"))
        if online:
            dht.start_heartbeat(lambda: dht.make_peer_record(role="worker", skills=["sort"]), interval=1.0, ttl=3.0)
        return dht

    def publish(self, worker: SwarmDHT, seed: int, **lie: float) -> DeltaManifest:
        g = torch.Generator().manual_seed(seed)
        base = load_file(str(self.base / "model.safetensors"))
        values = {k: torch.randn(v.shape, generator=g) * 1e-3 for k, v in base.items() if v.is_floating_point()}
        info = encode_delta(values, self.tmp / f"d{seed}.safetensors", "dense_fp32", base_hash=self.spec.base_hash,
                            skill="sort")
        return self.publish_file(worker, info.path, lie.get("norm", info.norm), info.num_tensors)

    def publish_file(self, worker: SwarmDHT, path: Path, norm: float, num_tensors: int) -> DeltaManifest:
        """Serve the delta file at `path` from `worker` and put its manifest (for the nano base, skill sort)."""
        store = BlobStore(self.tmp / f"w-{worker.identity.peer_id[:8]}")
        size = path.stat().st_size
        sha = store.add_file(path, move=True)
        worker.provide(sha, store=store)
        manifest = DeltaManifest(network=NET, skill="sort", base_version=0, base_hash=self.spec.base_hash, blob=sha,
                                 size=size, codec="dense_fp32", norm=norm, num_tensors=num_tensors)
        assert worker.put(manifest, 600, keep=True)
        return manifest

    def close(self) -> None:
        self.stop.set()
        self.thread.join(60)
        for dht in reversed(self.peers):
            dht.shutdown()


@pytest.fixture
def swarm(nano_model: Path, tmp_path: Path) -> Iterator[Swarm]:
    s = Swarm(nano_model, tmp_path)
    try:
        yield s
    finally:
        s.close()


def test_only_online_workers_count_and_an_empty_round_says_so(swarm: Swarm) -> None:
    ghost = swarm.worker(online=False)
    swarm.publish(ghost, seed=1)  # a manifest whose worker is gone (no live peer record)
    wait_for(lambda: "no new deltas from online workers" in swarm.coordinator.note, 60, "the empty-round note")
    status = json.loads(run_cli("net", "status", "--network", str(swarm.spec_file), "--peers", swarm.maddr, "--json",
                                timeout=120).stdout)
    (coord,) = status["coordinators"]
    assert coord["state"] == "waiting" and "no new deltas from online workers" in coord["note"] and coord["trusted"]

    live = swarm.worker(online=True)
    delta = swarm.publish(live, seed=2)
    swarm.thread.join(120)
    v1 = swarm.coordinator.store.manifest(1)
    assert [d.blob for d in v1.included] == [delta.blob]  # the ghost's delta was never considered
    assert v1.included[0].norm > 0 and v1.eval_seed is not None and swarm.coordinator.note == ""


def test_an_all_rejected_round_backs_off_deletes_its_blobs_and_lists_them_later(swarm: Swarm) -> None:
    calls = []
    real = swarm.coordinator.merge_round
    swarm.coordinator.merge_round = lambda *a, **k: (calls.append(1), real(*a, **k))[1]  # count attempts
    later = swarm.worker(online=True)  # online, still training: the round waits for its delta
    wait_for(lambda: later.identity.public_key_hex in swarm.coordinator.online_workers(), 30, "the worker's record")
    liar = swarm.publish(swarm.worker(online=True), seed=3, norm=123.0)  # the file's norm is ~0.06
    wait_for(lambda: "rejected" in swarm.coordinator.note, 90, "the all-rejected note")
    assert "all 1 new delta(s) rejected" in swarm.coordinator.note and swarm.coordinator.state == "waiting"
    assert not swarm.blobs.has(liar.blob)  # fetched, rejected, deleted
    time.sleep(3)  # backoff passes; the same rejected delta is not tried again
    assert len(calls) == 1 and not swarm.coordinator.store.has(1)

    honest = swarm.publish(later, seed=4)
    swarm.thread.join(120)
    v1 = swarm.coordinator.store.manifest(1)
    assert [d.blob for d in v1.included] == [honest.blob] and len(calls) == 2
    (rej,) = v1.rejected
    assert rej.blob == liar.blob and rej.step == "inspect" and "claims norm 123" in rej.reason


def test_a_round_whose_every_online_worker_was_rejected_ends_with_the_weights_unchanged(swarm: Swarm) -> None:
    """No online worker is left to send a better delta, so the round ends: v1 keeps v0's weights and lists the
    rejection, instead of the network waiting for a delta nobody will send."""
    from skillswarm.node.roles.verification import verify_checkpoint

    liar = swarm.publish(swarm.worker(online=True), seed=5, norm=123.0)
    swarm.thread.join(120)
    assert not swarm.thread.is_alive()
    store = swarm.coordinator.store
    v0, v1 = store.manifest(0), store.manifest(1)
    assert v1.weights_hash == v0.weights_hash == weights_hash(store.path(1)) and v1.parent_version == 0
    assert v1.included == [] and [r.blob for r in v1.rejected] == [liar.blob] and v1.merged_delta is None
    assert v1.metrics == v0.metrics and swarm.coordinator.note == ""
    found = wait_for(lambda: swarm.dht.get_checkpoint(1, trusted=swarm.spec.coordinators), 30, "v1 in the DHT")
    assert found.weights_hash == v0.weights_hash
    check = verify_checkpoint(swarm.spec, swarm.dht, store, swarm.blobs, v1)
    assert check.match and check.merged_delta is None


def _repair_of_v1(swarm: Swarm) -> tuple[CheckpointManifest, object]:
    """v1 as the round merged it (its one delta whole), and the merge of that delta in the model's first layer only
    (a saturated skill's repair), made by the round's recipe."""
    import dataclasses

    from skillswarm.merge import round_merge
    from skillswarm.merge.recipe_params import layer_index
    from skillswarm.node.roles.verification import merge_inputs, policy_from_manifest

    swarm.publish(swarm.worker(online=True), seed=6)
    swarm.thread.join(120)
    store = swarm.coordinator.store
    v1 = store.manifest(1)  # the delta merged whole (this network runs no usefulness test)
    [ref] = v1.included
    assert ref.layers is msgspec.UNSET and "layers" not in ref.figures and v1.merged_delta is not None
    parent_dir, deltas = merge_inputs(swarm.spec, swarm.dht, store, swarm.blobs, v1)
    assert [d.layers for d in deltas] == [None]
    policy, seed = policy_from_manifest(v1)
    out = swarm.tmp / "repair"
    result = round_merge(parent_dir, [dataclasses.replace(d, layers=1) for d in deltas], policy, out, seed=seed,
                         delta_out=swarm.tmp / "repair.safetensors", base_hash=v1.parent_hash)
    merged, parent = load_file(str(out / "model.safetensors")), load_file(str(parent_dir / "model.safetensors"))
    changed = {k for k in parent if not torch.equal(merged[k], parent[k])}
    assert changed and all(layer_index(k) == 0 for k in changed)
    return v1, result


def test_verify_recomputes_a_delta_merged_as_a_repair_of_its_first_layers(swarm: Swarm) -> None:
    """A manifest whose delta entry says `layers` (a saturated skill's repair) is recomputed in those layers only: the
    checkpoint merged that way verifies, and the same entry on the round that merged it whole does not."""
    from skillswarm.node.roles.verification import verify_checkpoint

    v1, result = _repair_of_v1(swarm)
    store = swarm.coordinator.store
    [ref] = v1.included
    as_repair = [msgspec.structs.replace(ref, layers=1)]
    repaired = msgspec.structs.replace(v1, included=as_repair, weights_hash=result.weights_hash,
                                       merged_delta=msgspec.structs.replace(v1.merged_delta, sha256=result.delta.sha256))
    assert verify_checkpoint(swarm.spec, swarm.dht, store, swarm.blobs, repaired).match
    assert verify_checkpoint(swarm.spec, swarm.dht, store, swarm.blobs, v1).match
    assert not verify_checkpoint(swarm.spec, swarm.dht, store, swarm.blobs,
                                 msgspec.structs.replace(v1, included=as_repair)).match
    # a `layers` figure means nothing in a manifest of this protocol: the merge it names is the whole delta's
    as_figure = [msgspec.structs.replace(ref, figures={**ref.figures, "layers": 1.0})]
    assert not verify_checkpoint(swarm.spec, swarm.dht, store, swarm.blobs,
                                 msgspec.structs.replace(repaired, included=as_figure)).match


def test_a_manifest_of_the_previous_protocol_still_verifies(swarm: Swarm) -> None:
    """A checkpoint manifest as a protocol-1 coordinator signed it (a repair's layers in the entry's `layers` figure,
    no `layers` field) decodes, passes its signature check, and `--verify` recomputes its merge in those layers; the
    same manifest taken for protocol 2 names the merge of the whole delta, which is not what it published."""
    from skillswarm.node.roles.verification import verify_checkpoint
    from skillswarm.protocol.codec import decode_record, encode_record
    from skillswarm.protocol.identity import verify_record
    from skillswarm.protocol.records import LAYERS_SINCE_PROTOCOL, LEGACY_LAYERS_FIGURE
    from skillswarm.protocol.version import PROTOCOL_VERSION

    v1, result = _repair_of_v1(swarm)
    store = swarm.coordinator.store
    [ref] = v1.included
    old = LAYERS_SINCE_PROTOCOL - 1
    assert old == 1 and PROTOCOL_VERSION >= LAYERS_SINCE_PROTOCOL
    signed = swarm.coord_id.sign_record(msgspec.structs.replace(
        v1, protocol=old, included=[msgspec.structs.replace(ref, figures={**ref.figures, LEGACY_LAYERS_FIGURE: 1.0})],
        weights_hash=result.weights_hash, merged_delta=msgspec.structs.replace(v1.merged_delta,
                                                                              sha256=result.delta.sha256)))
    data = encode_record(signed)
    # its bytes are protocol 1's: the entry holds no `layers` key of its own, only the figure
    entry = msgspec.msgpack.decode(data)["included"][0]
    assert "layers" not in entry and entry["figures"][LEGACY_LAYERS_FIGURE] == 1.0
    got = decode_record(data, CheckpointManifest)
    verify_record(got, network=NET, trusted=swarm.spec.coordinators)  # re-encoded, its signature still holds
    assert got.protocol == old and got.included[0].layers is msgspec.UNSET
    check = verify_checkpoint(swarm.spec, swarm.dht, store, swarm.blobs, got)
    assert check.match and check.weights_hash == result.weights_hash and check.merged_delta == result.delta.sha256
    assert not verify_checkpoint(swarm.spec, swarm.dht, store, swarm.blobs,
                                 msgspec.structs.replace(got, protocol=PROTOCOL_VERSION)).match


def _crafted(path: Path, shape: list) -> Path:
    """`path`'s safetensors file with its first tensor's header shape replaced by `shape` (JSON's Infinity allowed):
    what a hostile worker can publish, byte for byte."""
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    name = next(k for k in sorted(header) if k != "__metadata__")
    header[name]["shape"] = shape
    text = json.dumps(header).encode()
    out = path.with_name(f"crafted-{path.name}")
    out.write_bytes(len(text).to_bytes(8, "little") + text + raw[8 + n:])
    return out


def test_a_crafted_header_is_rejected_with_its_reason_and_the_round_goes_on(swarm: Swarm) -> None:
    """A delta whose header says `"shape": [Infinity, 8]` (which Python's int() cannot take) is rejected at the file
    checks; the coordinator, whose only online worker sent it, ends the round with the weights unchanged."""
    g = torch.Generator().manual_seed(9)
    base = load_file(str(swarm.base / "model.safetensors"))
    values = {k: torch.randn(v.shape, generator=g) * 1e-3 for k, v in base.items() if v.is_floating_point()}
    info = encode_delta(values, swarm.tmp / "honest-bytes.safetensors", "dense_fp32", base_hash=swarm.spec.base_hash,
                        skill="sort")
    crafted = _crafted(info.path, [float("inf"), 8])
    bad = swarm.publish_file(swarm.worker(online=True), crafted, info.norm, info.num_tensors)
    swarm.thread.join(120)
    store = swarm.coordinator.store
    assert store.has(1), "the coordinator stopped instead of rejecting the crafted delta"
    v1 = store.manifest(1)
    [rej] = v1.rejected
    assert v1.included == [] and rej.blob == bad.blob and rej.step == "inspect", rej
    assert "Infinity" in rej.reason, rej.reason


def test_an_error_no_step_foresaw_fails_the_round_attempt_not_the_coordinator(swarm: Swarm) -> None:
    """Whatever a round step raises, the loop goes on: the attempt's deltas are listed as rejected with the error
    (not held against their keys) and, their worker having sent all it will, the round ends unchanged."""
    from skillswarm.node.roles.rounds import RoundInputs, RoundState, Verdict

    class Broken:
        name = "broken"

        def __call__(self, inputs: RoundInputs, state: RoundState) -> Verdict:
            raise OverflowError("cannot convert float infinity to integer")

    swarm.coordinator.strategy.steps.insert(0, Broken())
    delta = swarm.publish(swarm.worker(online=True), seed=10)
    swarm.thread.join(120)
    store = swarm.coordinator.store
    assert store.has(1), "the coordinator stopped on the step's error"
    v1 = store.manifest(1)
    [rej] = v1.rejected
    assert rej.blob == delta.blob and rej.step == "round" and "OverflowError" in rej.reason
    assert rej.figures["harmful"] == 0.0 and v1.weights_hash == store.manifest(0).weights_hash
