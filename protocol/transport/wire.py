"""The blob wire protocol: its request and header frames, the download deadline rule, and what a fetch reports.

One stream per request, protocol id `skillswarm/v{protocol}/blob`:
    client -> provider   u32 length + msgpack BlobRequest{sha, offset, end, kind}
    provider -> client   u32 length + msgpack BlobHeader{size, error}; then, if no error, for kind "bytes"
                         the raw bytes [offset, end or size) of the blob, for kind "pieces" its piece list
                         (`pieces`: 32 bytes per piece), for kind "have" one bit per piece it holds
                         (`pieces.pack_bits`), and the provider closes the stream.

A peer still downloading a blob piece by piece serves the pieces it holds (verified) the same way; asked
for a range it does not hold yet, it answers the error "missing", and the fetcher asks it again later.

Every download must average MIN_RATE bytes/s once GRACE_S has passed (`deadline_for`), so a provider that
trickles bytes cannot hold a fetch for longer. The serving half is `provider`, the downloading half `fetcher`.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from skillswarm.protocol.version import PROTOCOL_VERSION

HANDLER = f"skillswarm/v{PROTOCOL_VERSION}/blob"
CHUNK = 1 << 20  # the most bytes one read or write moves
_MAX_FRAME = 4096

# Every download must average MIN_RATE bytes/s once GRACE_S has passed: a whole fetch ends by
# GRACE_S + size / MIN_RATE (its deadline), and one stream under that rate after GRACE_S is dropped.
GRACE_S = 30.0
MIN_RATE = 100_000.0


def deadline_for(size: int, min_rate: float = MIN_RATE, grace_s: float = GRACE_S) -> float:
    """Seconds a download of `size` bytes may take: the grace period plus the size at the minimum rate."""
    return grace_s + size / min_rate


class BlobRequest(msgspec.Struct, forbid_unknown_fields=True):
    sha: str
    offset: int = 0
    end: int | None = None  # None: to the end of the blob
    kind: Literal["bytes", "pieces", "have"] = "bytes"


class BlobHeader(msgspec.Struct):
    size: int = 0
    error: str = ""


class Source(msgspec.Struct, frozen=True):
    """A provider to fetch from: its peer id, the addresses it announced, the size it announced (or None)."""

    peer_id: str
    addrs: tuple[str, ...] = ()
    size: int | None = None


class FetchReport(msgspec.Struct):
    """What a fetch did: where the blob is, how many bytes travelled, from whom, and who was rejected."""

    path: str
    sha: str
    size: int
    received: int = 0
    resumed_from: int = 0
    segments: list[tuple[str, int, int]] = []  # (peer id, start, end) per stream that delivered bytes
    rejected: dict[str, str] = {}  # peer id -> why it was dropped
    already_present: bool = False
    discarded: int = 0  # bytes that arrived but were thrown away: pieces that failed verification, duplicates
    pieces: bool = False  # fetched piece by piece, from every provider at once (a tree hash was given)


def frame(obj: msgspec.Struct) -> bytes:
    data = msgspec.msgpack.encode(obj)
    return len(data).to_bytes(4, "big") + data


def frame_length(prefix: bytes) -> int:
    n = int.from_bytes(prefix, "big")
    if n > _MAX_FRAME:
        raise ValueError(f"frame of {n} bytes is over the {_MAX_FRAME}-byte limit")
    return n
