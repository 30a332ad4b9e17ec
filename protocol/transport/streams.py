"""Bulk bytes over p2pd streams as plain sockets, driven by blocking calls in worker threads.

hivemind hands a stream to Python as an asyncio StreamReader/Writer: every chunk is copied three or four
times and the reader pauses p2pd whenever its 64 KiB buffer fills. For blobs we talk to p2pd's control
socket directly (its documented control protocol: a varint-delimited `Request{STREAM_OPEN}`, then the
same connection carries the stream) and move bytes with `recv_into` / `os.sendfile`: one copy each way,
and the GIL is released while the bytes move. Small control messages keep using asyncio.
"""

from __future__ import annotations

import os
import select
import socket
import time

from hivemind.p2p import PeerID
from hivemind.proto import p2pd_pb2

_MAX_VARINT_BYTES = 10


class StreamError(OSError):
    """p2pd refused to open a stream, or a stream stalled or broke."""


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def recv_exact(sock: socket.socket, n: int, deadline: float | None = None) -> bytes:
    """Read exactly `n` bytes from a blocking socket: its timeout applies to each read, and all the reads
    together end by `deadline` (a `time.monotonic()` instant) if one is given (else `TimeoutError`)."""
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    per_read = sock.gettimeout()
    try:
        while got < n:
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"{got} of {n} bytes arrived in the time allowed")
                sock.settimeout(left if per_read is None else min(per_read, left))
            k = sock.recv_into(view[got:])
            if not k:
                raise StreamError(f"stream closed after {got} of {n} bytes")
            got += k
    finally:
        if deadline is not None:
            sock.settimeout(per_read)
    return bytes(buf)


def open_stream(control_path: str, peer_id: str, protocol: str, timeout: float) -> socket.socket:
    """Ask the p2pd listening on `control_path` to open a stream to `peer_id` for `protocol`; return it
    as a blocking socket whose reads and writes time out after `timeout` s (opening it takes at most that)."""
    deadline = time.monotonic() + timeout
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(timeout)
        sock.connect(control_path)
        request = p2pd_pb2.Request(
            type=p2pd_pb2.Request.STREAM_OPEN,
            streamOpen=p2pd_pb2.StreamOpenRequest(peer=PeerID.from_base58(peer_id).to_bytes(), proto=[protocol]),
        ).SerializeToString()
        sock.sendall(_varint(len(request)) + request)
        length, shift = 0, 0
        for _ in range(_MAX_VARINT_BYTES):
            byte = recv_exact(sock, 1, deadline)[0]
            length |= (byte & 0x7F) << shift
            shift += 7
            if not byte & 0x80:
                break
        response = p2pd_pb2.Response()
        response.ParseFromString(recv_exact(sock, length, deadline))
        if response.type == p2pd_pb2.Response.ERROR:
            raise StreamError(f"p2pd could not open a stream to {peer_id[:20]}...: {response.error.msg}")
        return sock
    except BaseException:
        sock.close()
        raise


def _wait_writable(fd: int, timeout: float) -> None:
    poller = select.poll()
    poller.register(fd, select.POLLOUT)
    if not poller.poll(timeout * 1000):
        raise StreamError(f"peer accepted no bytes for {timeout:g} s")


def send_all(fd: int, data: bytes, timeout: float) -> None:
    """Write all of `data` to a (possibly non-blocking) fd, waiting at most `timeout` s for each write."""
    view, sent = memoryview(data), 0
    while sent < len(data):
        try:
            sent += os.write(fd, view[sent:])
        except BlockingIOError:
            _wait_writable(fd, timeout)


def send_file_range(fd: int, file_fd: int, offset: int, count: int, timeout: float,
                    rate: float | None = None, chunk: int = 1 << 20) -> int:
    """`os.sendfile` bytes [offset, offset+count) of a file to a (possibly non-blocking) socket fd, at
    most `rate` bytes/s if given. Returns the bytes sent; raises `OSError` if the peer goes away."""
    started, sent = time.monotonic(), 0
    while sent < count:
        try:
            n = os.sendfile(fd, file_fd, offset + sent, min(chunk, count - sent))
        except BlockingIOError:
            _wait_writable(fd, timeout)
            continue
        if n == 0:
            raise StreamError("the file ended before the range did (was it truncated?)")
        sent += n
        if rate and sent < count:  # nothing to pace after the last byte (the peer may hang up at once)
            ahead = sent / rate - (time.monotonic() - started)
            if ahead > 0:
                _pause(fd, ahead)
    return sent


def _pause(fd: int, seconds: float) -> None:
    """Send nothing for `seconds`, but end at once (`StreamError`) if the peer closes the stream meanwhile:
    it sends nothing after its request, so the socket turning readable means it hung up."""
    poller = select.poll()
    poller.register(fd, select.POLLIN | select.POLLHUP | select.POLLERR)
    if poller.poll(seconds * 1000):
        raise StreamError("the peer closed the stream")
