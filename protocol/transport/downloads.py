"""The caller's side of blob downloads: what `SwarmDHT.fetch_report` and `SwarmDHT.fetch_many` run.

`fetch_one` finds the providers (`SwarmDHT.get_providers`: at most `observed.MAX_PROVIDERS`, in the order this
node's own observations give, never by what the records claim), refuses a blob the store has no room for
before any byte moves, starts the download in the DHT process under its deadline (GRACE_S + size / MIN_RATE
unless given) and waits for it: `swarm.fetch_pieces` (every provider at once, piece by piece) when the
caller knows the blob's tree hash, else `fetcher.fetch_blob` (one provider at a time, the first of them to
answer); if the caller stops waiting, the fetch is cancelled there too. Either way the DHT process notes what
each provider did (`observed.Observed`), for the order of the next downloads. `fetch_many` runs a round's
fetches concurrently under one time budget: what is not done when the budget ends is cancelled, keeps its
bytes for a later resume, and comes back as a `BlobError`, like every other failed blob.
"""

from __future__ import annotations

import logging
import math
import threading
import time
import uuid
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any, Callable, Iterable, Protocol, Sequence

from skillswarm.protocol.transport.blobs import BlobStore, check_sha256, held_bytes
from skillswarm.protocol.errors import BlobError, NetworkError
from skillswarm.protocol.transport.fetcher import cancel_fetches, fetch_blob
from skillswarm.protocol.transport.observed import observed
from skillswarm.protocol.progress import PartialProgress
from skillswarm.protocol.records import ProviderRecord
from skillswarm.protocol.transport.swarm import add_sources, fetch_pieces
from skillswarm.protocol.transport.wire import GRACE_S, MIN_RATE, FetchReport, Source, deadline_for

logger = logging.getLogger(__name__)

Item = tuple  # (sha, size or None when unknown, max_size[, tree hash or None])
ANNOUNCE_TTL_S = 120.0  # a download's provider record: short, so one left by a failed download soon expires
REFRESH_S = 3.0  # how often a piece-by-piece download re-reads who provides the blob, so late announcers join


class DownloadHost(Protocol):
    """What a download needs of the node's DHT peer (`dht.SwarmDHT` is one): calls into its DHT process, its
    provider records and what it serves. A protocol, so this module never imports the DHT wrapper that calls it."""

    @property
    def is_running(self) -> bool: ...

    @property
    def served_root(self) -> Path | None: ...

    def submit(self, fn: Callable[..., Any], kwargs: dict) -> Future: ...

    def wait_for(self, future: Future, timeout: float | None, tick: Callable[[], None] | None = None) -> Any: ...

    def run_coroutine(self, fn: Callable[..., Any], timeout: float | None = ..., **kwargs: Any) -> Any: ...

    def get_providers(self, sha: str, *, limit: int | None = None) -> list[ProviderRecord]: ...

    def announce_blob(self, sha: str, size: int, ttl: float = ...) -> ProviderRecord: ...

    def unprovide(self, sha: str) -> None: ...


def _limits(min_rate: Any, deadline_s: Any, grace_s: Any, stall_timeout: Any) -> tuple[float, float]:
    """`min_rate` and `grace_s` with their defaults, once every limit given is checked to be a positive number."""
    for name, value in (("min_rate", min_rate), ("deadline_s", deadline_s), ("grace_s", grace_s),
                        ("stall_timeout", stall_timeout)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                  or not math.isfinite(value) or value <= 0):
            unit = "bytes/s" if name == "min_rate" else "seconds"
            raise BlobError(f"{name}={value!r}: give a positive number of {unit}")
    return float(MIN_RATE if min_rate is None else min_rate), float(GRACE_S if grace_s is None else grace_s)


def _byte_count(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise BlobError(f"{name}={value!r}: give a number of bytes (a whole number, 0 or more)")


def fetch_one(dht: DownloadHost, sha: str, *, size: int | None, max_size: int, store: BlobStore,
              providers: Sequence[str | ProviderRecord] | None, progress: bool, stall_timeout: float,
              min_rate: float | None, deadline_s: float | None, grace_s: float | None,
              token: str | None = None, tree: str | None = None) -> FetchReport:
    """Download one blob through `dht` (see `SwarmDHT.fetch_report`); `token` names the fetch for
    `fetcher.cancel_fetches`; with `tree` (its tree hash) from every provider at once."""
    check_sha256(sha)
    if tree is not None:
        try:
            check_sha256(tree)
        except BlobError:
            raise BlobError(f"tree={tree!r} is not a tree hash (64 lower-case hex characters); give the "
                            "`tree` of the record that names the blob, or None") from None
    if size is not None:
        _byte_count("size", size)
    if store.has(sha, size):  # checked, not only present: a bad copy is deleted and fetched again
        return FetchReport(path=str(store.path(sha)), sha=sha, size=store.size(sha), already_present=True)
    min_rate, grace_s = _limits(min_rate, deadline_s, grace_s, stall_timeout)
    _byte_count("max_size", max_size)
    token = token or uuid.uuid4().hex
    refresh = providers is None and tree is not None  # a list the caller gave is the whole list
    if providers is None:
        providers = dht.get_providers(sha)
    sources = [Source(p) if isinstance(p, str) else Source(p.peer_id, tuple(p.addrs), p.size) for p in providers]
    if size is None:
        sizes = {s.size for s in sources if s.size is not None}
        size = sizes.pop() if len(sizes) == 1 else None
    if size is not None and size <= max_size:
        store.check_room(size, sha)  # refused before any byte moves (the DHT process checks again)
    if deadline_s is None:
        deadline_s = deadline_for(size if size is not None else max_size, min_rate, grace_s)
    # the peer's own submit and wait: one pipe to the DHT process, one waiting loop
    args = dict(sha=sha, sources=sources, root=str(store.root), size=size, max_size=max_size, stall_s=stall_timeout,
                deadline_s=deadline_s, min_rate=min_rate, grace_s=grace_s, max_bytes=store.max_bytes, token=token)
    announced = _announce_download(dht, sha, size, store, tree)
    future = dht.submit(fetch_blob, args) if tree is None else dht.submit(_fetch_pieces, {**args, "tree": tree})
    try:
        with PartialProgress(store.partial_path(sha), size, f"blob {sha[:12]}", enabled=progress) as bar:
            # The DHT process keeps the deadline; this wait only backs it up.
            tick = _refresher(dht, sha, store, bar.update) if refresh else bar.update
            return dht.wait_for(future, deadline_s + stall_timeout + 30, tick=tick)
    except BlobError:
        if announced and not store.has(sha):
            dht.unprovide(sha)
        raise
    except BaseException:  # the caller stopped waiting (interrupted, or no answer): stop the bytes too
        _cancel(dht, [token], "its caller stopped waiting")
        if announced and not store.has(sha):
            dht.unprovide(sha)
        raise


async def _fetch_pieces(dht: Any, node: Any, **kwargs: Any) -> FetchReport:
    """(In the DHT process) `swarm.fetch_pieces`, noting what each provider did in this node's `Observed`."""
    started = time.monotonic()
    report = await fetch_pieces(dht, node, **kwargs)
    seen, took = observed(dht), time.monotonic() - started
    sent: dict[str, int] = {}
    for peer, start, end in report.segments:
        sent[peer] = sent.get(peer, 0) + end - start
    for peer, n in sent.items():
        if peer not in report.rejected:
            seen.delivered(peer, n, took)
    for peer in report.rejected:
        seen.failed(peer)
    return report


def _refresher(dht: DownloadHost, sha: str, store: BlobStore, update: Any) -> Any:
    """A wait loop's tick: `update` the progress and, every REFRESH_S, hand the download in flight the providers
    the DHT lists now (nodes that started pulling the blob after it did serve the pieces they hold)."""
    last = time.monotonic()

    def tick() -> None:
        nonlocal last
        update()
        if time.monotonic() - last < REFRESH_S:
            return
        last = time.monotonic()
        try:
            found = [Source(p.peer_id, tuple(p.addrs), p.size) for p in dht.get_providers(sha)]
            dht.submit(add_sources, dict(root=str(store.root), sha=sha, sources=found))  # no need to wait for it
        except Exception:  # a DHT hiccup must not stop the download itself
            logger.debug("could not re-read the providers of blob %s", sha[:12], exc_info=True)

    return tick


def _announce_download(dht: DownloadHost, sha: str, size: int | None, store: BlobStore, tree: str | None) -> bool:
    """A node that serves the store it downloads into announces itself as a provider of a blob it fetches
    piece by piece as the download starts, so other fetchers take the pieces it holds from it (a checkpoint
    spreads from every worker pulling it, not from its coordinator alone). True if it did."""
    if tree is None or size is None or dht.served_root != store.root:
        return False
    try:
        dht.announce_blob(sha, size, ANNOUNCE_TTL_S)
    except Exception:  # a DHT hiccup must not stop the download itself
        logger.debug("could not announce blob %s while fetching it", sha[:12], exc_info=True)
        return False
    return True


def _cancel(dht: DownloadHost, tokens: list[str], why: str) -> None:
    try:
        dht.run_coroutine(cancel_fetches, timeout=10, tokens=tokens, why=why)
    except Exception:  # the DHT process is gone or not answering: nothing is left to stop
        logger.debug("could not cancel %d fetches", len(tokens), exc_info=True)


def _items(items: Iterable[Item]) -> list[Item]:
    """The items as (sha, size, max_size, tree) tuples, each sha once; `BlobError` if they are not such tuples."""
    wanted: dict[str, Item] = {}
    try:
        for item in items:
            sha, size, max_size, tree = item if len(item) == 4 else (*item, None)
            if not isinstance(sha, str):
                raise TypeError
            wanted.setdefault(sha, (sha, size, max_size, tree))
    except (TypeError, ValueError):
        raise BlobError("fetch_many takes (sha, size or None, max_size) tuples, or (sha, size, max_size, tree hash) "
                        "ones to fetch from every provider at once, e.g. [(delta.blob, delta.size, 1 << 30)]") from None
    return list(wanted.values())


def fetch_many(dht: DownloadHost, items: Iterable[Item], *, budget_s: float, store: BlobStore, max_parallel: int = 4,
               progress: bool = False, min_rate: float | None = None, grace_s: float | None = None,
               stall_timeout: float = 30.0) -> dict[str, Path | BlobError]:
    """Fetch `items` through `dht`, at most `max_parallel` at once, all within `budget_s` (see
    `SwarmDHT.fetch_many`). Never raises for one blob: each sha maps to its Path or its BlobError."""
    wanted = _items(items)
    if isinstance(budget_s, bool) or not isinstance(budget_s, (int, float)) or not 0 < budget_s < math.inf:
        raise BlobError(f"budget_s={budget_s!r}: give the round's fetch budget as a positive number of seconds")
    if isinstance(max_parallel, bool) or not isinstance(max_parallel, int) or max_parallel < 1:
        raise BlobError(f"max_parallel={max_parallel!r}: give how many fetches may run at once (1 or more)")
    _limits(min_rate, None, grace_s, stall_timeout)
    if not dht.is_running:
        raise NetworkError("the DHT peer is not running; call start() first")
    why = f"the round's fetch budget of {budget_s:g} s ran out"
    end = time.monotonic() + budget_s
    tokens = {item[0]: uuid.uuid4().hex for item in wanted}
    stop = threading.Event()

    def one(sha: str, size: int | None, max_size: int, tree: str | None) -> Path:
        if stop.is_set():
            raise BlobError(f"blob {sha[:12]}: {why} before its fetch started")
        return Path(fetch_one(dht, sha, size=size, max_size=max_size, store=store, providers=None, progress=False,
                              stall_timeout=stall_timeout, min_rate=min_rate, deadline_s=None, grace_s=grace_s,
                              token=tokens[sha], tree=tree).path)

    pool = ThreadPoolExecutor(max_workers=max_parallel, thread_name_prefix="fetch-many")
    futures = {pool.submit(one, *item): item[0] for item in wanted}
    try:
        with _RoundProgress(store, [item[0] for item in wanted], [item[1] for item in wanted], progress) as bar:
            pending = set(futures)
            while pending and (left := end - time.monotonic()) > 0:
                _, pending = wait(pending, timeout=min(0.2, left), return_when=FIRST_COMPLETED)
                bar.update()
    finally:
        stop.set()
        late = [f for f in futures if not f.done()]
        pool.shutdown(wait=False, cancel_futures=True)
        if late:
            _cancel(dht, [tokens[futures[f]] for f in late], why)
            wait(late, timeout=5)  # stopped fetches answer within a poll or two; their errors say what arrived
    return {sha: _outcome(f, sha, why) for f, sha in futures.items()}


def _outcome(future: Future, sha: str, why: str) -> Path | BlobError:
    if not future.done() or future.cancelled():
        return BlobError(f"blob {sha[:12]}: {why} before it arrived; the bytes received are kept for a later fetch")
    error = future.exception()
    if error is None:
        return future.result()
    return error if isinstance(error, BlobError) else BlobError(f"blob {sha[:12]}: {error}")


class _RoundProgress(PartialProgress):
    """One bar for a round's downloads: the bytes their partial and finished files hold."""

    def __init__(self, store: BlobStore, shas: list[str], sizes: list[int | None], enabled: bool) -> None:
        total = None if None in sizes else sum(s for s in sizes if s is not None)
        super().__init__(store.root, total, f"{len(shas)} blobs", enabled)
        self.store, self.shas = store, shas

    def update(self) -> None:
        """Show how many bytes the round's files hold now."""
        if self._progress is not None:
            self._progress.update(self._task, completed=sum(_held(self.store, sha) for sha in self.shas))


def _held(store: BlobStore, sha: str) -> int:
    for path in (store.path, store.partial_path):
        try:
            return held_bytes(path(sha).stat())
        except (FileNotFoundError, BlobError):
            continue
    return 0
