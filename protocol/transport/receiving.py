"""The receiving end of one blob stream (what `fetcher`, `swarm` and `assembly` share): the errors a provider's
stream ends with, the clock that holds a fetch to its deadline and minimum rate (`Clock`), the reserved room in the
store (`Room`), the sink that appends while hashing (`Sink`), and opening a request, reading its header and
receiving its bytes (`open_request`, `read_header`, `receive`)."""

from __future__ import annotations

import contextlib
import logging
import queue
import socket
import threading
import time
from typing import Callable

import msgspec

from skillswarm.protocol.transport.blobs import BlobStore, PartialDownload
from skillswarm.protocol.errors import BlobError
from skillswarm.protocol.transport.streams import open_stream, recv_exact
from skillswarm.protocol.transport.wire import CHUNK, HANDLER, BlobHeader, FetchReport, Source, frame_length

logger = logging.getLogger(__name__)


class Transient(Exception):
    """This attempt failed (stream broke, provider busy or unreachable); the provider may be tried again."""


class Slow(Transient):
    """This stream averaged under the minimum rate after the grace period; its bytes are kept."""


class Rejected(Exception):
    """This provider must not be asked again during this fetch (unknown blob, wrong size, lying)."""


class Stopped(Exception):
    """The fetch is out of time: its deadline passed, or it was cancelled."""


class Missing(Transient):
    """A provider still downloading the blob does not hold the pieces asked for yet."""


class Busy(Transient):
    """A provider serves as many uploads as it allows: ask again later (until the deadline), no blame."""


class Clock:
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
        """Raise `Stopped` if the fetch was cancelled or its deadline passed."""
        if self.cancelled or self.left() <= 0:
            raise Stopped

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


class Room:
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


class Sink:
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

    def __enter__(self) -> Sink:
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


def pace(sock: socket.socket, clock: Clock, opened: float, streamed: int, stall_s: float) -> float:
    """Raise if the fetch is out of time or this stream, open since `opened`, averages under the minimum rate
    after the grace period; else time the next read out when either could first happen. Returns that wait."""
    clock.check()
    now = time.monotonic()
    slow_at = opened + max(clock.grace_s, streamed / clock.min_rate)
    if now >= slow_at:
        raise Slow(f"sent {streamed:,} bytes in {now - opened:.1f} s, under {clock.min_rate:,.0f} bytes/s")
    wait_s = min(stall_s, clock.deadline - now, slow_at - now)
    sock.settimeout(max(0.001, wait_s))
    return wait_s


def open_request(control_path: str, src: Source, clock: Clock, stall_s: float) -> tuple[socket.socket, float]:
    """A stream to `src` for one request, watched by `clock` (the caller unwatches and closes it), and when it
    was opened; a stream that cannot open is a transient failure."""
    clock.check()
    opened = time.monotonic()
    try:
        sock = open_stream(control_path, src.peer_id, HANDLER, max(0.01, min(stall_s, clock.left())))
    except OSError as e:
        clock.check()
        raise Transient(f"cannot open a stream ({e})") from None
    clock.watch(sock)
    sock.settimeout(stall_s)
    return sock, opened


def read_header(sock: socket.socket, clock: Clock, opened: float, within: float | None = None) -> BlobHeader:
    """Read a provider's header, which must come within the grace period (or `within` s of `opened`, if that
    is shorter); refuse an error header."""
    allowed = clock.grace_s if within is None else min(clock.grace_s, within)
    header_by = min(opened + allowed, clock.deadline)  # a header, too, must not trickle
    try:
        header = msgspec.msgpack.decode(recv_exact(sock, frame_length(recv_exact(sock, 4, header_by)), header_by),
                                        type=BlobHeader)
    except TimeoutError:
        clock.check()
        if time.monotonic() >= opened + allowed:
            raise Slow(f"sent no header within {allowed:.3g} s") from None
        raise
    if header.error == "busy":
        raise Busy("busy")
    if header.error == "missing":
        raise Missing("it does not hold those pieces yet")
    if header.error:
        raise Rejected(header.error)
    return header


def check_header(header: BlobHeader, src: Source, size: int | None, max_size: int) -> None:
    """Refuse a provider whose header announces another size than the caller's or its record's, or too many bytes."""
    expected = size if size is not None else src.size
    if expected is not None and header.size != expected:
        raise Rejected(f"serves {header.size} bytes where {expected} were announced")
    if header.size > max_size:
        raise Rejected(f"serves {header.size} bytes, over the {max_size}-byte limit")


def receive(sock: socket.socket, opened: float, header: BlobHeader, src: Source, part: PartialDownload,
             stall_s: float, report: FetchReport, clock: Clock, admit: Callable[[int], None]) -> int:
    """(Worker thread) the bytes a provider sends after its header (`_answer` opened the stream at `opened` and
    read it), appended to `part` until the blob is complete, the stream breaks or turns slow, or the fetch is
    out of time; returns the blob size. The stream is closed at the end."""
    start = part.offset
    try:
        if part.offset > header.size:
            part.reset()
            raise Transient("the partial download was longer than the blob; restarting it")
        admit(header.size)  # BlobError if it does not fit in the store: nothing is written
        report.size = header.size
        with Sink(part) as sink:
            received = part.offset
            while received < header.size:
                buf = sink.buffer()
                want, got = min(CHUNK, header.size - received), 0
                try:
                    while got < want:
                        wait_s = pace(sock, clock, opened, received + got - start, stall_s)
                        try:
                            k = sock.recv_into(memoryview(buf)[got:want])
                        except TimeoutError:
                            if wait_s < stall_s:
                                continue  # the deadline or the rate check is due: the next pace decides
                            raise Transient(f"sent nothing for {stall_s:g} s") from None
                        if not k:
                            clock.check()  # a cancel shuts the stream down
                            raise Transient(f"stream ended at byte {received + got} of {header.size}")
                        got += k
                finally:
                    sink.put(buf, got)  # what arrived before a break is kept: the next stream resumes after it
                received += got
        return header.size
    except (ValueError, msgspec.MsgspecError) as e:
        raise Rejected(f"sent a malformed header ({e})") from None
    except OSError as e:  # includes timeouts: a stalled provider
        clock.check()
        raise Transient(f"stream broke at byte {part.offset} ({type(e).__name__}: {e})") from None
    finally:
        clock.unwatch(sock)
        sock.close()
        if part.offset > start:
            report.segments.append((src.peer_id, start, part.offset))
            report.received += part.offset - start
