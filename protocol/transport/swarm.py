"""Swarming downloads: one blob from every provider at once, piece by piece, each piece verified on arrival.

Used when the caller knows the blob's tree hash from a trusted record (`FileEntry.tree`; see `pieces`).
The piece list comes from any provider and is checked against the tree hash first (a provider whose list
does not match is rejected). Then one thread per provider asks for runs of missing pieces (a ranged
`BlobRequest`), receives each piece into memory, hashes it, and only a piece that matches the list is
written, in place, to the partial file: a provider that sends a bad piece is rejected and its pieces go
to the others, while every verified piece stays, whoever sent it. When no piece is left unclaimed, idle
providers duplicate the slowest claims (endgame), so one slow provider cannot hold the last pieces.

A hash cursor folds the verified pieces, in order, into the whole blob's sha256, which must match before
the file gets its final name (the rename is all-or-nothing, as in `fetcher`). A partial file keeps its
piece list beside it, so a later fetch resumes with every intact piece (`pieces.held_pieces`). Deadlines,
the minimum rate, cancellation and the store's room work as in `fetcher`, whose helpers this module uses;
the local bookkeeping (claims, verified writes, the hash cursor) is `assembly`.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import random
import threading
import time
from pathlib import Path

import hivemind
import msgspec
from hivemind.p2p import PeerID
from hivemind.utils.multiaddr import Multiaddr

from skillswarm.protocol.atomic import atomic_write_bytes
from skillswarm.protocol.errors import BlobError
from skillswarm.protocol.transport.assembly import Assembly, Checker, PieceFile, partials, publish
from skillswarm.protocol.transport.blobs import BlobStore, check_sha256
from skillswarm.protocol.transport.fetcher import in_thread, out_of_time, tracked
from skillswarm.protocol.transport.receiving import (
    Busy, Clock, Missing, pace, Rejected, Room, Slow, Stopped, Transient, open_request, read_header,
)
from skillswarm.protocol.transport.pieces import (
    DIGEST, check_piece_list, held_pieces, piece_count, piece_span, unpack_bits,
)
from skillswarm.protocol.transport.streams import open_stream, recv_exact
from skillswarm.protocol.transport.wire import (
    GRACE_S, HANDLER, MIN_RATE, BlobHeader, BlobRequest, FetchReport, Source, deadline_for, frame, frame_length,
)

logger = logging.getLogger(__name__)

_FAILURES = 3  # attempts in a row that deliver nothing before a provider is dropped
OFFER_POLL_S = 1.0  # how often a provider still downloading the blob is asked again what it holds
MAX_SOURCES = 8  # providers one download takes pieces from at a time


def _stream(control_path: str, src: Source, swarm: Assembly, run: list[int], stall_s: float) -> None:
    """(Worker thread) one ranged request for a run of pieces to one provider; every piece that arrives
    whole is checked and, if good, written. Ends early, without error, once others hold the rest of the run."""
    clock, size = swarm.clock, swarm.size
    start, end = piece_span(run[0], size)[0], piece_span(run[-1], size)[1]
    sock, opened = open_request(control_path, src, clock, stall_s)
    streamed = 0
    try:
        sock.sendall(frame(BlobRequest(sha=swarm.sha, offset=start, end=end)))
        header = read_header(sock, clock, opened)
        if header.size != size:
            raise Rejected(f"serves {header.size} bytes where {size} were announced")
        with Checker(swarm, src.peer_id) as checker:
            for i in run:
                if swarm.is_done(i):
                    return  # another provider delivered it (endgame): drop this stream, claim afresh
                a, b = piece_span(i, size)
                buf, got = checker.buffer(), 0
                try:
                    while got < b - a:
                        wait_s = pace(sock, clock, opened, streamed + got, stall_s)
                        try:
                            k = sock.recv_into(memoryview(buf)[got:b - a])
                        except TimeoutError:
                            if wait_s < stall_s:
                                continue
                            raise Transient(f"sent nothing for {stall_s:g} s") from None
                        if not k:
                            clock.check()
                            raise Transient(f"stream ended at byte {a + got:,} of {size:,}")
                        got += k
                except BaseException:
                    checker.give_back(buf, got)
                    raise
                streamed += got
                checker.put(i, buf, got)
    except (ValueError, msgspec.MsgspecError) as e:
        raise Rejected(f"sent a malformed header ({e})") from None
    except OSError as e:
        clock.check()
        raise Transient(f"stream broke ({type(e).__name__}: {e})") from None
    finally:
        clock.unwatch(sock)
        sock.close()


def _provider(control_path: str, src: Source, swarm: Assembly, workers: int, stall_s: float) -> None:
    """(Worker thread) fetch from one provider until every piece is held, it is rejected, or time is up."""
    peer, failures, asked = src.peer_id, 0, 0.0
    while not swarm.finished() and peer not in swarm.rejected:
        run = swarm.claim(peer, workers)
        if run is None:
            if peer in swarm.offers and time.monotonic() - asked >= OFFER_POLL_S:
                asked = time.monotonic()  # a provider still downloading: it may hold more by now
                if not _ask_offer(control_path, src, swarm, stall_s):
                    return
            else:
                swarm.wait(0.2)  # every missing piece is being fetched by others: wait for one to fail or finish
            continue
        if peer not in swarm.tried:
            swarm.tried.append(peer)
        before = swarm.delivered.get(peer, 0)
        try:
            _stream(control_path, src, swarm, run, stall_s)
            failures = 0
        except Stopped:
            return
        except Rejected as e:
            swarm.reject(peer, str(e))
        except Missing:
            asked = time.monotonic()
            if not _ask_offer(control_path, src, swarm, stall_s):
                return
        except Busy:
            swarm.wait(random.uniform(0.5, 1.5))  # others may take its share meanwhile
        except Slow as e:
            swarm.slow[peer] = swarm.slow.get(peer, 0) + 1
            if swarm.slow[peer] >= 2:
                swarm.reject(peer, f"dropped twice as too slow ({e})")
        except Transient as e:
            logger.debug("blob %s from %s: %s", swarm.sha[:12], peer[:16], e)
            failures = 0 if swarm.delivered.get(peer, 0) > before else failures + 1
            if failures >= _FAILURES:
                swarm.reject(peer, str(e))
            else:
                time.sleep(min(0.1 * failures, max(0.0, swarm.clock.left())))
        except BaseException as e:  # a bug must end the download, not leave it waiting
            swarm.fail(e)
        finally:
            swarm.release(peer, run)


def _ask_offer(control_path: str, src: Source, swarm: Assembly, stall_s: float) -> bool:
    """(Worker thread) ask a provider which pieces it holds ("have") and note them; a provider that does not
    answer three times in a row is dropped. False when the download is out of time."""
    clock = swarm.clock
    try:
        sock, opened = open_request(control_path, src, clock, stall_s)
        try:
            sock.sendall(frame(BlobRequest(sha=swarm.sha, kind="have")))
            header = read_header(sock, clock, opened)
            if header.size != swarm.size:
                raise Rejected(f"serves {header.size} bytes where {swarm.size} were announced")
            bits = recv_exact(sock, -(-swarm.n // 8), min(opened + clock.grace_s, clock.deadline))
        finally:
            clock.unwatch(sock)
            sock.close()
        swarm.offer(src.peer_id, unpack_bits(bits, swarm.n))
        swarm.unanswered.pop(src.peer_id, None)
    except Stopped:
        return False
    except Rejected as e:
        swarm.reject(src.peer_id, str(e))
    except (ValueError, msgspec.MsgspecError) as e:
        swarm.reject(src.peer_id, f"sent a malformed header ({e})")
    except Busy:
        pass
    except (Transient, OSError) as e:
        if clock.cancelled or clock.left() <= 0:
            return False
        swarm.unanswered[src.peer_id] = swarm.unanswered.get(src.peer_id, 0) + 1
        if swarm.unanswered[src.peer_id] >= _FAILURES:
            swarm.reject(src.peer_id, f"did not say which pieces it holds ({e})")
    return True


def _piece_list(control_path: str, sha: str, tree: str, size: int | None, max_size: int, sources: list[Source],
                report: FetchReport, clock: Clock, stall_s: float) -> tuple[bytes, int]:
    """(Worker thread) the blob's piece list and size from the first provider whose list matches `tree`;
    providers that send another list, size or an error are rejected; busy ones are asked again until the
    deadline, the others three times."""
    attempt = 0
    while attempt < _FAILURES and not all(s.peer_id in report.rejected for s in sources):
        busy = False
        for src in sources:
            if src.peer_id in report.rejected:
                continue
            try:
                sock, opened = open_request(control_path, src, clock, stall_s)
            except Transient:
                continue
            try:
                sock.sendall(frame(BlobRequest(sha=sha, kind="pieces")))
                header = read_header(sock, clock, opened)
                expected = size if size is not None else src.size
                if expected is not None and header.size != expected:
                    raise Rejected(f"serves {header.size} bytes where {expected} were announced")
                if header.size > max_size:
                    raise Rejected(f"serves {header.size} bytes, over the {max_size}-byte limit")
                by = time.monotonic() + clock.grace_s + piece_count(header.size) * DIGEST / clock.min_rate
                piece_list = recv_exact(sock, piece_count(header.size) * DIGEST, min(by, clock.deadline))
                if why := check_piece_list(piece_list, header.size, tree):
                    raise Rejected(why)
                return piece_list, header.size
            except Rejected as e:
                # A peer that announced the blob as its own download started may not hold it yet: ask again.
                if str(e) != "unknown blob" or attempt == _FAILURES - 1:
                    report.rejected[src.peer_id] = str(e)
            except (ValueError, msgspec.MsgspecError) as e:
                report.rejected[src.peer_id] = f"sent a malformed header ({e})"
            except Busy:
                busy = True
            except (Transient, OSError):
                clock.check()
            finally:
                clock.unwatch(sock)
                sock.close()
        attempt += 0 if busy else 1
        time.sleep(min(random.uniform(0.5, 1.5) if busy else 0.2 * attempt, max(0.0, clock.left())))
        clock.check()
    reasons = "; ".join(f"{peer[:20]}...: {why}" for peer, why in report.rejected.items())
    raise BlobError(f"could not fetch blob {sha[:12]}: no provider sent a piece list that matches its tree hash"
                    f" ({reasons or 'none answered; try again later'})")


async def fetch_pieces(
    dht: hivemind.DHT, node: hivemind.DHTNode, sha: str, tree: str, sources: list[Source], root: str,
    size: int | None, max_size: int, stall_s: float = 30.0, *, deadline_s: float | None = None,
    min_rate: float = MIN_RATE, grace_s: float = GRACE_S, max_bytes: int | None = None, token: str | None = None,
) -> FetchReport:
    """(In the DHT process) download blob `sha`, whose tree hash is `tree`, from all of `sources` at once into
    the store at `root`; see the module doc. Limits and `token` as in `fetcher.fetch_blob`."""
    store = BlobStore(root, max_bytes)
    final = store.path(check_sha256(sha))
    check_sha256(tree)
    if size is not None and size > max_size:
        raise BlobError(f"blob {sha[:12]} is {size} bytes, over the {max_size}-byte limit")
    if deadline_s is None:
        deadline_s = deadline_for(size if size is not None else max_size, min_rate, grace_s)
    clock = Clock(deadline_s, min_rate, grace_s)
    with tracked(dht, token, clock, sha):
        return await _fetch(dht, node, sha, tree, sources, store, final, size, max_size, stall_s, clock)


async def _fetch(dht: hivemind.DHT, node: hivemind.DHTNode, sha: str, tree: str, sources: list[Source],
                 store: BlobStore, final: Path, size: int | None, max_size: int, stall_s: float,
                 clock: Clock) -> FetchReport:
    lock_wait = min(max(60.0, stall_s * 4), max(0.0, clock.left()))
    part = await in_thread(PieceFile.open, store.partial_path(sha), final, lock_wait)
    if part is None:
        return FetchReport(path=str(final), sha=sha, size=final.stat().st_size, already_present=True)
    report = FetchReport(path=str(final), sha=sha, size=size if size is not None else -1, pieces=True)
    control_path = node.p2p.daemon_listen_maddr["unix"]
    me = node.peer_id.to_base58()
    usable = [s for s in sources if s.peer_id != me]
    room, ok, held, evaluated = Room(store, sha), False, 0, False
    serving = partials(dht)
    try:
        if not usable:
            raise BlobError(f"could not fetch blob {sha[:12]} "
                            f"({'no provider is known' if not sources else 'no provider besides this node'})")
        if size is not None:
            room.admit(size)  # before any byte is written
        await _connect(node, usable, min(stall_s, clock.left()))
        saved = part.saved_list()
        if size is not None and saved is not None and not check_piece_list(saved, size, tree):
            piece_list = saved
        else:
            piece_list, size = await in_thread(_piece_list, control_path, sha, tree, size, max_size, usable, report,
                                                clock, stall_s)
            room.admit(size)
            await in_thread(atomic_write_bytes, part.listed, piece_list)  # before the first piece is written
        report.size = size
        have = await in_thread(held_pieces, part.fd, size, piece_list)
        evaluated = True
        report.resumed_from = held = _bytes_of(have, size)
        swarm = Assembly(sha, size, piece_list, have, part, report, clock)
        usable = [s for s in usable if s.peer_id not in report.rejected]
        serving[(str(store.root), sha)] = swarm  # this node's provider serves the pieces held so far
        await in_thread(_run, control_path, swarm, usable, stall_s)
        held = _bytes_of(swarm.done, size)
        if swarm.fatal is not None:
            raise swarm.fatal if isinstance(swarm.fatal, BlobError) else BlobError(f"blob {sha[:12]}: {swarm.fatal}")
        if swarm.missing:
            if clock.cancelled or clock.left() <= 0:
                raise out_of_time(sha, clock, report, swarm.tried, held)
            reasons = "; ".join(f"{peer[:20]}...: {why}" for peer, why in report.rejected.items())
            if swarm.slow:
                raise out_of_time(sha, clock, report, swarm.tried, held, why=f"no provider delivered it ({reasons})")
            raise BlobError(f"could not fetch blob {sha[:12]}: {swarm.missing} of {swarm.n} pieces are missing "
                            f"({reasons or 'every provider failed; try again later'}); the {held:,} bytes held are "
                            "kept for a later fetch")
        if swarm.whole.hexdigest() != sha:
            part.reset()
            held = 0
            raise BlobError(f"blob {sha[:12]}: every piece matches the tree hash it was published with, but the "
                            "whole blob does not match its sha256: the record that named both is inconsistent "
                            "(its author made a mistake or lied); nothing is kept")
        await in_thread(publish, part, final, store, sha, size, piece_list)
        ok = True
        return report
    except Stopped:
        raise out_of_time(sha, clock, report, [s.peer_id for s in usable], held) from None
    finally:
        serving.pop((str(store.root), sha), None)
        room.release()
        # Nothing worth keeping: no intact piece, or (never checked) an empty file.
        part.close(remove=not ok and held == 0 and (evaluated or os.fstat(part.fd).st_size == 0))


def _bytes_of(flags: list[bool], size: int) -> int:
    """The bytes of the pieces flagged."""
    return sum(piece_span(i, size)[1] - piece_span(i, size)[0] for i, f in enumerate(flags) if f)


def _run(control_path: str, swarm: Assembly, sources: list[Source], stall_s: float) -> None:
    """(Worker thread) one thread for each of at most MAX_SOURCES providers at a time (in random order, so
    fetchers spread over the providers; one that drops out makes way for the next), plus the hash cursor;
    returns when they all stopped, or as soon as every piece is held: a thread still dialling a dead provider
    then ends on its own and writes nothing (every piece is done)."""
    cursor = threading.Thread(target=swarm.fold, name="blob-cursor", daemon=True)
    cursor.start()
    waiting = random.sample(sources, len(sources))
    swarm.known.update(s.peer_id for s in sources)
    running: list[threading.Thread] = []
    while waiting or running:
        waiting += swarm.take_sources()  # providers announced since the start (`add_sources`)
        workers = min(MAX_SOURCES, len(swarm.known))
        while waiting and len(running) < workers and not swarm.finished():
            t = threading.Thread(target=_provider, args=(control_path, waiting.pop(), swarm, workers, stall_s),
                                 name="blob-provider", daemon=True)
            t.start()
            running.append(t)
        if not running or swarm.missing == 0:
            break
        running[0].join(0.1)
        running = [t for t in running if t.is_alive()]
    with swarm.cond:
        swarm.stopped = True
        swarm.cond.notify_all()
    cursor.join()


async def add_sources(dht: hivemind.DHT, node: hivemind.DHTNode, root: str, sha: str, sources: list[Source]) -> int:
    """(In the DHT process) give a piece-by-piece download of `sha` into the store at `root`, if one is in flight,
    the providers announced since it started (it read the list once, at its start); returns how many are new."""
    swarm = partials(dht).get((root, sha))
    if swarm is None:
        return 0
    me = node.peer_id.to_base58()
    new = [s for s in sources if s.peer_id != me and s.peer_id not in swarm.known and s.peer_id not in swarm.rejected]
    if new:
        await _connect(node, new, 10.0)
    return len(swarm.add_sources(new))


async def _connect(node: hivemind.DHTNode, sources: list[Source], timeout: float) -> None:
    """Dial the providers that announced addresses, all at once (failures are left to the streams)."""
    async def one(src: Source) -> None:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(node.p2p._client.connect(PeerID.from_base58(src.peer_id),
                                                            [Multiaddr(a) for a in src.addrs]), max(0.01, timeout))

    await asyncio.gather(*(one(s) for s in sources if s.addrs))


def _holds_whole(control_path: str, src: Source, sha: str, size: int, timeout: float,
                 digests: bytes | None = None) -> bool:
    """(Worker thread) whether `src` answers that it holds every piece of blob `sha` (`size` bytes): a complete copy
    it serves (checked by its store) or a download of it whose pieces are all verified. With `digests` (the blob's
    piece list, from a copy the asker holds) one piece drawn at random must also arrive and match: a peer that says
    it holds the blob and serves other bytes is no copy."""
    by = time.monotonic() + timeout
    try:
        sock = open_stream(control_path, src.peer_id, HANDLER, timeout)
    except OSError:
        return False
    n = piece_count(size)
    try:
        sock.sendall(frame(BlobRequest(sha=sha, kind="have")))
        header = msgspec.msgpack.decode(recv_exact(sock, frame_length(recv_exact(sock, 4, by)), by), type=BlobHeader)
        if header.error or header.size != size or not all(unpack_bits(recv_exact(sock, -(-n // 8), by), n)):
            return False
    except (OSError, ValueError, msgspec.MsgspecError):
        return False
    finally:
        sock.close()
    return digests is None or _serves_piece(control_path, src, sha, size, digests, random.randrange(n), by)


def _serves_piece(control_path: str, src: Source, sha: str, size: int, digests: bytes, i: int, by: float) -> bool:
    """(Worker thread) whether `src` sends piece `i` of blob `sha` with the digest `digests` lists for it."""
    a, b = piece_span(i, size)
    try:
        sock = open_stream(control_path, src.peer_id, HANDLER, max(0.01, by - time.monotonic()))
    except OSError:
        return False
    try:
        sock.sendall(frame(BlobRequest(sha=sha, offset=a, end=b)))
        header = msgspec.msgpack.decode(recv_exact(sock, frame_length(recv_exact(sock, 4, by)), by), type=BlobHeader)
        if header.error or header.size != size:
            return False
        return hashlib.sha256(recv_exact(sock, b - a, by)).digest() == digests[i * DIGEST:(i + 1) * DIGEST]
    except (OSError, ValueError, msgspec.MsgspecError):
        return False
    finally:
        sock.close()


async def whole_holders(dht: hivemind.DHT, node: hivemind.DHTNode, sha: str, size: int, sources: list[Source],
                        per_peer_s: float = 10.0, digests: bytes | None = None) -> list[str]:
    """(In the DHT process) the peer ids among `sources` that hold all of blob `sha` now, each asked which pieces it
    holds: a provider record alone may be a download just begun, or a peer that has left. With `digests` (the blob's
    piece list), each must also serve a piece drawn at random, matching it."""
    check_sha256(sha)
    me = node.peer_id.to_base58()
    sources = [s for s in sources if s.peer_id != me]
    if not sources:
        return []
    await _connect(node, sources, per_peer_s)
    control_path = node.p2p.daemon_listen_maddr["unix"]
    answers = await asyncio.gather(*(in_thread(_holds_whole, control_path, s, sha, size, per_peer_s, digests)
                                     for s in sources))
    return [s.peer_id for s, whole in zip(sources, answers) if whole]
