"""Replication before anyone leaves: a coordinator keeps serving its latest checkpoint until the network's `replicas`
other peers hold a verified copy (or `replica_wait_s` passes), so the checkpoint stays pullable once it is gone."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import time
from pathlib import Path
from types import SimpleNamespace

import msgspec
import pytest

from skillswarm.node.checkpoints.pull import copy_holders, pull, share, wait_for_copies
from skillswarm.node.checkpoints.store import CheckpointStore
from skillswarm.protocol.codec import encode_record
from skillswarm.protocol.hashing import weights_hash
from skillswarm.protocol.identity import Identity
from skillswarm.protocol.netspec import load_spec, new_network
from skillswarm.protocol.records import (
    DEFAULT_REPLICA_WAIT_S, DEFAULT_REPLICAS, CheckpointManifest, FileEntry, RoundPolicy,
)
from skillswarm.protocol.transport.blobs import BlobStore
from skillswarm.protocol.transport.dht import SwarmDHT
from skillswarm.protocol.transport.validation import StorePolicy
from tests.conftest import ROOT, SKILLSWARM, run_cli
from tests.net_helpers import offer_delta, wait_for

V3 = CheckpointManifest(network="rep", version=3, parent_version=2, parent_hash="1" * 64, weights_hash="2" * 64,
                        files=[FileEntry(path="config.json", sha256="3" * 64, size=10),
                               FileEntry(path="model.safetensors", sha256="4" * 64, size=1000)])


class _Network:
    """A DHT stand-in: who announces each blob, and which of them say they hold all of it."""

    def __init__(self, providers: dict[str, list[str]], whole: dict[str, list[str]]) -> None:
        self.providers, self.whole = providers, whole

    def get_providers(self, sha: str, *, limit: int | None = None) -> list[SimpleNamespace]:
        return [SimpleNamespace(peer_id=p) for p in self.providers.get(sha, [])]

    def holders(self, sha: str, size: int, providers: list[SimpleNamespace]) -> list[str]:
        return [p.peer_id for p in providers if p.peer_id in self.whole.get(sha, [])]


def test_wait_ends_at_its_deadline_when_nobody_copies(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="skillswarm.node.checkpoints.pull")
    started = time.monotonic()
    assert wait_for_copies(_Network({}, {}), V3, 2, 0.6, poll=0.1) == 0
    assert 0.6 <= time.monotonic() - started < 5
    lines = [r.getMessage() for r in caplog.records]
    assert "v3: only 0 of 2 copies after 0.6 s; leaving" in lines, lines


def test_a_copy_counts_only_when_it_holds_every_file() -> None:
    # a holds both files; b only the config (its model download has just begun); c announces and is gone
    net = _Network({"3" * 64: ["a", "b", "c"], "4" * 64: ["a", "b", "c"]}, {"3" * 64: ["a", "b"], "4" * 64: ["a"]})
    assert copy_holders(net, V3) == {"a"}  # type: ignore[arg-type]
    assert wait_for_copies(net, V3, 1, 30, poll=0.1) == 1  # type: ignore[arg-type]
    started = time.monotonic()
    assert wait_for_copies(net, V3, 2, 0.3, poll=0.1) == 1  # type: ignore[arg-type]
    assert time.monotonic() - started < 5
    assert wait_for_copies(net, V3, 0, 30) == 0  # type: ignore[arg-type]


def test_replicas_setting_keeps_older_files_as_they_were() -> None:
    assert RoundPolicy().copies_wanted() == DEFAULT_REPLICAS == 2
    assert RoundPolicy().copies_wait_s() == DEFAULT_REPLICA_WAIT_S == 600
    assert b"replica" not in msgspec.msgpack.encode(RoundPolicy())  # an older file's bytes, and signature, unchanged
    spec = new_network("rep", "base", "0" * 64, ["arith"], ["a" * 64], replicas=1, replica_wait_s=30)
    assert spec.round.copies_wanted() == 1 and spec.round.copies_wait_s() == 30
    assert b"replicas" in encode_record(spec)
    assert RoundPolicy(replicas=0).copies_wanted() == 0


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_checkpoint_stays_pullable_after_its_coordinator_leaves(nano_model: Path, tmp_path: Path) -> None:
    """`coordinator run --rounds 1` with replicas=1: it merges v1 and keeps serving it until another peer holds a
    copy; then it exits, and a fresh `pull` gets v1 from that peer alone."""

    key, spec_file = tmp_path / "coord.key", tmp_path / "net.toml"
    run_cli("net", "init", "--name", "rep", "--model", str(nano_model), "--skill", "arith", "--min-deltas", "1",
            "--codec", "dense_fp32", "--screen-eval-n", "0", "--replicas", "1", "--replica-wait", "300",
            "--key", str(key), "--out", str(spec_file))
    spec = load_spec(spec_file)
    assert spec.round.copies_wanted() == 1
    blobs, store = BlobStore(tmp_path / "peer-blobs"), CheckpointStore("rep", tmp_path / "peer-ckpts")
    # the bootstrap, a worker that sent a delta, and later the one other holder of v1
    with SwarmDHT("rep", Identity.generate(), policy=StorePolicy.from_spec(spec)) as dht:
        maddr = dht.visible_maddrs()[0]
        dht.serve_blobs(blobs)
        dht.start_heartbeat(lambda: dht.make_peer_record(role="worker", skills=["arith"]))
        offer_delta(dht, blobs, "rep", spec.base_hash, nano_model, tmp_path)

        env = {**os.environ, "SKILLSWARM_HOME": str(tmp_path / "h-coord"), "COLUMNS": "200"}
        env.pop("SKILLSWARM_FAILPOINT", None)
        coordinator = subprocess.Popen(
            [str(SKILLSWARM), "coordinator", "run", "--network", str(spec_file), "--peers", maddr, "--host", "127.0.0.1",
             "--key", str(key), "--eval-n", "4", "--rounds", "1"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT, env=env)
        try:
            v1 = wait_for(lambda: dht.get_checkpoint(1, trusted=spec.coordinators), 240, "v1 on the network", poll=0.5)
            time.sleep(5)
            assert coordinator.poll() is None, "the coordinator left while it was the only holder of v1:\n" + \
                coordinator.stdout.read()[-3000:]
            pull(dht, spec, v1, store, blobs, progress=False)  # a worker's pull: it serves what it holds
            share(dht, store, blobs, v1)
            assert coordinator.wait(120) == 0
            out = coordinator.stdout.read()
            assert "v1 held by 1 other peer" in out and "stopped after 1 merge(s)" in out, out[-3000:]
        finally:
            if coordinator.poll() is None:
                coordinator.kill()
                coordinator.wait(10)

        pulled = run_cli("pull", "--network", str(spec_file), "--peers", maddr, "--out", str(tmp_path / "pulled"),
                         "--json", timeout=180, env={"SKILLSWARM_HOME": str(tmp_path / "h-puller")})
        assert json.loads(pulled.stdout)["version"] == 1
        assert weights_hash(tmp_path / "pulled") == v1.weights_hash != spec.base_hash
