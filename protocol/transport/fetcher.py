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

Which provider sends the bytes is a race (`_first_answer`): the providers are asked in line, each STAGGER_S
after the one before (at once when one fails), up to RACE_WIDTH waiting at a time, and each must be dialled and
send its header within ANSWER_S; the first to answer streams, the other streams are closed. The first in line,
if it answers at once, is the only one asked; records for addresses that swallow dials or peers that never
answer cost side by side what one of them costs, not one after the other. The line is the caller's order, or
this node's own: `Observed` keeps what each provider did here (delivered bytes and how fast, failed, lied), and
`SwarmDHT.get_providers` lists providers by it (`provider_order`), never by what their records claim.

The caller's side (finding providers, waiting, a round's budget) is `downloads`; reading one stream is
`receiving`, the order of providers `observed`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
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
from skillswarm.protocol.transport.observed import Observed, observed
from skillswarm.protocol.transport.receiving import (
    Busy, check_header, Clock, Missing, receive, Rejected, Room, Slow, Stopped, Transient, open_request,
    read_header,
)
from skillswarm.protocol.transport.wire import (
    GRACE_S, MIN_RATE, BlobHeader, BlobRequest, FetchReport, Source, frame, deadline_for,
)

logger = logging.getLogger(__name__)

_FORGET_CANCELLED_S = 600.0  # how long a cancel waits for a fetch that has not started yet
# Providers are asked in the order `Observed` gives (what this node saw them do, never what a record claims):
ANSWER_S = 10.0  # a provider must be dialled, open a stream and send its header within this (or the stall time)
STAGGER_S = 0.25  # the head start each provider in line gets before the next one is asked too
RACE_WIDTH = 32  # providers waiting for an answer at a time





_Answer = tuple[socket.socket, float, BlobHeader]  # a provider's stream, when it opened, and its header


class _Lost(Exception):
    """Another provider answered first: this stream is no longer wanted."""


class _Race:
    """The streams of one race (`_first_answer`): each asked provider's, until one answers. Its end shuts every
    other stream down (a thread blocked reading one wakes, closes it and gives up) and closes those that answered
    too late to win (their threads have returned them)."""

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self.over = False
        self._lock = threading.Lock()
        self._open: set[socket.socket] = set()
        self._answered: list[socket.socket] = []

    def opened(self, sock: socket.socket) -> bool:
        """A stream was opened for the race: False if the race is over (the caller closes it)."""
        with self._lock:
            if not self.over:
                self._open.add(sock)
            return not self.over

    def answered(self, sock: socket.socket) -> bool:
        """Its provider answered: False if the race is over (the caller closes it); else the race holds it now."""
        with self._lock:
            self._open.discard(sock)
            if self.over:
                return False
            self._answered.append(sock)
            return True

    def forget(self, sock: socket.socket) -> None:
        """The stream's own thread closes it (it failed)."""
        with self._lock:
            self._open.discard(sock)

    def end(self, winner: socket.socket | None = None) -> None:
        """Keep `winner`'s stream; shut down the streams still waiting for an answer and close those answered."""
        with self._lock:
            if self.over:
                return
            self.over = True
            for sock in self._open:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
            for sock in self._answered:
                if sock is not winner:
                    self.clock.unwatch(sock)
                    sock.close()


def _answer(control_path: str, src: Source, sha: str, offset: int, size: int | None, max_size: int, clock: Clock,
            stall_s: float, answer_s: float, race: _Race) -> _Answer:
    """(Worker thread) ask one provider for the blob's bytes from `offset`: open a stream, send the request, read
    a header that suits the download and see the first byte after it arrive, all within `answer_s` (a provider's
    bytes follow its header at once: one that sends a header and then nothing does not win a race); returns the
    stream, when it opened, and the header. Raises as `receive` does, or `_Lost` once another provider won."""
    started = time.monotonic()
    sock, opened = open_request(control_path, src, clock, min(stall_s, answer_s))
    try:
        if not race.opened(sock):
            raise _Lost
        sock.sendall(frame(BlobRequest(sha=sha, offset=offset)))
        header = read_header(sock, clock, opened, within=max(0.05, started + answer_s - opened))
        check_header(header, src, size, max_size)
        if header.size > offset:
            sock.settimeout(max(0.001, min(started + answer_s - time.monotonic(), clock.left())))
            try:
                if not sock.recv(1, socket.MSG_PEEK):
                    raise Transient("its stream ended after the header")
            except TimeoutError:
                clock.check()
                raise Slow(f"sent a header and no byte after it within {answer_s:.3g} s") from None
            sock.settimeout(stall_s)
        if not race.answered(sock):
            raise _Lost
        return sock, opened, header
    except BaseException as e:
        race.forget(sock)
        clock.unwatch(sock)
        sock.close()
        if isinstance(e, (ValueError, msgspec.MsgspecError)):
            raise Rejected(f"sent a malformed header ({e})") from None
        if isinstance(e, OSError):  # includes timeouts, and a stream the race's end shut down
            clock.check()
            if race.over:
                raise _Lost from None
            raise Transient(f"did not answer ({type(e).__name__}: {e})") from None
        raise


async def _attempt(node: hivemind.DHTNode, control_path: str, src: Source, sha: str, offset: int, size: int | None,
                   max_size: int, clock: Clock, stall_s: float, race: _Race) -> _Answer:
    """Dial one provider at the addresses it announced, then `_answer`: both within ANSWER_S (or the stall time)."""
    started = time.monotonic()
    answer_s = min(ANSWER_S, stall_s)
    if src.addrs:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(node.p2p._client.connect(PeerID.from_base58(src.peer_id),
                                                            [Multiaddr(a) for a in src.addrs]),
                                   max(0.01, min(answer_s, clock.left())))
    clock.check()
    left = answer_s - (time.monotonic() - started)
    if left <= 0:
        raise Transient(f"could not be reached within {answer_s:g} s")
    return await in_thread(_answer, control_path, src, sha, offset, size, max_size, clock, stall_s, left, race)


async def _first_answer(node: hivemind.DHTNode, control_path: str, order: list[Source], sha: str, offset: int,
                        size: int | None, max_size: int, clock: Clock, stall_s: float, tried: list[str],
                        failed: list[tuple[Source, BaseException]]
                        ) -> tuple[Source, socket.socket, float, BlobHeader] | None:
    """Ask the providers of `order` for the blob, each STAGGER_S after the one before it (at once when one fails),
    at most RACE_WIDTH waiting for an answer at a time, until one answers with a header that suits the download:
    that provider, its stream, when it opened and the header; None if none did. So a provider that answers is
    never kept waiting behind addresses that swallow dials or peers that never answer (each costs at most
    ANSWER_S, side by side), and the first in line, when it answers at once, is the only one asked. Each that
    fails is added to `failed` with its error, each asked to `tried`; `Stopped` when the fetch is out of time."""
    race = _Race(clock)
    asked: dict[asyncio.Future, Source] = {}
    waiting = list(order)
    next_at = time.monotonic()
    stopped: Stopped | None = None
    try:
        while waiting or asked:
            clock.check()
            now = time.monotonic()
            if waiting and len(asked) < RACE_WIDTH and now >= next_at:
                src = waiting.pop(0)
                if src.peer_id not in tried:
                    tried.append(src.peer_id)
                asked[asyncio.ensure_future(_attempt(node, control_path, src, sha, offset, size, max_size, clock,
                                                     stall_s, race))] = src
                next_at = now + STAGGER_S
                continue
            wait_s = 0.2 if not waiting or len(asked) >= RACE_WIDTH else min(0.2, max(0.0, next_at - now))
            if not asked:
                await asyncio.sleep(wait_s)
                continue
            done, _ = await asyncio.wait(list(asked), timeout=wait_s, return_when=asyncio.FIRST_COMPLETED)
            won = None
            for future in sorted(done, key=lambda f: order.index(asked[f])):  # the earlier in line, if several
                src = asked.pop(future)
                error = future.exception()
                if error is None:
                    won = won or (src, *future.result())  # a later one's stream is closed by the race's end
                elif isinstance(error, Stopped):
                    stopped = error
                else:
                    failed.append((src, error))
                next_at = time.monotonic()  # a place is free: ask the next one now
            if won is not None:
                race.end(winner=won[1])
                return won
            if stopped is not None:
                raise stopped
        return None
    finally:
        race.end()
        for future in asked:
            if not future.cancel() and not future.cancelled():
                future.exception()  # finished meanwhile: its error is retrieved, not logged as lost


async def in_thread(fn: Callable[..., Any], *args: Any) -> Any:
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
    """(In the DHT process) token -> the Clock of a fetch in flight, or (why, when) for one cancelled early."""
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
        if isinstance(entry, Clock):
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
    clock = Clock(deadline_s, min_rate, grace_s)
    with tracked(dht, token, clock, sha):
        return await _fetch(node, observed(dht), sha, sources, store, final, size, max_size, stall_s, max_attempts,
                            clock)


@contextlib.contextmanager
def tracked(dht: hivemind.DHT, token: str | None, clock: Clock, sha: str) -> Iterator[None]:
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


async def _fetch(node: hivemind.DHTNode, seen: Observed, sha: str, sources: list[Source], store: BlobStore,
                 final: Path, size: int | None, max_size: int, stall_s: float, max_attempts: int | None,
                 clock: Clock) -> FetchReport:
    lock_wait = min(max(60.0, stall_s * 4), max(0.0, clock.left()))  # for another fetch of the same blob
    part = await in_thread(PartialDownload.open, store.partial_path(sha), final, lock_wait)
    if part is None:
        return FetchReport(path=str(final), sha=sha, size=final.stat().st_size, already_present=True)
    report = FetchReport(path=str(final), sha=sha, size=size if size is not None else -1, resumed_from=part.offset)
    control_path = node.p2p.daemon_listen_maddr["unix"]
    me = node.peer_id.to_base58()
    usable = list({s.peer_id: s for s in sources if s.peer_id != me}.values())  # each once
    contributors: set[str] = {"(an earlier fetch)"} if part.offset else set()
    failures: dict[str, int] = {}
    slow: dict[str, int] = {}
    tried: list[str] = []
    suspects: list[tuple[str, int, int, str]] = []  # (peer, start, end, sha256) of attempts that failed verification
    first = len(report.segments)  # this attempt's segments start here
    attempts, budget, mismatches, ok, rounds = 0, max_attempts or 3 * len(usable) + 2, 0, False, 0
    room = Room(store, sha)

    def drop(src: Source, why: str) -> None:
        report.rejected[src.peer_id] = why
        if src in usable:
            usable.remove(src)

    def to_back(src: Source) -> None:  # a provider that fails or breaks goes to the back of the line
        if src in usable:
            usable.remove(src)
            usable.append(src)

    def unanswered(src: Source, e: BaseException) -> None:
        """A provider asked in a race did not answer with a header that suits the download."""
        logger.debug("blob %s from %s: %s", sha[:12], src.peer_id[:16], e)
        if isinstance(e, Rejected):
            seen.failed(src.peer_id)
            drop(src, str(e))
        elif isinstance(e, Slow):
            seen.failed(src.peer_id)
            slow[src.peer_id] = slow.get(src.peer_id, 0) + 1
            drop(src, f"dropped twice as too slow ({e})") if slow[src.peer_id] >= 2 else to_back(src)
        elif isinstance(e, Transient):
            if not isinstance(e, (Busy, Missing)):  # busy, or still downloading it: no blame
                seen.failed(src.peer_id)
            failures[src.peer_id] = failures.get(src.peer_id, 0) + 1
            drop(src, str(e)) if failures[src.peer_id] >= 3 else to_back(src)
        elif not isinstance(e, _Lost):
            raise e

    try:
        if size is not None:
            room.admit(size)
        while usable and attempts < budget:
            if clock.cancelled or clock.left() <= 0:
                raise out_of_time(sha, clock, report, tried, part.offset)
            # In this node's order (`Observed`, or the caller's); the first to answer sends the bytes.
            failed: list[tuple[Source, BaseException]] = []
            try:
                won = await _first_answer(node, control_path, usable[:budget - attempts], sha, part.offset, size,
                                          max_size, clock, stall_s, tried, failed)
            except Stopped:
                raise out_of_time(sha, clock, report, tried, part.offset) from None
            finally:
                attempts += len(failed)
                for src, e in failed:
                    unanswered(src, e)
            if won is None:
                rounds += 1
                await asyncio.sleep(min(0.1 * rounds, 1.0, max(0.0, clock.left())))
                continue
            src, sock, opened, header = won
            attempts += 1
            before = part.offset
            try:
                total = await in_thread(receive, sock, opened, header, src, part, stall_s, report, clock, room.admit)
            except Stopped:
                raise out_of_time(sha, clock, report, tried, part.offset) from None
            except Slow as e:
                logger.debug("blob %s from %s: too slow: %s", sha[:12], src.peer_id[:16], e)
                seen.failed(src.peer_id)
                to_back(src)
                if part.offset > before:
                    contributors.add(src.peer_id)
                slow[src.peer_id] = slow.get(src.peer_id, 0) + 1
                if slow[src.peer_id] >= 2:
                    drop(src, f"dropped twice as too slow ({e})")
                continue
            except Transient as e:
                logger.debug("blob %s from %s: %s", sha[:12], src.peer_id[:16], e)
                to_back(src)
                if part.offset > before:  # it delivered something: resume at once, from the next provider
                    seen.delivered(src.peer_id, part.offset - before, time.monotonic() - opened)
                    contributors.add(src.peer_id)
                    continue
                seen.failed(src.peer_id)
                failures[src.peer_id] = failures.get(src.peer_id, 0) + 1
                if failures[src.peer_id] >= 3:
                    drop(src, str(e))
                await asyncio.sleep(min(0.1 * failures[src.peer_id], max(0.0, clock.left())))
                continue
            seen.delivered(src.peer_id, part.offset - before, time.monotonic() - opened)
            contributors.add(src.peer_id)
            report.size = total
            if part.hasher.hexdigest() == sha:
                await in_thread(part.publish, final)
                ok = True
                await _blame_by_ranges(report, suspects, final)
                for peer in {peer for peer, _, _, _ in suspects if peer in report.rejected}:
                    seen.failed(peer, lied=True)
                return report
            # The bytes do not match. A single source is a liar; with several (a resumed download), retry
            # from zero and only blame them all once every provider had its chance.
            mismatches += 1
            blamed = contributors - {"(an earlier fetch)"}
            if len(contributors) == 1 or mismatches > len(sources):
                for peer in blamed:
                    report.rejected[peer] = "sent bytes that do not match the sha256"
                    seen.failed(peer, lied=True)
                usable = [s for s in usable if s.peer_id not in blamed]
            else:  # keep what each one sent: once a download verifies, the ranges that differ name the liar
                ranges = [seg for seg in report.segments[first:] if seg[2] > seg[1]]
                digests = await in_thread(range_digests, part.path, [(a, b) for _, a, b in ranges])
                suspects += [(peer, a, b, d) for (peer, a, b), d in zip(ranges, digests)]
            part.reset()
            contributors.clear()
            first = len(report.segments)
        reasons = "; ".join(f"{peer[:20]}...: {why}" for peer, why in report.rejected.items())
        if not usable and not report.rejected:
            reasons = "no provider is known" if not sources else "no provider besides this node"
        if slow:
            raise out_of_time(sha, clock, report, tried, part.offset, why=f"no provider delivered it ({reasons})")
        raise BlobError(f"could not fetch blob {sha[:12]} ({reasons or 'every provider failed; try again later'})")
    finally:
        room.release()
        part.close(remove=not ok and part.offset == 0)


async def _blame_by_ranges(report: FetchReport, suspects: list[tuple[str, int, int, str]], final: Path) -> None:
    """Name as rejected each provider of an attempt that failed verification whose bytes differ from the
    verified blob's at the same range (a liar that sent bad bytes and then dropped, leaving the rest to others)."""
    if not suspects:
        return
    digests = await in_thread(range_digests, final, [(a, b) for _, a, b, _ in suspects])
    for (peer, a, b, sent), good in zip(suspects, digests):
        if sent != good:
            report.rejected[peer] = f"sent bytes that do not match the sha256 (bytes {a}-{b} differ from the verified blob)"


def out_of_time(sha: str, clock: Clock, report: FetchReport, tried: list[str], held: int,
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
