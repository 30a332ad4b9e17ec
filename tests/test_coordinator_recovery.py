"""A coordinator killed mid-round (SIGKILL at a failpoint) restarts without leaving a partial checkpoint
and without publishing a version twice; a restarted worker re-announces its delta instead of retraining."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from skillswarm.node.checkpoints.store import CheckpointStore
from skillswarm.protocol.transport.blobs import BlobStore
from skillswarm.protocol.transport.dht import SwarmDHT
from skillswarm.protocol.identity import Identity
from skillswarm.protocol.netspec import load_spec
from skillswarm.protocol.transport.validation import StorePolicy
from tests.conftest import run_cli
from tests.net_helpers import offer_delta, start_coordinator, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]


def test_killed_coordinator_restarts_cleanly(nano_model: Path, tmp_path: Path) -> None:
    key = tmp_path / "coord.key"
    spec_file = tmp_path / "net.toml"
    run_cli("net", "init", "--name", "rec", "--model", str(nano_model), "--skill", "arith", "--min-deltas", "1",
            "--codec", "dense_fp32", "--screen-eval-n", "0", "--replicas", "0", "--key", str(key),
            "--out", str(spec_file))
    spec = load_spec(spec_file)
    coord_id = Identity.load(key)
    home = tmp_path / "h-coord"
    store = CheckpointStore("rec", home / "cache" / "networks" / "rec")

    worker_blobs = BlobStore(tmp_path / "worker-blobs")
    with SwarmDHT("rec", Identity.generate(), policy=StorePolicy.from_spec(spec)) as dht:  # bootstrap + a worker
        maddr = dht.visible_maddrs()[0]
        dht.serve_blobs(worker_blobs)
        dht.start_heartbeat(lambda: dht.make_peer_record(role="worker", skills=["arith"]))  # only online workers count
        sha = offer_delta(dht, worker_blobs, "rec", spec.base_hash, nano_model, tmp_path)

        def published(version: int):
            return dht.get_checkpoint(version, trusted=spec.coordinators)

        # 1. Killed after the merge, before committing: debris only in staging, nothing published.
        p = start_coordinator(spec_file, maddr, key, home, "coordinator.after_merge")
        assert p.wait(240) == -9, p.stdout.read()
        assert list(store.dir.glob(".staging-*")) and not store.has(1) and published(1) is None

        # 2. Killed after committing v1, before publishing it.
        p = start_coordinator(spec_file, maddr, key, home, "coordinator.after_commit")
        assert p.wait(240) == -9, p.stdout.read()
        assert store.has(1) and not list(store.dir.glob(".staging-*")) and published(1) is None
        committed = store.manifest(1)

        # 3. A clean restart publishes the committed v1 as it was signed, and merges nothing again.
        p = start_coordinator(spec_file, maddr, key, home, None)
        try:
            seen = wait_for(lambda: published(1), 120, "v1 on the network", poll=0.5)
            time.sleep(3)  # give it time to (wrongly) merge the same deltas again
            assert seen == committed and seen.author == coord_id.public_key_hex
            assert published(2) is None and store.versions() == [0, 1]
        finally:
            p.terminate()
            assert p.wait(60) == 0, p.stdout.read()
        assert sorted(d.blob for d in committed.included) == [sha]
