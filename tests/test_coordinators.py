"""Three coordinator processes, a quorum of two: the round's leader is killed mid-round (SIGKILL at a failpoint),
the next coordinator in the round's order runs the round once the dead leader's heartbeat expires, the third
recomputes its merge and co-signs, and the version is accepted with their two signatures: one checkpoint, no fork.
`net status` shows the quorum, the signatures and the failover."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from skillswarm.node.roles.leadership import round_order
from skillswarm.protocol.hashing import weights_hash
from skillswarm.protocol.identity import Identity, fingerprint
from skillswarm.protocol.netspec import load_spec
from skillswarm.protocol.transport.blobs import BlobStore
from skillswarm.protocol.transport.dht import SwarmDHT
from skillswarm.protocol.transport.validation import StorePolicy
from tests.conftest import run_cli
from tests.net_helpers import offer_delta, start_coordinator, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def test_a_killed_leaders_round_is_finished_by_another_coordinator(nano_model: Path, tmp_path: Path) -> None:
    keys = [tmp_path / f"c{i}.key" for i in range(3)]
    ids = [Identity.load_or_create(k) for k in keys]
    spec_file = tmp_path / "net.toml"
    run_cli("net", "init", "--name", "trio", "--model", str(nano_model), "--skill", "arith", "--min-deltas", "1",
            "--codec", "dense_fp32", "--screen-eval-n", "0", "--replicas", "0", "--quorum", "2",
            *[a for i in ids for a in ("--coordinator", i.public_key_hex)], "--key", str(keys[0]),
            "--out", str(spec_file))
    spec = load_spec(spec_file)
    assert spec.quorum_k() == 2
    order = round_order(spec.coordinators, 0)  # who leads the round on v0, then who takes over
    by_key = {i.public_key_hex: k for i, k in zip(ids, keys)}
    leader, second, third = order

    blobs = BlobStore(tmp_path / "worker-blobs")
    procs: dict[str, subprocess.Popen] = {}
    with SwarmDHT("trio", Identity.generate(), policy=StorePolicy.from_spec(spec)) as dht:  # bootstrap + a worker
        maddr = dht.visible_maddrs()[0]
        dht.serve_blobs(blobs)
        dht.start_heartbeat(lambda: dht.make_peer_record(role="worker", skills=["arith"]))
        sha = offer_delta(dht, blobs, "trio", spec.base_hash, nano_model, tmp_path)
        try:
            procs[leader] = start_coordinator(spec_file, maddr, by_key[leader], tmp_path / "h-lead", "coordinator.before_merge")
            for c in (second, third):
                procs[c] = start_coordinator(spec_file, maddr, by_key[c], tmp_path / f"h-{c[:8]}")
            # every coordinator signs the same genesis: v0 is accepted with the quorum
            wait_for(lambda: dht.get_checkpoint(0, trusted=spec.coordinators, quorum=2), 180, "v0 signed by two")
            assert procs[leader].wait(240) == -9, "the leader was not killed mid-round:\n" + procs[leader].stdout.read()
            v1 = wait_for(lambda: dht.get_checkpoint(1, trusted=spec.coordinators, quorum=2), 240,
                          "v1 run by the next coordinator and co-signed", poll=1.0)
            [body] = dht.checkpoint_endorsements(1, trusted=spec.coordinators)  # one checkpoint of v1, no fork
            assert set(body.signers) == {second, third} and body.manifest.author == second
            assert [d.blob for d in v1.included] == [sha] and v1.weights_hash != spec.base_hash

            status = json.loads(run_cli("net", "status", "--network", str(spec_file), "--peers", maddr, "--json",
                                        timeout=120).stdout)
            assert status["quorum"] == 2 and 1 in status["failovers"]
            signed = {s["version"]: s for s in status["signatures"] if s["accepted"]}
            assert sorted(signed[1]["signers"]) == sorted([fingerprint(second), fingerprint(third)])

            pulled = run_cli("pull", "--network", str(spec_file), "--peers", maddr, "--version", "1", "--out",
                             str(tmp_path / "pulled"), "--json", timeout=180, env={"SKILLSWARM_HOME": str(tmp_path / "h-p")})
            assert json.loads(pulled.stdout)["version"] == 1 and weights_hash(tmp_path / "pulled") == v1.weights_hash
        finally:
            for p in procs.values():
                if p.poll() is None:
                    p.terminate()
            for name, p in procs.items():
                try:
                    p.wait(90)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait(10)
    outs = {c: p.stdout.read() for c, p in procs.items()}
    assert "this node runs it" in outs[second], outs[second][-3000:]
    assert "co-signed" in outs[third], outs[third][-3000:]
