"""SwarmDHT between real hivemind peers on 127.0.0.1: typed records in and out, trust filtering,
heartbeats and expiry, and process hygiene (no DHT process or p2pd outlives its owner)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from typing import Iterator

import msgspec
import psutil
import pytest

from skillswarm.protocol.transport.dht import SwarmDHT
from skillswarm.protocol.codec import encode_record
from skillswarm.protocol.errors import NetworkError, RecordError
from skillswarm.protocol.identity import Identity
from skillswarm.protocol.records import (
    CheckpointManifest, DeltaManifest, FileEntry, NetworkSpec, PeerRecord, Rejection, SkillStats, TrainStats,
)
from tests.conftest import ROOT
from tests.net_helpers import still_running

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]
NET = "typed"


@pytest.fixture(scope="module")
def pair() -> Iterator[tuple[SwarmDHT, SwarmDHT]]:
    a = SwarmDHT(NET, Identity.generate()).start()
    b = SwarmDHT(NET, Identity.generate(), initial_peers=a.visible_maddrs())
    try:
        b.start()
        yield a, b
    finally:
        b.shutdown()
        a.shutdown()


def _checkpoint(version: int) -> CheckpointManifest:
    files = [FileEntry(path="model.safetensors", sha256=f"{version:064x}", size=10)]
    parent = dict(parent_version=version - 1, parent_hash="a" * 64) if version else {}
    return CheckpointManifest(network=NET, version=version, weights_hash="b" * 64, files=files, **parent)


def _dht_processes(dht: SwarmDHT) -> list[psutil.Process]:
    proc = psutil.Process(dht.pid)
    return [proc, *proc.children(recursive=True)]


def test_the_dht_peer_id_is_the_nodes_identity(pair: tuple[SwarmDHT, SwarmDHT]) -> None:
    a, _ = pair
    assert a.peer_id == a.identity.peer_id
    assert all(m.endswith(f"/p2p/{a.identity.peer_id}") for m in a.visible_maddrs())
    assert {p.name() for p in _dht_processes(a)} >= {"p2pd"}


def test_typed_records_round_trip(pair: tuple[SwarmDHT, SwarmDHT]) -> None:
    a, b = pair
    delta = DeltaManifest(network=NET, skill="arith", base_version=7, base_hash="a" * 64, blob="c" * 64, size=123,
                          codec="dense_bf16", norm=2.5, num_tensors=4)
    stats = SkillStats(network=NET, skill="arith", checkpoint_version=7, stats=TrainStats(steps=5, mean_reward=0.5))
    assert b.put(delta, ttl=60) and b.put(stats, ttl=60)
    assert b.announce(b.make_peer_record(role="worker", skills=["arith"], engine="hf"), ttl=60)
    [got_delta] = a.get_deltas(7)
    assert got_delta.author == b.identity.public_key_hex
    assert msgspec.structs.replace(got_delta, author="", created=0.0, signature=b"") == delta
    assert a.get_deltas(8) == []
    [got_stats] = a.get_skill_stats("arith")
    assert got_stats.stats.steps == 5 and a.get_skill_stats("rev") == []
    peers = {p.peer_id: p for p in a.get_peers()}
    assert peers[b.identity.peer_id].skills == ["arith"] and peers[b.identity.peer_id].addrs == b.visible_maddrs()


def test_checkpoints_count_only_when_signed_by_a_trusted_coordinator(pair: tuple[SwarmDHT, SwarmDHT]) -> None:
    a, b = pair
    trusted = [a.identity.public_key_hex]
    for v in (0, 1, 2):
        assert a.put(_checkpoint(v), ttl=120)
    assert b.put(_checkpoint(3), ttl=120)  # a valid signature, but not by a coordinator the network trusts
    assert [c.version for c in b.get_checkpoints(trusted=trusted)] == [0, 1, 2]
    assert b.latest_checkpoint(trusted=trusted).version == 2
    assert b.latest_checkpoint(trusted=None).version == 3
    assert b.get_checkpoint(1, trusted=trusted).files[0].sha256 == f"{1:064x}"
    assert b.get_checkpoint(1, trusted=[b.identity.public_key_hex]) is None
    assert [c.version for c in b.get_checkpoints(trusted=trusted, since=2)] == [2]
    assert b.get_checkpoints(trusted=[]) == []


async def _length_of(_dht: object, _node: object, blob: bytes) -> int:
    return len(blob)


async def _bytes_of(_dht: object, _node: object, n: int) -> bytes:
    return bytes(n)


def test_calls_and_records_of_any_size_leave_the_dht_process_alive(pair: tuple[SwarmDHT, SwarmDHT]) -> None:
    a, b = pair
    for n in (17_000, 64 << 10, 4 << 20):  # over the 16 KiB a pipe message is written in one piece up to
        assert a.run_coroutine(_length_of, blob=bytes(n)) == n
        assert len(a.run_coroutine(_bytes_of, n=n)) == n
    rejected = [Rejection(blob=f"{i:064x}", author=b.identity.public_key_hex, skill="arith", reason="r" * 200,
                          step="usefulness", figures={"gain": 0.01 * i, "harmful": 1.0}) for i in range(100)]
    big = msgspec.structs.replace(_checkpoint(9), rejected=rejected)
    assert len(encode_record(a.identity.sign_record(big))) > 20_000
    for _ in range(8):  # a coordinator re-stores its manifests; each put must leave the peer running
        assert a.put(big, ttl=120)
    [got] = [c for c in b.get_checkpoints(trusted=[a.identity.public_key_hex]) if c.version == 9]
    assert len(got.rejected) == 100 and a.is_running and b.is_running


def test_put_refuses_what_this_node_may_not_publish(pair: tuple[SwarmDHT, SwarmDHT]) -> None:
    a, b = pair
    with pytest.raises(RecordError, match="network `other`"):
        a.put(msgspec.structs.replace(_checkpoint(0), network="other"), ttl=10)
    with pytest.raises(RecordError, match="signed by this node"):
        a.put(b.identity.sign_record(_checkpoint(0)), ttl=10)
    with pytest.raises(RecordError, match="may live"):
        a.put(a.make_peer_record(role="worker"), ttl=86400)
    with pytest.raises(RecordError, match="never through the DHT"):
        a.put(NetworkSpec(network=NET, base_model="m", base_hash="a" * 64, skills=["arith"]), ttl=10)
    with pytest.raises(NetworkError, match="without a network"):
        SwarmDHT(None, a.identity).get_peers()


def test_a_heartbeat_keeps_a_peer_listed_and_it_expires_once_stopped(pair: tuple[SwarmDHT, SwarmDHT]) -> None:
    a, _ = pair
    c = SwarmDHT(NET, Identity.generate(), initial_peers=a.visible_maddrs()).start()
    try:
        c.start_heartbeat(lambda: c.make_peer_record(role="observer"), interval=0.5, ttl=1.5)
        first = _record_of(a, c)
        time.sleep(2.5)  # past the ttl: only renewals keep it listed
        later = _record_of(a, c)
        assert later is not None and later.created > first.created
        c.stop_heartbeat()
        deadline = time.monotonic() + 6
        while _record_of(a, c) is not None:
            assert time.monotonic() < deadline, "a peer that stopped announcing is still listed"
            time.sleep(0.2)
    finally:
        c.shutdown()


def _record_of(reader: SwarmDHT, who: SwarmDHT) -> PeerRecord | None:
    return next((p for p in reader.get_peers() if p.peer_id == who.identity.peer_id), None)


def test_shutdown_ends_the_dht_process_and_p2pd() -> None:
    dht = SwarmDHT(NET, Identity.generate()).start()
    procs = _dht_processes(dht)
    assert [p.name() for p in procs[1:]] == ["p2pd"]
    dht.shutdown()
    assert not still_running(procs, timeout=5)
    assert not dht.is_running
    dht.shutdown()  # idempotent


def test_a_dead_dht_process_is_reported_and_takes_p2pd_with_it() -> None:
    dht = SwarmDHT(NET, Identity.generate()).start()
    try:
        procs = _dht_processes(dht)
        os.kill(dht.pid, signal.SIGKILL)
        assert not still_running(procs[1:], timeout=5), "p2pd outlived its DHT process"
        with pytest.raises(NetworkError, match="stopped"):
            dht.get_peers()
    finally:
        dht.shutdown()


OWNER = """
import json, sys, time, psutil
from skillswarm.protocol.transport.dht import SwarmDHT
from skillswarm.protocol.identity import Identity
dht = SwarmDHT("typed", Identity.generate()).start()
kids = psutil.Process().children(recursive=True)
print(json.dumps([p.pid for p in kids]), flush=True)
time.sleep(300)
"""


def test_a_sigkilled_owner_leaves_no_dht_process_or_p2pd() -> None:
    owner = subprocess.Popen([sys.executable, "-c", OWNER], stdout=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        procs = [psutil.Process(pid) for pid in json.loads(owner.stdout.readline())]
        assert {"p2pd", "python"} <= {p.name() for p in procs}
    finally:
        owner.send_signal(signal.SIGKILL)
        owner.wait(10)
    assert not still_running(procs, timeout=5), "orphans left by a SIGKILLed owner"


def test_unreachable_peers_fail_with_a_clear_message() -> None:
    dead = f"/ip4/127.0.0.1/tcp/9/p2p/{Identity.generate().peer_id}"
    with pytest.raises(NetworkError, match="could not reach any of the peers"):
        SwarmDHT(NET, Identity.generate(), initial_peers=[dead]).start()
    with pytest.raises(NetworkError, match="not a multiaddr ending in /p2p/<peer id>"):
        SwarmDHT(NET, Identity.generate(), initial_peers=["/ip4/127.0.0.1/tcp/9"])
    with pytest.raises(NetworkError, match="not an IP address"):
        SwarmDHT(NET, Identity.generate(), host="localhost")


def test_a_restarted_bootstrap_is_dialled_again_and_given_the_records(tmp_path) -> None:  # noqa: ANN001
    """A bootstrap comes back at its address knowing nobody: the peers that joined through it dial it again
    (`REJOIN_S`) and re-store their kept records there at once, so a node joining through it finds them."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    boot_key, member = Identity.generate(), Identity.generate()
    boot = SwarmDHT(NET, boot_key, port=port).start()
    a = SwarmDHT(NET, member, initial_peers=boot.visible_maddrs())
    fresh = None
    try:
        a.start()
        assert a.put(_checkpoint(5), ttl=3600, keep=True)  # kept: re-stored every 20 minutes
        boot.shutdown()
        boot = SwarmDHT(NET, boot_key, port=port).start()
        deadline = time.monotonic() + 60
        while a.rejoins == 0 and time.monotonic() < deadline:
            time.sleep(0.5)
        assert a.rejoins >= 1
        fresh = SwarmDHT(NET, Identity.generate(), initial_peers=boot.visible_maddrs()).start()
        deadline = time.monotonic() + 30
        while fresh.get_checkpoint(5, trusted=[member.public_key_hex]) is None and time.monotonic() < deadline:
            time.sleep(0.5)
        assert fresh.get_checkpoint(5, trusted=[member.public_key_hex]) is not None
    finally:
        for d in (fresh, a, boot):
            if d is not None:
                d.shutdown()
