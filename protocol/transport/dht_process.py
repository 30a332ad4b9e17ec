"""The background process that holds a node's DHT peer, and the coroutines the facade runs inside it.

hivemind runs a DHT peer in a forked child process that owns a `p2pd` (go-libp2p) child of its own.
`NodeProcess` adds what a volunteer node needs on top: the p2pd identity is the node's Ed25519 key (so
the DHT peer id is `Identity.peer_id`), and the child dies with its owner: it polls its parent pid and,
when the owner is gone (even SIGKILLed), ends p2pd and exits. It also leaves the terminal's process group,
so Ctrl-C reaches only the owner, which shuts it down in order. A parent-death signal would fire when the
*thread* that forked exits, not the process, so polling is the robust choice (cost: one syscall per 0.2 s).

Everything in the second half runs inside the child, called through `hivemind.DHT.run_coroutine`;
results travel back as plain values (bytes, lists, dicts). The first call after start is
`install_store_caps`, which puts the storage caps (`storage_caps`) in place.
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Awaitable, Callable, Iterator

import hivemind
from hivemind.proto import crypto_pb2

from skillswarm.protocol.errors import NetworkError, SkillswarmError
from skillswarm.protocol.identity import Identity

logger = logging.getLogger(__name__)

PARENT_POLL_S = 0.2


@contextlib.contextmanager
def p2p_identity_file(identity: Identity) -> Iterator[Path]:
    """A libp2p private key file (protobuf PrivateKey{Ed25519, seed||pubkey}) for p2pd, in a private
    temp dir that is deleted on exit (p2pd reads it once, at start)."""
    tmpdir = Path(tempfile.mkdtemp(prefix="skillswarm-p2p-"))  # mode 0700
    path = tmpdir / "identity.key"
    try:
        key = crypto_pb2.PrivateKey(key_type=crypto_pb2.KeyType.Ed25519, data=identity.private_bytes() + identity.public_key)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(key.SerializeToString())
        yield path
    finally:
        path.unlink(missing_ok=True)
        tmpdir.rmdir()


def _end_children_and_exit() -> None:
    """Owner gone: stop p2pd (and anything else this process started), then leave without cleanup."""
    import psutil

    try:
        children = psutil.Process().children(recursive=True)
        for child in children:
            with contextlib.suppress(psutil.Error):
                child.terminate()
        _, alive = psutil.wait_procs(children, timeout=1.0)
        for child in alive:
            with contextlib.suppress(psutil.Error):
                child.kill()
    finally:
        os._exit(0)


def _watch_parent(parent_pid: int) -> None:
    while os.getppid() == parent_pid:
        time.sleep(PARENT_POLL_S)
    _end_children_and_exit()


class NodeProcess(hivemind.DHT):
    """A `hivemind.DHT` whose background process exits (taking p2pd with it) when its owner dies."""

    def run(self) -> None:
        """Child side: arm the owner watch, then serve the DHT until shutdown."""
        # A process group of its own (p2pd inherits it): Ctrl-C in a terminal signals only the owner,
        # which then shuts the DHT down in order, instead of p2pd dying first under a live DHT.
        os.setpgrp()
        threading.Thread(target=_watch_parent, args=(self._parent_pid,), name="owner-watch", daemon=True).start()
        logging.getLogger("hivemind.p2p.p2p_daemon").addFilter(_quiet_p2pd_shutdown)
        self._inner_pipe = _WholeMessageReader(self._inner_pipe)
        super().run()


class _WholeMessageReader:
    """The request pipe's read end, read whole. hivemind reads it from its event loop, which made the fd
    non-blocking; a call over 16 KiB is written as a header and a body, so the read found the header alone,
    failed, and the next read unpickled half a message (the DHT process died). Reading blocks only for
    the rest of a message whose first bytes have arrived: the caller is writing it now."""

    def __init__(self, conn: Any) -> None:
        self._conn = conn

    def fileno(self) -> int:
        """The fd hivemind's loop watches."""
        return self._conn.fileno()

    def poll(self, timeout: float = 0.0) -> bool:
        """Whether a message has begun to arrive."""
        return self._conn.poll(timeout)

    def recv(self) -> Any:
        """One whole message, however many writes it took."""
        fd = self._conn.fileno()
        os.set_blocking(fd, True)
        try:
            return self._conn.recv()
        finally:
            os.set_blocking(fd, False)

    def close(self) -> None:
        """Close the read end."""
        self._conn.close()


def _quiet_p2pd_shutdown(record: logging.LogRecord) -> bool:
    """p2pd logs an error when its control socket closes as it stops; that is how it always stops."""
    return "use of closed network connection" not in record.getMessage()


# ---- inside the child process ----------------------------------------------------------------------
Coroutine = Callable[..., Awaitable[Any]]


async def guarded(dht: hivemind.DHT, node: hivemind.DHTNode, fn: Coroutine, kwargs: dict) -> tuple[bool, Any]:
    """Run `fn(dht, node, **kwargs)` and return (ok, result or exception), so failures come back as values
    (hivemind would log every exception from `run_coroutine` as an error with a traceback)."""
    try:
        return True, await fn(dht, node, **kwargs)
    except SkillswarmError as e:
        return False, e
    except Exception as e:  # anything from hivemind/p2pd: report it as a network failure
        logger.debug("DHT call %s failed", getattr(fn, "__name__", fn), exc_info=True)
        return False, NetworkError(f"{type(e).__name__}: {e}")


async def install_store_caps(_dht: hivemind.DHT, node: hivemind.DHTNode) -> None:
    """Cap what this peer stores per author, per key and in all (see `storage_caps`)."""
    from skillswarm.protocol.transport.storage_caps import install

    install(node)


async def storage_usage(_dht: hivemind.DHT, node: hivemind.DHTNode) -> dict[str, Any]:
    """What this peer's storage and cache hold, as the caps count it (`Ledger.usage`)."""
    from skillswarm.protocol.transport.storage_caps import CappedStorage

    out: dict[str, Any] = {}
    for name in ("storage", "cache"):
        storage = getattr(node.protocol, name)
        if isinstance(storage, CappedStorage):
            out[name] = storage.ledger.usage()
    return out


async def store_values(
    _dht: hivemind.DHT, node: hivemind.DHTNode, items: list[tuple[str, str, bytes, float]]
) -> list[bool]:
    """Store (key, subkey, value, expiration) items; one bool per item (False: rejected or unreachable)."""
    keys, subkeys, values, expirations = (list(col) for col in zip(*items))
    ok = await node.store_many(keys, values, expirations, subkeys=subkeys)
    return [bool(ok.get((k, s))) for k, s in zip(keys, subkeys)]


async def get_values(
    _dht: hivemind.DHT, node: hivemind.DHTNode, keys: list[str], latest: bool = True
) -> dict[str, dict[str, tuple[bytes, float]]]:
    """For each key, every validated subkey -> (value, expiration) found across the DHT (latest: ask all replicas),
    at most each author's per-kind cap of them (the newest)."""
    from skillswarm.protocol.transport.storage_caps import newest_within_caps

    found = await node.get_many(keys, sufficient_expiration_time=float("inf") if latest else None)
    out: dict[str, dict[str, tuple[bytes, float]]] = {}
    for key in keys:
        item = found.get(key)
        entries: dict[str, tuple[bytes, float]] = {}
        if item is not None and isinstance(item.value, dict):
            for subkey, sub in item.value.items():
                if isinstance(subkey, str) and isinstance(sub.value, bytes):
                    entries[subkey] = (sub.value, float(sub.expiration_time))
        out[key] = newest_within_caps(entries)
    return out


async def visible_maddrs(_dht: hivemind.DHT, node: hivemind.DHTNode, latest: bool = False) -> list[str]:
    """This peer's multiaddrs as others can dial them (with /p2p/<peer id>)."""
    return [str(a) for a in await node.get_visible_maddrs(latest=latest)]


async def connected_peers(_dht: hivemind.DHT, node: hivemind.DHTNode) -> list[str]:
    """Peer ids p2pd holds a connection to (the libp2p view, not the DHT records)."""
    return [info.peer_id.to_base58() for info in await node.p2p.list_peers()]


async def rejoin(_dht: hivemind.DHT, node: hivemind.DHTNode, peers: list[str], timeout: float = 5.0) -> list[str]:
    """Dial each of `peers` (multiaddrs ending in /p2p/<id>) that p2pd holds no connection to, and ping it into the
    routing table (each side adds the other): a bootstrap restarted at its address comes back knowing nobody, and
    no peer would dial it again by itself. Returns the peer ids reached again."""
    import asyncio

    from hivemind.p2p import PeerID
    from hivemind.utils.multiaddr import Multiaddr

    connected = {info.peer_id.to_base58() for info in await node.p2p.list_peers()}
    back = []
    for maddr in peers:
        pid = maddr.rsplit("/p2p/", 1)[-1]
        if pid in connected:
            continue
        with contextlib.suppress(Exception):
            peer = PeerID.from_base58(pid)
            await asyncio.wait_for(node.p2p._client.connect(peer, [Multiaddr(maddr.rsplit("/p2p/", 1)[0])]), timeout)
            if await asyncio.wait_for(node.protocol.call_ping(peer), timeout) is not None:
                back.append(pid)
    return back


async def routing_table_size(_dht: hivemind.DHT, node: hivemind.DHTNode) -> int:
    """How many DHT peers this node knows of."""
    return len(node.protocol.routing_table.uid_to_peer_id)


async def peer_id(_dht: hivemind.DHT, node: hivemind.DHTNode) -> str:
    """This peer's libp2p id (base58)."""
    return node.peer_id.to_base58()
