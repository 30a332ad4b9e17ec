"""Three processes on 127.0.0.1, as users run them: a bootstrap (`skillswarm net serve`) and two worker
peers (`tests/dht_peer.py`). The test process adds a rogue peer with no validator of its own, which
writes straight into every honest peer's storage (hivemind's store RPC) and reads it back raw.

The tests run in file order, as one scenario: discovery, inspection, attacks, expiry, then SIGKILL.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from functools import partial
from pathlib import Path
from typing import Any, Callable, Iterator

import msgspec
import psutil
import pytest
from hivemind.dht.routing import DHTID
from hivemind.p2p import PeerID

from skillswarm.protocol import keys
from skillswarm.protocol.codec import decode_record, encode_record
from skillswarm.protocol.transport.dht_process import NodeProcess
from skillswarm.protocol.identity import Identity
from skillswarm.protocol.netspec import save_spec
from skillswarm.protocol.records import NetworkSpec, PeerRecord
from tests.conftest import ROOT, SKILLSWARM, run_cli
from tests.net_helpers import signed_dht_record, still_running

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
NET = "integ"
TTL, BEAT = 3.0, 1.0


class Proc:
    """A child process whose stdout JSON lines are collected by a reader thread."""

    def __init__(self, args: list[str], env: dict) -> None:
        self.popen = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd=ROOT, env=env)
        self.events: queue.Queue[dict] = queue.Queue()
        self.seen: list[dict] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.popen.stdout:
            try:
                self.events.put(json.loads(line))
            except ValueError:
                pass  # not an event line

    def wait_for(self, pred: Callable[[dict], bool], timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            try:
                event = self.events.get(timeout=left)
            except queue.Empty:
                break
            self.seen.append(event)
            if pred(event):
                return event
        raise AssertionError(f"no matching event within {timeout} s; last: {self.seen[-3:]}")


@pytest.fixture(scope="module")
def net(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    home = tmp_path_factory.mktemp("integ-home")
    env = {**os.environ, "SKILLSWARM_HOME": str(home), "COLUMNS": "200"}
    spec_file = home / "net.toml"
    save_spec(NetworkSpec(network=NET, base_model="m", base_hash="a" * 64, skills=["arith", "rev"]), spec_file)
    state: dict[str, Any] = {"env": env, "spec": spec_file, "procs": []}
    try:
        boot = Proc([str(SKILLSWARM), "net", "serve", "--host", "127.0.0.1", "--network", str(spec_file),
                     "--heartbeat", str(BEAT), "--json"], env)
        state["procs"].append(boot)
        info = boot.wait_for(lambda e: "maddrs" in e, 60)
        state.update(boot=boot, boot_id=info["peer_id"], maddr=info["maddrs"][0])
        for name, skill in (("p1", "arith"), ("p2", "rev")):
            state[name] = Proc([sys.executable, "-m", "tests.dht_peer", NET, state["maddr"], "--skill", skill,
                                "--interval", str(BEAT), "--ttl", str(TTL)], env)
            state["procs"].append(state[name])
        for name in ("p1", "p2"):
            up = state[name].wait_for(lambda e: e["event"] == "up", 60)
            state[f"{name}_id"], state[f"{name}_up"] = up["peer_id"], up
        state["rogue"] = NodeProcess(initial_peers=[state["maddr"]], start=True, client_mode=True,
                                     host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        yield state
    finally:
        if "rogue" in state:
            state["rogue"].shutdown()
        for proc in state["procs"]:
            if proc.popen.poll() is None:
                proc.popen.kill()
                proc.popen.wait(10)


def test_each_peer_sees_the_others_within_5_seconds(net: dict) -> None:
    everyone = {net["boot_id"], net["p1_id"], net["p2_id"]}
    joined = max(net["p1_up"]["t"], net["p2_up"]["t"])
    for name in ("p1", "p2"):
        view = net[name].wait_for(lambda e: e["event"] == "view" and everyone <= set(e["peers"]), 10)
        assert view["t"] - joined < 5.0, f"{name} needed {view['t'] - joined:.1f} s to see every peer"


def test_net_peers_and_status_show_the_network(net: dict) -> None:
    args = ["--network", str(net["spec"]), "--peers", net["maddr"], "--json"]
    running = [subprocess.Popen([str(SKILLSWARM), "net", cmd, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, env=net["env"]) for cmd in ("peers", "status")]
    (peers_out, peers_err), (status_out, status_err) = (p.communicate(timeout=120) for p in running)
    assert [p.returncode for p in running] == [0, 0], peers_err + status_err
    listed = {p["peer_id"]: p for p in json.loads(peers_out)["peers"]}
    assert listed[net["boot_id"]]["role"] == "bootstrap"
    assert listed[net["p1_id"]]["skills"] == ["arith"] and listed[net["p2_id"]]["engine"] == "hf"
    view = json.loads(status_out)
    assert view["roles"]["worker"] == 2 and view["roles"]["bootstrap"] == 1
    assert view["workers_per_skill"] == {"arith": 1, "rev": 1} and view["latest_checkpoint"] is None


# ---- the rogue: raw store and find RPCs, run inside its DHT process -----------------------------------
async def _store_at(_dht, node, peer: str, key: str, subkey: str, value: bytes, expiration: float) -> list | None:
    ok = await node.protocol.call_store(PeerID.from_base58(peer), keys=[DHTID.generate(source=key)],
                                        values=[value], expiration_time=[expiration], subkeys=[subkey])
    return None if ok is None else list(ok)


async def _find_at(_dht, node, peer: str, key: str) -> dict[str, tuple[bytes, float]]:
    key_id = DHTID.generate(source=key)
    found = await node.protocol.call_find(PeerID.from_base58(peer), [key_id])
    value = found[key_id][0]
    return {} if value is None else {s: (v.value, v.expiration_time) for s, v in value.value.items()}


def _honest(net: dict) -> list[str]:
    return [net["boot_id"], net["p1_id"], net["p2_id"]]


def _store_everywhere(net: dict, key: str, subkey: str, value: bytes, expiration: float) -> list:
    """Ask each honest peer directly to store a value; each answers [True] (stored) or [False] (rejected)."""
    return [_rogue(net, partial(_store_at, peer=p, key=key, subkey=subkey, value=value, expiration=expiration))
            for p in _honest(net)]


def _held_by(net: dict, peer: str, key: str) -> dict[str, tuple[bytes, float]]:
    """What `peer` holds under `key`, raw (subkey -> signed value, expiration)."""
    return _rogue(net, partial(_find_at, peer=peer, key=key))


def _rogue(net: dict, coro: partial) -> Any:
    return net["rogue"].run_coroutine(coro, return_future=True).result(timeout=30)


def _record_in(value: bytes) -> PeerRecord:
    return decode_record(msgspec.msgpack.decode(value[:-64]), PeerRecord)


def test_writes_to_another_peers_subkey_are_rejected_by_every_peer(net: dict) -> None:
    rogue_id = Identity.generate()
    key = keys.peers_key(NET)
    p1_sub = next(s for s, (v, _) in _held_by(net, net["p1_id"], key).items() if _record_in(v).peer_id == net["p1_id"])
    own = rogue_id.sign_record(PeerRecord(network=NET, peer_id=rogue_id.peer_id, role="observer"))
    # control: the rogue's own record under its own subkey is accepted, so the rejections below are the validator's
    good = signed_dht_record(rogue_id, encode_record(own), key, rogue_id.public_key_hex)
    stored = _store_everywhere(net, key, rogue_id.public_key_hex, good.value, good.expiration_time)
    for peer, ok in zip(_honest(net), stored):
        # [False] here only means the peer already holds this very value: hivemind merges what a get finds into
        # the dictionary it holds locally, so a peer whose heartbeat read the key after the first store has it
        assert ok == [True] or _held_by(net, peer, key)[rogue_id.public_key_hex] == (good.value, good.expiration_time)
    # its record under p1's subkey, signed with its own key
    bad = signed_dht_record(rogue_id, encode_record(own), key, p1_sub)
    assert _store_everywhere(net, key, p1_sub, bad.value, bad.expiration_time) == [[False]] * 3
    # p1's genuine value replayed with a later expiration (keeping a peer "alive" after it leaves)
    value, expiration = _held_by(net, net["boot_id"], key)[p1_sub]
    assert _store_everywhere(net, key, p1_sub, value, expiration + 200) == [[False]] * 3
    for peer in _honest(net):  # what every honest peer holds under p1's subkey is still p1's own record
        held = _held_by(net, peer, key)
        assert _record_in(held[p1_sub][0]).author == p1_sub and held[p1_sub][1] < expiration + 100


def test_malformed_and_oversized_records_are_rejected_by_every_peer(net: dict) -> None:
    rogue_id = Identity.generate()
    key, sub = keys.peers_key(NET), rogue_id.public_key_hex
    base = dict(network=NET, peer_id=rogue_id.peer_id, role="observer")
    cases = {
        "garbage": b"\x93not a record",
        "oversized": msgspec.msgpack.encode(rogue_id.sign_record(PeerRecord(**base, software="x" * 9000), validate=False)),
        "schema": msgspec.msgpack.encode(rogue_id.sign_record(PeerRecord(**{**base, "role": "king"}), validate=False)),
        "other network": encode_record(rogue_id.sign_record(PeerRecord(**{**base, "network": "elsewhere"}))),
        "unsigned record": encode_record(PeerRecord(**base)),
    }
    for name, payload in cases.items():
        bad = signed_dht_record(rogue_id, payload, key, sub)
        assert _store_everywhere(net, key, sub, bad.value, bad.expiration_time) == [[False]] * 3, name
    for peer in _honest(net):
        assert sub not in _held_by(net, peer, key)


def test_a_stopped_peers_record_disappears_after_its_expiration(net: dict) -> None:
    p1, p2 = net["p1"], net["p2"]
    p1.wait_for(lambda e: e["event"] == "view" and net["p2_id"] in e["peers"], 10)
    p2.popen.send_signal(signal.SIGTERM)
    stopped = p2.wait_for(lambda e: e["event"] == "stopped", 30)
    assert stopped["processes"] == [], "a cleanly stopped peer left processes behind"
    assert p2.popen.wait(10) == 0
    gone = p1.wait_for(lambda e: e["event"] == "view" and net["p2_id"] not in e["peers"], TTL + 5)
    assert gone["t"] - stopped["t"] < TTL + 2.5, "the record outlived its expiration"


def test_sigkill_of_a_peer_leaves_no_dht_process_or_p2pd(net: dict) -> None:
    p1 = net["p1"]
    procs = [psutil.Process(pid) for pid in net["p1_up"]["processes"]]
    assert "p2pd" in {p.name() for p in procs}
    p1.popen.send_signal(signal.SIGKILL)
    p1.popen.wait(10)
    assert not still_running(procs, timeout=5), "orphans left behind by a SIGKILLed peer"
    # the bootstrap shuts down cleanly on SIGTERM, and takes its p2pd with it
    boot = psutil.Process(net["boot"].popen.pid)
    boot_children = boot.children(recursive=True)
    net["boot"].popen.send_signal(signal.SIGTERM)
    assert net["boot"].popen.wait(30) == 0
    assert not still_running(boot_children, timeout=5)


def test_joining_without_peers_or_with_a_mistyped_one_fails_with_a_clear_message(tmp_path: Path) -> None:
    spec_file = tmp_path / "net.toml"
    save_spec(NetworkSpec(network=NET, base_model="m", base_hash="a" * 64, skills=["arith"]), spec_file)
    no_peers = run_cli("net", "peers", "--network", str(spec_file), check=False)
    assert no_peers.returncode == 1 and "no peer to join network `integ`" in no_peers.stderr
    bad_addr = run_cli("net", "status", "--network", str(spec_file), "--peers", "/ip4/127.0.0.1/tcp/9", check=False)
    assert bad_addr.returncode == 1 and "/p2p/<peer id>" in bad_addr.stderr
