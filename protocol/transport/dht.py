"""`SwarmDHT`: one node's handle on the network, a synchronous facade over a hivemind DHT peer.

The peer runs in a background process (`dht_process.NodeProcess`) with its own p2pd, so the caller's
main thread (training) is never blocked by the network, and blob uploads and downloads run there too.
Every value goes through the owner-signature validator (`validation`, with the network's `StorePolicy`
when the peer has one) and the storage caps (`storage_caps`) on every peer, and every record returned
here is decoded, schema-checked and signature-verified again: callers only see good records.

    with SwarmDHT("demo", identity, initial_peers=spec.bootstrap) as dht:
        dht.start_heartbeat(lambda: dht.make_peer_record(role="worker", skills=["arith"]))
        dht.put(delta_manifest, ttl=3600)
        path = dht.fetch(sha, max_size=2**30)
"""

from __future__ import annotations

import concurrent.futures
import ipaddress
import logging
import re
import threading
import time
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, Sequence, TypeVar

from skillswarm.protocol.transport.blobs import BlobStore, check_sha256
from skillswarm.protocol.transport.downloads import fetch_many, fetch_one
from skillswarm.protocol.codec import decode_record, encode_record
from skillswarm.protocol.errors import BlobError, NetworkError, RecordError
from skillswarm.protocol.identity import Identity, verify_record
from skillswarm.protocol.keys import (
    deltas_key, locations, peers_key, providers_key, skill_key,
)
from skillswarm.protocol.records import (
    DeltaManifest, Hardware, PeerRecord, ProviderRecord, Record, SkillStats, kind_of,
)
from skillswarm.protocol.transport.checkpoint_reads import CheckpointReads
from skillswarm.protocol.transport.republisher import Republisher
from skillswarm.protocol.version import __version__

if TYPE_CHECKING:
    from skillswarm.protocol.transport.validation import StorePolicy

logger = logging.getLogger(__name__)
R = TypeVar("R", bound=Record)

CALL_TIMEOUT = 60.0
REJOIN_S = 10.0  # how often a peer checks that it is still connected to the peers it joined through


def _listen_maddr(host: str, port: int) -> str:
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        raise NetworkError(f"--host {host!r} is not an IP address (use 0.0.0.0 to listen on every interface)") from None
    return f"/ip{ip.version}/{host}/tcp/{port}"


_MADDR = re.compile(r"^(/[a-z0-9-]+(/[^/\s]+)?)+$")
_P2P_TAIL = re.compile(r"/p2p/[1-9A-HJ-NP-Za-km-z]{32,64}$")


def _check_maddrs(maddrs: Iterable[str], what: str, need_peer_id: bool) -> list[str]:
    """Catch mistyped addresses early, with an example (hivemind parses them fully at start)."""
    out = []
    for m in maddrs:
        m = str(m)
        if not _MADDR.match(m) or (need_peer_id and not _P2P_TAIL.search(m)):
            tail = " ending in /p2p/<peer id>" if need_peer_id else ""
            raise NetworkError(f"{what} {m!r} is not a multiaddr{tail} (e.g. /ip4/1.2.3.4/tcp/31337/p2p/12D3KooW...)")
        out.append(m)
    return out


class SwarmDHT(CheckpointReads):
    """A node's DHT peer for one network: typed, verified records and content-addressed blobs.

    `host`/`port`: where p2pd listens (port 0: any free one). `initial_peers`: multiaddrs of running peers
    (none: the first peer of a new network). Behind a home router: `announce_maddrs` (the public address
    and forwarded port others should dial), `use_auto_relay=True` (become reachable through a relay);
    `use_relay` lets this node reach and relay for NATed peers. `client_mode`: query and publish without
    storing others' records (short-lived inspectors). `network=None`: a bootstrap peer that validates and
    stores every network's records but publishes and reads none. `policy` (`StorePolicy.from_spec(spec)`):
    store and accept only what the network admits; without one, untrusted checkpoints live an hour at most.

    Every method may be called from any thread. `start()` forks the DHT process: call it before loading a
    model or starting training threads, so the fork copies little and inherits no busy thread pool.
    """

    def __init__(
        self, network: str | None, identity: Identity, *, host: str = "127.0.0.1", port: int = 0,
        initial_peers: Sequence[str] = (), announce_maddrs: Sequence[str] = (), use_auto_relay: bool = False,
        use_relay: bool = True, client_mode: bool = False, start_timeout: float = 60.0, wait_timeout: float = 3.0,
        policy: StorePolicy | None = None,
    ) -> None:
        if policy is not None and network is not None and policy.network != network:
            raise ValueError(f"a store policy for network `{policy.network}` given to a peer of `{network}`")
        self.network = network
        self.policy = policy
        self.identity = identity
        self.client_mode = client_mode
        self._options = dict(
            host_maddrs=[_listen_maddr(host, port)],
            announce_maddrs=_check_maddrs(announce_maddrs, "announce address", need_peer_id=False) or None,
            use_auto_relay=use_auto_relay, use_relay=use_relay, client_mode=client_mode, wait_timeout=wait_timeout,
        )
        self.initial_peers = _check_maddrs(initial_peers, "peer", need_peer_id=True)
        self._start_timeout = start_timeout
        self._node: Any = None
        self._pipe_lock = threading.Lock()  # hivemind's request pipe is not thread-safe: one sender at a time
        self._republisher: Republisher | None = None
        self._store: BlobStore | None = None
        self._peer_id: str | None = None
        self.rejoins = 0  # times this peer reached one of its initial peers again after losing it (a restart)
        self._rejoiner: threading.Thread | None = None
        self._stopping = threading.Event()

    # ---- lifetime -----------------------------------------------------------------------------------
    def start(self) -> SwarmDHT:
        """Start the DHT process and p2pd and join the network; raises `NetworkError` saying why it could not."""
        if self._node is not None:
            return self
        from skillswarm.protocol.transport.dht_process import NodeProcess, install_store_caps, p2p_identity_file
        from skillswarm.protocol.transport.validation import OwnerSignatureValidator

        with p2p_identity_file(self.identity) as key_file:
            node = NodeProcess(
                initial_peers=self.initial_peers or None, start=False,
                record_validators=[OwnerSignatureValidator(self.identity, self.policy)],
                identity_path=str(key_file), check_if_identity_free=False, startup_timeout=self._start_timeout,
                **self._options,
            )
            try:
                node.run_in_background(await_ready=True, timeout=self._start_timeout)
            except BaseException as e:
                node.shutdown()
                raise NetworkError(self._explain_start_failure(e)) from None
        self._node = node
        try:
            self.run_coroutine(install_store_caps)  # what arrived while joining is re-admitted under the caps
        except NetworkError:
            self.shutdown()
            raise
        if self.peer_id != self.identity.peer_id:
            self.shutdown()
            raise NetworkError(f"p2pd runs as {self.peer_id}, not as this node's key {self.identity.peer_id}")
        logger.debug("DHT peer %s up for network %s", self.peer_id, self.network)
        if self.initial_peers:
            self._stopping.clear()
            self._rejoiner = threading.Thread(target=self._keep_joined, name="skillswarm-rejoin", daemon=True)
            self._rejoiner.start()
        return self

    def _keep_joined(self) -> None:
        """Every REJOIN_S, dial again the initial peers this one lost (`dht_process.rejoin`): when a bootstrap
        restarts, the peers that joined through it reconnect, so it learns the network again and new nodes that join
        through it find everyone (and what they store)."""
        from skillswarm.protocol.transport.dht_process import rejoin

        while not self._stopping.wait(REJOIN_S):
            try:
                back = self.run_coroutine(rejoin, peers=list(self.initial_peers))
            except NetworkError:
                continue
            except Exception:  # noqa: BLE001 - a failed check is tried again at the next one
                logger.debug("rejoining the initial peers failed", exc_info=True)
                continue
            if back:
                self.rejoins += 1
                if self._republisher is not None:  # it came back empty: give it this node's records now
                    self._republisher.refresh()
                logger.info("reconnected to %s (restarted?)", ", ".join(b[:16] for b in back))

    def _explain_start_failure(self, e: BaseException) -> str:
        text = f"{type(e).__name__}: {e}"
        if any(sign in text for sign in ("bootstrap failed", "initial_peers", "connect to bootstrap peers")):
            return (f"could not reach any of the peers {', '.join(self.initial_peers)}; check the addresses "
                    "(they end in /p2p/<peer id>) and that a peer is running there")
        if isinstance(e, (TimeoutError, concurrent.futures.TimeoutError)):
            return f"the DHT peer did not start within {self._start_timeout:g} s"
        if "address already in use" in text.lower():
            return f"cannot listen on {self._options['host_maddrs'][0]}: the port is taken; pick another --port"
        return f"the DHT peer failed to start ({text})"

    def shutdown(self) -> None:
        """Stop heartbeats, leave the network, and end the DHT process and p2pd (idempotent)."""
        self._stopping.set()
        if self._rejoiner is not None:
            self._rejoiner.join(CALL_TIMEOUT)
            self._rejoiner = None
        if self._republisher is not None:
            self._republisher.stop()
            self._republisher = None
        node, self._node = self._node, None
        if node is None:
            return
        with self._pipe_lock:
            node.shutdown()
        node.join(5)
        if node.is_alive():  # hivemind's grace period ran out: do not leave a process behind
            node.kill()
            node.join(5)

    def __enter__(self) -> SwarmDHT:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    @property
    def is_running(self) -> bool:
        """Whether the DHT process is up."""
        return self._node is not None and self._node.is_alive()

    @property
    def pid(self) -> int | None:
        """The DHT process id (p2pd is its child)."""
        return self._node.pid if self._node is not None else None

    # ---- calls into the DHT process ----------------------------------------------------------------
    def run_coroutine(self, fn: Callable[..., Any], timeout: float | None = CALL_TIMEOUT, **kwargs: Any) -> Any:
        """Run `await fn(hivemind_dht, dht_node, **kwargs)` inside the DHT process and return its result.
        `fn` must be a module-level coroutine function; its exceptions are raised here."""
        return self.wait_for(self.submit(fn, kwargs), timeout)

    def submit(self, fn: Callable[..., Any], kwargs: dict) -> concurrent.futures.Future:
        """Start `await fn(hivemind_dht, dht_node, **kwargs)` in the DHT process without waiting: its future, for
        `wait_for` (a download waits on it while its progress ticks)."""
        from skillswarm.protocol.transport.dht_process import guarded

        if self._node is None:
            raise NetworkError("the DHT peer is not running; call start() first")
        with self._pipe_lock:
            return self._node.run_coroutine(partial(guarded, fn=fn, kwargs=kwargs), return_future=True)

    def wait_for(self, future: concurrent.futures.Future, timeout: float | None,
                 tick: Callable[[], None] | None = None) -> Any:
        """The result of a `submit`ted call, waiting at most `timeout` seconds (calling `tick` every 0.2 s); a
        `NetworkError` when the DHT process stops or does not answer in time."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            try:
                ok, value = future.result(timeout=0.2)
                break
            except concurrent.futures.TimeoutError:
                if tick is not None:
                    tick()
                if self._node is None or not self._node.is_alive():
                    raise NetworkError("the DHT process stopped (see the log above); restart the node") from None
                if deadline is not None and time.monotonic() > deadline:
                    future.cancel()
                    raise NetworkError(f"the DHT did not answer within {timeout:g} s") from None
        if not ok:
            raise value
        return value

    @property
    def peer_id(self) -> str:
        """This node's libp2p peer id (equal to `identity.peer_id`)."""
        from skillswarm.protocol.transport.dht_process import peer_id

        if self._peer_id is None:
            self._peer_id = self.run_coroutine(peer_id)
        return self._peer_id

    def visible_maddrs(self, latest: bool = False) -> list[str]:
        """Multiaddrs others can use to reach this peer (give them as `--peers`)."""
        from skillswarm.protocol.transport.dht_process import visible_maddrs

        return self.run_coroutine(visible_maddrs, latest=latest)

    def connected_peers(self) -> list[str]:
        """Peer ids of the libp2p connections this node holds right now."""
        from skillswarm.protocol.transport.dht_process import connected_peers

        return self.run_coroutine(connected_peers)

    def storage_usage(self) -> dict[str, Any]:
        """What this peer stores for others, as the storage caps count it: for its `storage` and `cache`,
        values and bytes in all, per author (bytes, values per kind) and per key id (hex)."""
        from skillswarm.protocol.transport.dht_process import storage_usage

        return self.run_coroutine(storage_usage)

    # ---- records ------------------------------------------------------------------------------------
    def put(self, record: Record, ttl: float, *, keep: bool = False) -> bool:
        """Sign (if unsigned) and store a record where its kind lives, expiring in `ttl` s. `keep=True`
        re-stores it in the background every ttl/3 until `forget(record)`. True if a peer accepted it."""
        from skillswarm.protocol.transport.dht_process import store_values
        from skillswarm.protocol.transport.validation import MAX_TTL

        record = self._own(record)
        kind = kind_of(type(record))
        if kind not in MAX_TTL:
            raise RecordError(f"{type(record).__name__} records are shared as files, never through the DHT")
        if not 0 < ttl <= MAX_TTL[kind]:
            raise RecordError(f"a {kind} record may live 0-{MAX_TTL[kind]:g} s, not {ttl:g}")
        data = encode_record(record)
        expiration = time.time() + ttl
        ok = self.run_coroutine(store_values, items=[(k, s, data, expiration) for k, s in locations(record)])
        if keep:
            self._ensure_republisher().keep(("record", *locations(record)[0]), lambda: [record], ttl / 3, ttl)
        return all(ok)

    def forget(self, record: Record) -> None:
        """Stop re-storing a record kept with `put(..., keep=True)` (it expires on its own)."""
        if self._republisher is not None:
            self._republisher.drop(("record", *locations(self._own(record))[0]))

    @property
    def _net(self) -> str:
        if self.network is None:
            raise NetworkError("this DHT peer was started without a network; pass one to read or publish records")
        return self.network

    def _own(self, record: Record) -> Record:
        if record.network != self._net:
            raise RecordError(f"record is for network `{record.network}`, this node is on `{self.network}`")
        if not record.signature:
            return self.identity.sign_record(record)
        if record.author != self.identity.public_key_hex:
            raise RecordError("only records signed by this node's key can be published from it")
        verify_record(record, network=self._net)
        return record

    def announce(self, peer: PeerRecord, ttl: float = 30.0) -> bool:
        """Publish this node's PeerRecord once (see `start_heartbeat` to keep it alive)."""
        return self.put(peer, ttl)

    def start_heartbeat(self, make_record: Callable[[], PeerRecord], interval: float = 10.0, ttl: float = 30.0) -> None:
        """Announce `make_record()` now and every `interval` s from a background thread (it must be
        thread-safe); the record expires `ttl` s after the last beat, so a stopped node disappears."""
        if ttl <= interval:
            raise ValueError("ttl must exceed the heartbeat interval, or the record would blink out between beats")
        self.announce(make_record(), ttl)
        self._ensure_republisher().keep(("heartbeat",), lambda: [make_record()], interval, ttl)

    def stop_heartbeat(self) -> None:
        """Stop announcing this node (its record expires after its ttl)."""
        if self._republisher is not None:
            self._republisher.drop(("heartbeat",))

    def make_peer_record(self, role: str, **fields: Any) -> PeerRecord:
        """An unsigned PeerRecord of this node: network, peer id, visible addresses and software filled in."""
        fields.setdefault("hardware", Hardware())
        return PeerRecord(network=self._net, peer_id=self.identity.peer_id, addrs=self.visible_maddrs()[:16],
                          role=role, software=f"skillswarm {__version__}"[:64], **fields)

    def _ensure_republisher(self) -> Republisher:
        if self._republisher is None:
            self._republisher = Republisher(self)
        return self._republisher

    def _placed(self, keys: Sequence[str], decode: Callable[[bytes], Record]) -> Iterator[Record]:
        """Every value under `keys` that `decode` turns into a record (it raises RecordError for a malformed or forged
        one) and that sits where its content says it belongs; anything else is dropped."""
        from skillswarm.protocol.transport.dht_process import get_values

        for i in range(0, len(keys), 64):
            found = self.run_coroutine(get_values, keys=list(keys[i:i + 64]))
            for key, entries in found.items():
                for subkey, (data, _expiration) in entries.items():
                    try:
                        record = decode(data)
                        if (key, subkey) not in locations(record):
                            raise RecordError(f"{kind_of(type(record))} record found under {key}, where it does not "
                                              "belong")
                    except RecordError as e:
                        logger.debug("dropped a record under %s: %s", key, e)
                        continue
                    yield record

    def _records(self, keys: Sequence[str], kind: type[R], trusted: Iterable[str] | None = None) -> list[R]:
        """Every good record of `kind` under `keys`, signed (by a `trusted` key when given); anything malformed, forged
        or misplaced is dropped."""
        trusted = None if trusted is None else set(trusted)

        def decode(data: bytes) -> R:
            record = decode_record(data, kind)
            verify_record(record, network=self._net, trusted=trusted)
            return record

        return list(self._placed(keys, decode))  # type: ignore[arg-type]

    def get_peers(self) -> list[PeerRecord]:
        """The PeerRecords of every node online (not expired): first those of the nodes this one sees running (its
        own, its DHT routing table's, the peers it is connected to), then the others, each by peer id. Never by
        `created`: a record's author chooses it (a record dated in year 5138 is not the freshest)."""
        from skillswarm.protocol.transport.observed import live_peers

        found = self._records([peers_key(self._net)], PeerRecord)
        live = set(self.run_coroutine(live_peers)) if found else set()
        return sorted(found, key=lambda r: (r.peer_id not in live, r.peer_id, r.author))

    def get_deltas(self, base_version: int) -> list[DeltaManifest]:
        """Every DeltaManifest trained on checkpoint `base_version`, in blob order (not by `created`, which each
        author writes as it likes: a round orders its deltas itself, node/roles/rounds/admission.py)."""
        return sorted(self._records([deltas_key(self._net, base_version)], DeltaManifest),
                      key=lambda r: (r.blob, r.author))

    def get_skill_stats(self, skill: str) -> list[SkillStats]:
        """Workers' live SkillStats for `skill`."""
        return self._records([skill_key(self._net, skill)], SkillStats)

    def get_providers(self, sha: str, *, limit: int | None = None) -> list[ProviderRecord]:
        """Who announces that they serve blob `sha`: at most `limit` (default `observed.MAX_PROVIDERS`) of them, one
        record per peer, in the order this node asks them (`observed.Observed`): those that delivered to it when
        last asked first, fastest first; then those it sees running (DHT routing table, connections) and never
        asked, then the others never asked, each group in random order; those that failed last. What the records
        claim (their `created`) plays no part, and a flood of records for keys nobody runs cannot push out a
        provider this node has seen."""
        from skillswarm.protocol.transport.observed import MAX_PROVIDERS, provider_order

        by_peer: dict[str, ProviderRecord] = {}
        for r in self._records([providers_key(self._net, check_sha256(sha))], ProviderRecord):
            by_peer.setdefault(r.peer_id, r)
        if not by_peer:
            return []
        order = self.run_coroutine(provider_order, peer_ids=list(by_peer),
                                   limit=MAX_PROVIDERS if limit is None else limit)
        return [by_peer[p] for p in order if p in by_peer]

    # ---- blobs --------------------------------------------------------------------------------------
    def serve_blobs(self, store: BlobStore | None = None, *, max_concurrent: int = 4,
                    max_upload_mb_s: float | None = None) -> None:
        """Serve the blobs of `store` (default: the cache) to peers: at most `max_concurrent` uploads, and
        optionally at most `max_upload_mb_s` MB/s each."""
        from skillswarm.protocol.transport.provider import start_provider

        store = store or BlobStore()
        rate = max_upload_mb_s * 1e6 if max_upload_mb_s else None
        self.run_coroutine(start_provider, root=str(store.root), max_concurrent=max_concurrent, max_upload_bytes_s=rate)
        self._store = store

    def provide(self, sha: str, *, store: BlobStore | None = None, ttl: float = 600.0) -> ProviderRecord:
        """Announce that this node serves blob `sha` (serving `store` if not serving yet), re-announced
        until `unprovide`."""
        store = store or self._store or BlobStore()
        if not store.has(sha):
            raise BlobError(f"blob {sha[:12]} is not in {store.root}; add it with BlobStore.add_file first")
        if self._store is None or self._store.root != store.root:
            self.serve_blobs(store)
        store.pieces(sha)  # its piece list, ready for fetchers that download piece by piece
        return self.announce_blob(sha, store.size(sha), ttl)

    def announce_blob(self, sha: str, size: int, ttl: float = 600.0) -> ProviderRecord:
        """Keep a ProviderRecord for blob `sha` in the DHT (also while a download of it into the served store
        is in flight: its verified pieces are served), until `unprovide`."""
        record = self.identity.sign_record(ProviderRecord(
            network=self._net, peer_id=self.identity.peer_id, blob=sha, size=size, addrs=self.visible_maddrs()[:16]))
        self.put(record, ttl, keep=True)
        return record

    @property
    def served_root(self) -> Path | None:
        """The root of the blob store this node serves (`serve_blobs`), or None while it serves none."""
        return None if self._store is None else self._store.root

    def holders(self, sha: str, size: int, providers: Sequence[ProviderRecord] | None = None,
                timeout: float = 10.0) -> list[str]:
        """Peer ids of the other peers that hold all of blob `sha` (`size` bytes) now: each provider (default: those
        the DHT lists) is asked which pieces it holds, since a record may be a download just begun or a peer gone; when
        this node serves a copy itself, each must also send a piece drawn at random that matches that copy's."""
        from skillswarm.protocol.transport.swarm import whole_holders
        from skillswarm.protocol.transport.wire import Source

        if providers is None:
            providers = self.get_providers(sha)
        sources = [Source(p.peer_id, tuple(p.addrs), p.size) for p in providers]
        if not sources:
            return []
        mine = self._store if self._store is not None and self._store.has(sha, size) else None
        return self.run_coroutine(whole_holders, timeout=timeout * 2 + CALL_TIMEOUT, sha=check_sha256(sha), size=size,
                                  sources=sources, per_peer_s=timeout, digests=mine.pieces(sha) if mine else None)

    def served_bytes(self) -> int:
        """Bytes of blobs this node has uploaded to other peers since it started (its provider's counter)."""
        from skillswarm.protocol.transport.provider import provider_stats

        return int(self.run_coroutine(provider_stats)["served_bytes"])

    def unprovide(self, sha: str) -> None:
        """Stop announcing blob `sha` (existing announcements expire on their own)."""
        if self._republisher is not None:
            self._republisher.drop(("record", providers_key(self._net, sha), self.identity.public_key_hex))

    def fetch(self, sha: str, *, size: int | None = None, max_size: int, store: BlobStore | None = None,
              providers: Sequence[str | ProviderRecord] | None = None, progress: bool = True,
              stall_timeout: float = 30.0, min_rate: float | None = None, deadline_s: float | None = None,
              grace_s: float | None = None, tree: str | None = None) -> Path:
        """Download blob `sha` into `store` and return its path there; see `fetch_report`."""
        return Path(self.fetch_report(sha, size=size, max_size=max_size, store=store, providers=providers,
                                      progress=progress, stall_timeout=stall_timeout, min_rate=min_rate,
                                      deadline_s=deadline_s, grace_s=grace_s, tree=tree).path)

    def fetch_report(self, sha: str, *, size: int | None = None, max_size: int, store: BlobStore | None = None,
                     providers: Sequence[str | ProviderRecord] | None = None, progress: bool = True,
                     stall_timeout: float = 30.0, min_rate: float | None = None, deadline_s: float | None = None,
                     grace_s: float | None = None, tree: str | None = None) -> Any:
        """Download blob `sha` (providers: peer ids or ProviderRecords; default: looked up in the DHT),
        verifying its sha256 before it gets its final name, resuming after broken streams, moving on from
        providers that fail, lie or trickle, refusing more than `max_size` bytes or more than `store` has room
        for. With `tree` (the tree hash from the record naming the blob) it downloads from every provider at
        once, verifying each piece (`swarm`). It ends by `deadline_s` (default: `grace_s` + size / `min_rate`,
        from `wire.GRACE_S` and `wire.MIN_RATE`; `max_size` stands for an unknown size). Returns a `FetchReport`."""
        return fetch_one(self, sha, size=size, max_size=max_size, store=store or BlobStore(), providers=providers,
                         progress=progress, stall_timeout=stall_timeout, min_rate=min_rate, deadline_s=deadline_s,
                         grace_s=grace_s, tree=tree)

    def fetch_many(self, items: Iterable[tuple[str, int | None, int]], *, budget_s: float,
                   store: BlobStore | None = None, max_parallel: int = 4, progress: bool = False,
                   min_rate: float | None = None, grace_s: float | None = None,
                   stall_timeout: float = 30.0) -> dict[str, Path | BlobError]:
        """Fetch (sha, size or None, max_size[, tree hash]) items at most `max_parallel` at once, each under its own
        deadline and all within `budget_s` (what is not done by then is stopped); sha -> its Path or its BlobError."""
        return fetch_many(self, items, budget_s=budget_s, store=store or BlobStore(), max_parallel=max_parallel,
                          progress=progress, min_rate=min_rate, grace_s=grace_s, stall_timeout=stall_timeout)
