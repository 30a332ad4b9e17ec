"""What every long-running node command sets up: the network file, the node's key, its DHT peer, its
checkpoint store and blob store; and a stop event that Ctrl-C and SIGTERM set, so work ends cleanly."""

from __future__ import annotations

import contextlib
import signal
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

from skillswarm.node.checkpoints.store import CheckpointStore
from skillswarm.protocol.transport.blobs import BlobStore
from skillswarm.protocol.errors import NetworkError
from skillswarm.protocol.identity import Identity
from skillswarm.protocol.netspec import load_spec
from skillswarm.protocol.records import NetworkSpec


@dataclass
class NodeSession:
    """A joined node: spec, identity, DHT peer, local stores."""

    spec: NetworkSpec
    identity: Identity
    dht: object  # skillswarm.protocol.transport.dht.SwarmDHT (imported lazily: it pulls in hivemind)
    store: CheckpointStore
    blobs: BlobStore


def join_addresses(spec: NetworkSpec, peers: Sequence[str] | None) -> list[str]:
    """Whom to join: --peers, else the network file's bootstrap list; a clear error when neither exists."""
    joined = list(peers or spec.bootstrap)
    if not joined:
        raise NetworkError(f"no peer to join network `{spec.network}`: pass --peers MADDR (printed by "
                           "`skillswarm net serve`) or list bootstrap peers in the network file")
    return joined


@contextlib.contextmanager
def open_session(network_file: Path, *, key: Path | None = None, peers: Sequence[str] | None = None,
                 host: str = "0.0.0.0", port: int = 0, announce: Sequence[str] = (), auto_relay: bool = False,
                 client_mode: bool = False, ephemeral_key: bool = False,
                 cache: Path | None = None, max_blob_bytes: int | None = None) -> Iterator[NodeSession]:
    """Load the spec and key, start the DHT peer, serve the blob store; shut everything down on exit.
    `cache` keeps blobs and checkpoints somewhere other than the user's cache dir; `max_blob_bytes` caps the
    blob store (downloads that would pass it are refused)."""
    from skillswarm.protocol.transport.dht import SwarmDHT
    from skillswarm.protocol.transport.validation import StorePolicy

    spec = load_spec(network_file)
    identity = Identity.generate() if ephemeral_key else Identity.claim(key)
    dht = SwarmDHT(spec.network, identity, host=host, port=port, initial_peers=join_addresses(spec, peers),
                   announce_maddrs=announce, use_auto_relay=auto_relay, client_mode=client_mode,
                   policy=StorePolicy.from_spec(spec))
    with dht:
        blobs = BlobStore(cache / "blobs" if cache else None, max_bytes=max_blob_bytes)
        if not client_mode:
            dht.serve_blobs(blobs)
        store = CheckpointStore(spec.network, cache / "networks" / spec.network if cache else None)
        yield NodeSession(spec, identity, dht, store, blobs)


@contextlib.contextmanager
def stop_on_signals() -> Iterator[threading.Event]:
    """An event set by the first Ctrl-C or SIGTERM (a second Ctrl-C interrupts at once)."""
    stop = threading.Event()

    def handler(signum: int, _frame: object) -> None:
        if stop.is_set() and signum == signal.SIGINT:
            raise KeyboardInterrupt
        stop.set()

    previous = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield stop
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
