"""Blob downloads: the fetching half of blob transfer (`wire` holds the wire format and the limits,
`provider` the serving half).

Inside the DHT's background process, `fetch_blob` downloads one blob: it appends to a partial file while
hashing, resumes from the bytes it has when a stream breaks (from the next provider, or the same one on a
later call), and renames the file to its final name only when the sha256 matches. A provider whose bytes
do not match is rejected (bytes from several that fail together are hashed per provider, and a later copy
that verifies names whose range differs); so is one announcing another size, or over `max_size`, and one
dropped twice for slowness. Every fetch has a deadline (`wire.deadline_for` its size unless given), enforced in the
thread that moves its bytes: a stream that averages under the minimum rate once the grace period is over
is dropped (its bytes kept) for the next provider, and when the deadline passes, or `cancel_fetches`
stops it, the fetch ends with a `BlobError` and keeps its partial file for a later resume. Room in the
store is reserved (`BlobStore.reserve`) before the first byte is written.

The caller's side (finding providers, waiting, a round's budget) is `downloads`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import socket
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import hivemind
import msgspec
from hivemind.p2p import PeerID
from hivemind.utils.multiaddr import Multiaddr

from skillswarm.protocol.transport.blobs import BlobStore, PartialDownload, check_sha256, range_digests
from skillswarm.protocol.errors import BlobError
from skillswarm.protocol.transport.streams import open_stream, recv_exact
from skillswarm.protocol.transport.wire import (
    CHUNK, GRACE_S, HANDLER, MIN_RATE, BlobHeader, BlobRequest, FetchReport, Source, frame, frame_length, deadline_for,
)

logger = logging.getLogger(__name__)

_FORGET_CANCELLED_S = 600.0  # how long a cancel waits for a fetch that has not started yet


class _Transient(Exception):
    """This attempt failed (stream broke, provider busy or unreachable); the provider may be tried again."""


class _Slow(_Transient):
    """This stream averaged under the minimum rate after the grace period; its bytes are kept."""


class _Rejected(Exception):
    """This provider must not be asked again during this fetch (unknown blob, wrong size, lying)."""


class _Stopped(Exception):
    """The fetch is out of time: its deadline passed, or it was cancelled."""


class _Missing(_Transient):
    """A provider still downloading the blob does not hold the pieces asked for yet."""


class _Busy(_Transient):
    """A provider serves as many uploads as it allows: ask again later (until the deadline), no blame."""


class _Clock:
    """The limits of one fetch, shared by its coroutine and the thread moving its bytes: the deadline, the
    rate a stream must average after the grace period, and a cancel switch that also wakes a blocked read."""

    def __init__(self, deadline_s: float, min_rate: float, grace_s: float) -> None:
        self.start = time.monotonic()
        self.deadline_s, self.min_rate, self.grace_s = deadline_s, min_rate, grace_s
        self.deadline = self.start + deadline_s
        self.cancelled = ""  # why, once cancelled
        self._socks: set[socket.socket] = set()
        self._lock = threading.Lock()

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def check(self) -> None:
        """Raise `_Stopped` if the fetch was cancelled or its deadline passed."""
        if self.cancelled or self.left() <= 0:
            raise _Stopped

    def watch(self, sock: socket.socket) -> None:
        """`sock` is a stream to shut down on cancel, until `unwatch`."""
        with self._lock:
            self._socks.add(sock)
        self.check()

    def unwatch(self, sock: socket.socket) -> None:
        with self._lock:
            self._socks.discard(sock)

    def cancel(self, why: str) -> None:
        with self._lock:
            self.cancelled = why
        self.hang_up()

    def hang_up(self) -> None:
        """Shut every open stream down (cancelled, or the download needs nothing more from them)."""
        with self._lock:
            for sock in self._socks:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)


class _Room:
    """The room a fetch holds in its store, taken again if a provider announces another size."""

    def __init__(self, store: BlobStore, sha: str) -> None:
        self.store, self.sha, self.size = store, sha, None
        self._held = contextlib.ExitStack()

    def admit(self, size: int) -> None:
        """Reserve room for `size` bytes (`BlobError` if they do not fit), before any of them is written."""
        if size != self.size:
            self.release()
            self._held.enter_context(self.store.reserve(self.sha, size))
            self.size = size

    def release(self) -> None:
        self._held.close()
        self.size = None


class _Sink:
    """Hashes and appends received chunks on a second thread, so receiving the next chunk overlaps them."""

    DEPTH = 8

    def __init__(self, part: PartialDownload) -> None:
        self.part = part
        self._free: queue.Queue[bytearray] = queue.Queue()
        self._full: queue.Queue[tuple[bytearray, int] | None] = queue.Queue()
        for _ in range(self.DEPTH):
            self._free.put(bytearray(CHUNK))
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="blob-sink", daemon=True)

    def __enter__(self) -> _Sink:
        self._thread.start()
        return self

    def _run(self) -> None:
        while (item := self._full.get()) is not None:
            buf, n = item
            try:
                if self._error is None:
                    self.part.append(memoryview(buf)[:n])
            except OSError as e:  # disk full, ...: ends the whole fetch, not just this stream
                self._error = BlobError(f"cannot write {self.part.path}: {e}")
            except Exception as e:  # never leave the receiving thread waiting on a dead sink
                self._error = e
            self._free.put(buf)

    def buffer(self) -> bytearray:
        if self._error is not None:
            raise self._error
        return self._free.get()

    def put(self, buf: bytearray, n: int) -> None:
        self._full.put((buf, n)) if n else self._free.put(buf)

    def __exit__(self, *exc: object) -> None:
        self._full.put(None)
        self._thread.join()
        if self._error is not None and exc[0] is None:
            raise self._error


def _pace(sock: socket.socket, clock: _Clock, opened: float, streamed: int, stall_s: float) -> float:
    """Raise if the fetch is out of time or this stream, open since `opened`, averages under the minimum rate
    after the grace period; else time the next read out when either could first happen. Returns that wait."""
    clock.check()
    now = time.monotonic()
    slow_at = opened + max(clock.grace_s, streamed / clock.min_rate)
    if now >= slow_at:
        raise _Slow(f"sent {streamed:,} bytes in {now - opened:.1f} s, under {clock.min_rate:,.0f} bytes/s")
    wait_s = min(stall_s, clock.deadline - now, slow_at - now)
    sock.settimeout(max(0.001, wait_s))
    return wait_s


def open_request(control_path: str, src: Source, clock: _Clock, stall_s: float) -> tuple[socket.socket, float]:
    """A stream to `src` for one request, watched by `clock` (the caller unwatches and closes it), and when it
    was opened; a stream that cannot open is a transient failure."""
    clock.check()
    opened = time.monotonic()
    try:
        sock = open_stream(control_path, src.peer_id, HANDLER, max(0.01, min(stall_s, clock.left())))
    except OSError as e:
        clock.check()
        raise _Transient(f"cannot open a stream ({e})") from None
    clock.watch(sock)
    sock.settimeout(stall_s)
    return sock, opened


def read_header(sock: socket.socket, clock: _Clock, opened: float) -> BlobHeader:
    """Read a provider's header, which must come within the grace period; refuse an error header."""
    header_by = min(opened + clock.grace_s, clock.deadline)  # a header, too, must not trickle
    try:
        header = msgspec.msgpack.decode(recv_exact(sock, frame_length(recv_exact(sock, 4, header_by)), header_by),
                                        type=BlobHeader)
    except TimeoutError:
        clock.check()
        if time.monotonic() >= opened + clock.grace_s:
            raise _Slow(f"sent no header within {clock.grace_s:g} s") from None
        raise
    if header.error == "busy":
        raise _Busy("busy")
    if header.error == "missing":
        raise _Missing("it does not hold those pieces yet")
    if header.error:
        raise _Rejected(header.error)
    return header


def _receive(control_path: str, src: Source, sha: str, part: PartialDownload, size: int | None, max_size: int,
             stall_s: float, report: FetchReport, clock: _Clock, admit: Callable[[int], None]) -> int:
    """(Worker thread) one request to one provider, appending what it sends to `part` until the blob is
    complete, the stream breaks or turns slow, or the fetch is out of time; returns the blob size."""
    start = part.offset
    sock, opened = open_request(control_path, src, clock, stall_s)
    try:
        sock.sendall(frame(BlobRequest(sha=sha, offset=part.offset)))
        header = read_header(sock, clock, opened)
        expected = size if size is not None else src.size
        if expected is not None and header.size != expected:
            raise _Rejected(f"serves {header.size} bytes where {expected} were announced")
        if header.size > max_size:
            raise _Rejected(f"serves {header.size} bytes, over the {max_size}-byte limit")
        if part.offset > header.size:
            part.reset()
            raise _Transient("the partial download was longer than the blob; restarting it")
        admit(header.size)  # BlobError if it does not fit in the store: nothing is written
        report.size = header.size
        with _Sink(part) as sink:
            received = part.offset
            while received < header.size:
                buf = sink.buffer()
                want, got = min(CHUNK, header.size - received), 0
                try:
                    while got < want:
                        wait_s = _pace(sock, clock, opened, received + got - start, stall_s)
                        try:
                            k = sock.recv_into(memoryview(buf)[got:want])
                        except TimeoutError:
                            if wait_s < stall_s:
                                continue  # the deadline or the rate check is due: the next _pace decides
                            raise _Transient(f"sent nothing for {stall_s:g} s") from None
                        if not k:
                            clock.check()  # a cancel shuts the stream down
                            raise _Transient(f"stream ended at byte {received + got} of {header.size}")
                        got += k
                finally:
                    sink.put(buf, got)  # what arrived before a break is kept: the next stream resumes after it
                received += got
        return header.size
    except (ValueError, msgspec.MsgspecError) as e:
        raise _Rejected(f"sent a malformed header ({e})") from None
    except OSError as e:  # includes timeouts: a stalled provider
        clock.check()
        raise _Transient(f"stream broke at byte {part.offset} ({type(e).__name__}: {e})") from None
    finally:
        clock.unwatch(sock)
        sock.close()
        if part.offset > start:
            report.segments.append((src.peer_id, start, part.offset))
            report.received += part.offset - start


async def _in_thread(fn: Callable[..., Any], *args: Any) -> Any:
    """Run a blocking call in a daemon thread of its own: it ends with the call, and a DHT process that
    shuts down never waits for it."""
    loop = asyncio.get_running_loop()
    done = loop.create_future()

    def settle(value: Any, error: BaseException | None) -> None:
        if not done.done():
            done.set_exception(error) if error is not None else done.set_result(value)

    def run() -> None:
        try:
            value, error = fn(*args), None
        except BaseException as e:
            value, error = None, e
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
            loop.call_soon_threadsafe(settle, value, error)

    threading.Thread(target=run, name="blob-fetch", daemon=True).start()
    return await done


def _running(dht: hivemind.DHT) -> dict[str, Any]:
    """(In the DHT process) token -> the _Clock of a fetch in flight, or (why, when) for one cancelled early."""
    return dht.__dict__.setdefault("_skillswarm_fetches", {})


async def cancel_fetches(dht: hivemind.DHT, _node: hivemind.DHTNode, tokens: list[str], why: str) -> int:
    """(In the DHT process) stop the fetches started with these tokens, and any that starts with one later:
    each ends with a `BlobError` saying `why` and keeps its bytes. Returns how many were running."""
    running, now, stopped = _running(dht), time.monotonic(), 0
    for token, entry in list(running.items()):
        if isinstance(entry, tuple) and entry[1] < now - _FORGET_CANCELLED_S:
            del running[token]
    for token in tokens:
        entry = running.get(token)
        if isinstance(entry, _Clock):
            entry.cancel(why)
            stopped += 1
        else:
            running[token] = (why, now)
    return stopped


async def fetch_blob(
    dht: hivemind.DHT, node: hivemind.DHTNode, sha: str, sources: list[Source], root: str, size: int | None,
    max_size: int, stall_s: float = 30.0, max_attempts: int | None = None, *, deadline_s: float | None = None,
    min_rate: float = MIN_RATE, grace_s: float = GRACE_S, max_bytes: int | None = None, token: str | None = None,
) -> FetchReport:
    """(In the DHT process) download blob `sha` from `sources` into the store at `root` (capped at `max_bytes`)
    within `deadline_s` (default: `deadline_for` its size, or `max_size` if unknown); see the module doc.
    `token` names the fetch for `cancel_fetches`."""
    store = BlobStore(root, max_bytes)
    final = store.path(check_sha256(sha))
    if size is not None and size > max_size:
        raise BlobError(f"blob {sha[:12]} is {size} bytes, over the {max_size}-byte limit")
    if deadline_s is None:
        deadline_s = deadline_for(size if size is not None else max_size, min_rate, grace_s)
    clock = _Clock(deadline_s, min_rate, grace_s)
    with tracked(dht, token, clock, sha):
        return await _fetch(node, sha, sources, store, final, size, max_size, stall_s, max_attempts, clock)


@contextlib.contextmanager
def tracked(dht: hivemind.DHT, token: str | None, clock: _Clock, sha: str) -> Iterator[None]:
    """(In the DHT process) let `cancel_fetches` reach this fetch by its `token` while the block runs; a fetch
    cancelled before it started raises `BlobError` at once."""
    running = _running(dht)
    if token is not None:
        early = running.pop(token, None)
        if isinstance(early, tuple):
            raise BlobError(f"blob {sha[:12]}: {early[0]} before its fetch started")
        running[token] = clock
    try:
        yield
    finally:
        if token is not None:
            running.pop(token, None)


async def _fetch(node: hivemind.DHTNode, sha: str, sources: list[Source], store: BlobStore, final: Path,
                 size: int | None, max_size: int, stall_s: float, max_attempts: int | None, clock: _Clock) -> FetchReport:
    lock_wait = min(max(60.0, stall_s * 4), max(0.0, clock.left()))  # for another fetch of the same blob
    part = await _in_thread(PartialDownload.open, store.partial_path(sha), final, lock_wait)
    if part is None:
        return FetchReport(path=str(final), sha=sha, size=final.stat().st_size, already_present=True)
    report = FetchReport(path=str(final), sha=sha, size=size if size is not None else -1, resumed_from=part.offset)
    control_path = node.p2p.daemon_listen_maddr["unix"]
    me = node.peer_id.to_base58()
    usable = [s for s in sources if s.peer_id != me]
    contributors: set[str] = {"(an earlier fetch)"} if part.offset else set()
    failures: dict[str, int] = {}
    slow: dict[str, int] = {}
    tried: list[str] = []
    suspects: list[tuple[str, int, int, str]] = []  # (peer, start, end, sha256) of attempts that failed verification
    first = len(report.segments)  # this attempt's segments start here
    attempts, budget, mismatches, ok = 0, max_attempts or 3 * len(usable) + 2, 0, False
    room = _Room(store, sha)
    try:
        if size is not None:
            room.admit(size)
        while usable and attempts < budget:
            if clock.cancelled or clock.left() <= 0:
                raise _out_of_time(sha, clock, report, tried, part.offset)
            src = usable[0]  # in the caller's order; a provider that breaks goes to the back of the line
            attempts += 1
            before = part.offset
            if src.peer_id not in tried:
                tried.append(src.peer_id)
            if src.addrs:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(node.p2p._client.connect(PeerID.from_base58(src.peer_id),
                                                                    [Multiaddr(a) for a in src.addrs]),
                                           max(0.01, min(stall_s, clock.left())))
            try:
                total = await _in_thread(_receive, control_path, src, sha, part, size, max_size, stall_s, report,
                                         clock, room.admit)
            except _Stopped:
                raise _out_of_time(sha, clock, report, tried, part.offset) from None
            except _Rejected as e:
                report.rejected[src.peer_id] = str(e)
                usable.remove(src)
                continue
            except _Slow as e:
                logger.debug("blob %s from %s: too slow: %s", sha[:12], src.peer_id[:16], e)
                usable.append(usable.pop(0))
                if part.offset > before:
                    contributors.add(src.peer_id)
                slow[src.peer_id] = slow.get(src.peer_id, 0) + 1
                if slow[src.peer_id] >= 2:
                    report.rejected[src.peer_id] = f"dropped twice as too slow ({e})"
                    usable.remove(src)
                continue
            except _Transient as e:
                logger.debug("blob %s from %s: %s", sha[:12], src.peer_id[:16], e)
                usable.append(usable.pop(0))
                if part.offset > before:  # it delivered something: resume at once, from the next provider
                    contributors.add(src.peer_id)
                    continue
                failures[src.peer_id] = failures.get(src.peer_id, 0) + 1
                if failures[src.peer_id] >= 3:
                    report.rejected[src.peer_id] = str(e)
                    usable.remove(src)
                await asyncio.sleep(min(0.1 * failures[src.peer_id], max(0.0, clock.left())))
                continue
            contributors.add(src.peer_id)
            report.size = total
            if part.hasher.hexdigest() == sha:
                await _in_thread(part.publish, final)
                ok = True
                await _blame_by_ranges(report, suspects, final)
                return report
            # The bytes do not match. A single source is a liar; with several (a resumed download), retry
            # from zero and only blame them all once every provider had its chance.
            mismatches += 1
            blamed = contributors - {"(an earlier fetch)"}
            if len(contributors) == 1 or mismatches > len(sources):
                for peer in blamed:
                    report.rejected[peer] = "sent bytes that do not match the sha256"
                usable = [s for s in usable if s.peer_id not in blamed]
            else:  # keep what each one sent: once a download verifies, the ranges that differ name the liar
                ranges = [seg for seg in report.segments[first:] if seg[2] > seg[1]]
                digests = await _in_thread(range_digests, part.path, [(a, b) for _, a, b in ranges])
                suspects += [(peer, a, b, d) for (peer, a, b), d in zip(ranges, digests)]
            part.reset()
            contributors.clear()
            first = len(report.segments)
        reasons = "; ".join(f"{peer[:20]}...: {why}" for peer, why in report.rejected.items())
        if not usable and not report.rejected:
            reasons = "no provider is known" if not sources else "no provider besides this node"
        if slow:
            raise _out_of_time(sha, clock, report, tried, part.offset, why=f"no provider delivered it ({reasons})")
        raise BlobError(f"could not fetch blob {sha[:12]} ({reasons or 'every provider failed; try again later'})")
    finally:
        room.release()
        part.close(remove=not ok and part.offset == 0)


async def _blame_by_ranges(report: FetchReport, suspects: list[tuple[str, int, int, str]], final: Path) -> None:
    """Name as rejected each provider of an attempt that failed verification whose bytes differ from the
    verified blob's at the same range (a liar that sent bad bytes and then dropped, leaving the rest to others)."""
    if not suspects:
        return
    digests = await _in_thread(range_digests, final, [(a, b) for _, a, b, _ in suspects])
    for (peer, a, b, sent), good in zip(suspects, digests):
        if sent != good:
            report.rejected[peer] = f"sent bytes that do not match the sha256 (bytes {a}-{b} differ from the verified blob)"


def _out_of_time(sha: str, clock: _Clock, report: FetchReport, tried: list[str], held: int,
                 why: str | None = None) -> BlobError:
    """The error of a fetch that ran out of time, was stopped, or found only slow providers: what arrived,
    in how long, from whom, against the minimum rate, and what happens to the bytes."""
    got = dict.fromkeys(tried, 0)
    for peer, start, end in report.segments:
        got[peer] = got.get(peer, 0) + end - start
    who = ", ".join(f"{peer[:20]}... ({n:,} bytes)" for peer, n in got.items()) or "no provider"
    of = f" of {report.size:,}" if report.size >= 0 else ""
    kept = (f"the {held:,} bytes it holds are kept for a later fetch to resume from" if held
            else "no bytes are kept")
    hint = "" if clock.cancelled else "; to allow slower providers, pass a lower min_rate= or a longer deadline_s="
    why = why or clock.cancelled or f"its {clock.deadline_s:g} s deadline passed"
    return BlobError(f"blob {sha[:12]}: {why}: {report.received:,}{of} bytes arrived in "
                     f"{time.monotonic() - clock.start:.1f} s from {who}, and the minimum rate is "
                     f"{clock.min_rate:,.0f} bytes/s; {kept}{hint}")
