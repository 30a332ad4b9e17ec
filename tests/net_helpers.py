"""Helpers shared by the network tests: process checks and DHT values made the way hivemind makes them."""

from __future__ import annotations

import contextlib
import os
import subprocess
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import msgspec
import psutil
from hivemind.dht.routing import DHTID
from hivemind.p2p import PeerID
from hivemind.dht.validation import DHTRecord

from skillswarm.protocol.identity import Identity
from skillswarm.protocol.transport.blobs import BlobStore
from skillswarm.protocol.transport.dht import SwarmDHT
from skillswarm.protocol.transport.validation import OwnerSignatureValidator


def still_running(procs: list[psutil.Process], timeout: float) -> list[psutil.Process]:
    """The processes still running after up to `timeout` s (zombies count as gone; nothing is reaped here,
    so their parents' own bookkeeping stays right)."""
    deadline = time.monotonic() + timeout
    while True:
        alive = []
        for p in procs:
            try:
                if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                    alive.append(p)
            except psutil.NoSuchProcess:
                pass
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.05)


def wait_for(predicate, timeout: float, what: str, poll: float = 0.3):  # noqa: ANN001, ANN201
    """The first truthy value of `predicate()`, polled until `timeout` s (AssertionError naming `what`)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(poll)
    raise AssertionError(f"timed out waiting for {what}")


def signed_dht_record(signer: Identity, value: bytes | object, key: str, subkey: str, ttl: float = 30.0) -> DHTRecord:
    """What hivemind stores and hands the validator: key id, msgpack subkey, msgpack value with the
    owner signature `signer` makes (valid only when `subkey` is the signer's)."""
    body = msgspec.msgpack.encode(value)
    unsigned = DHTRecord(DHTID.generate(source=key).to_bytes(), msgspec.msgpack.encode(subkey), body, time.time() + ttl)
    return DHTRecord(unsigned.key, unsigned.subkey, OwnerSignatureValidator(signer).sign_value(unsigned), unsigned.expiration_time)


class BlobPeer:
    """One node of a test swarm: a DHT peer on 127.0.0.1 and its own blob store."""

    def __init__(self, net: str, root: Path, initial: list[str]) -> None:
        self.store = BlobStore(root)
        self.dht = SwarmDHT(net, Identity.generate(), initial_peers=initial).start()
        self.id = self.dht.identity.peer_id


@contextlib.contextmanager
def blob_swarm(net: str, root: Path, first: str, *others: str) -> Iterator[dict[str, BlobPeer]]:
    """Peers named `first` (the bootstrap) and `others`, each with a store under `root`; all shut down after."""
    peers: dict[str, BlobPeer] = {}
    try:
        peers[first] = BlobPeer(net, root / first, [])
        boot = peers[first].dht.visible_maddrs()
        for name in others:
            peers[name] = BlobPeer(net, root / name, boot)
        yield peers
    finally:
        for p in peers.values():
            p.dht.shutdown()


async def _checked_in_dht(_dht: Any, _node: Any, root: str, sha: str) -> bool:
    """(In a DHT process) check blob `sha` of the store at `root` as that process's provider does."""
    return BlobStore(root).has(sha)


def rot_unseen(peer: BlobPeer, sha: str, rot: Callable[[Path], None]) -> None:
    """Make `peer` serve bad bytes of blob `sha`, as a lying peer would: its provider checks the blob (once per
    process), then `rot` changes the file in place with its size and mtime kept, which that check cannot see."""
    assert peer.dht.run_coroutine(_checked_in_dht, root=str(peer.store.root), sha=sha)
    path = peer.store.path(sha)
    before = path.stat()
    os.chmod(path, 0o644)
    rot(path)
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert path.stat().st_size == before.st_size


async def store_at(_dht: Any, node: Any, peer: str, items: list, chunk: int = 25) -> list[bool]:
    """(In a DHT process) ask one peer to store pre-signed (key id, subkey bytes, value, expiration) values, as any
    program speaking hivemind's protocol can, `chunk` per request; its answer per value."""
    out: list[bool] = []
    for i in range(0, len(items), chunk):
        part = items[i:i + chunk]
        ok = await node.protocol.call_store(
            PeerID.from_base58(peer), keys=[DHTID.from_bytes(k) for k, _, _, _ in part],
            values=[v for _, _, v, _ in part], expiration_time=[e for _, _, _, e in part],
            subkeys=[msgspec.msgpack.decode(s) for _, s, _, _ in part])
        assert ok is not None, "the peer did not answer"
        out += list(ok)
    return out


def tuned_copy(model: Path, out: Path, seed: int) -> Path:
    """A 'fine-tuned' model: `model` copied with a small seeded change to a few weights."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(model, out)
    (st,) = out.glob("*.safetensors")
    sd = load_file(str(st))
    g = torch.Generator().manual_seed(seed)
    for name in sorted(sd)[:4]:
        if sd[name].is_floating_point():
            sd[name] = sd[name] + 0.01 * torch.randn(sd[name].shape, generator=g)
    save_file(sd, str(st), metadata={"format": "pt"})
    return out


def offer_delta(dht: SwarmDHT, blobs: BlobStore, network: str, base_hash: str, model: Path, work: Path) -> str:
    """A worker's arith delta on checkpoint v0 of `network`: its blob served by `dht` and its manifest put; the sha."""
    from skillswarm.merge import compute_delta
    from skillswarm.protocol.records import DeltaManifest

    delta = compute_delta(model, tuned_copy(model, work / "tuned", 1), work / "d.safetensors", "dense_fp32",
                          base_hash=base_hash, skill="arith")
    sha = blobs.add_file(delta.path, move=True)
    dht.provide(sha, store=blobs)
    assert dht.put(DeltaManifest(network=network, skill="arith", base_version=0, base_hash=base_hash, blob=sha,
                                 size=delta.size, codec="dense_fp32", norm=delta.norm,
                                 num_tensors=delta.num_tensors, tree=blobs.tree(sha)), 600, keep=True)
    return sha


def start_coordinator(spec_file: Path, maddr: str, key: Path, home: Path, failpoint: str | None = None,
                      *extra: str) -> subprocess.Popen:
    """A `coordinator run` process on 127.0.0.1 with its own home (`failpoint`: the crash point it is armed with)."""
    from tests.conftest import ROOT, SKILLSWARM

    env = {**os.environ, "SKILLSWARM_HOME": str(home), "COLUMNS": "200"}
    env.pop("SKILLSWARM_FAILPOINT", None)
    if failpoint:
        env["SKILLSWARM_FAILPOINT"] = failpoint
    return subprocess.Popen([str(SKILLSWARM), "coordinator", "run", "--network", str(spec_file), "--peers", maddr,
                             "--host", "127.0.0.1", "--key", str(key), "--eval-n", "4", *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT, env=env)
