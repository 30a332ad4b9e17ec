"""The one record codec: msgpack on the wire, a canonical encoding for signatures, and the single
decode entry point that turns any failure into a `RecordError` naming the field and the problem."""

from __future__ import annotations

from typing import TypeVar, overload

import msgspec

from skillswarm.protocol.errors import RecordError
from skillswarm.protocol.records import MAX_BYTES, MAX_RECORD_BYTES, AnyRecord, Record, kind_of
from skillswarm.protocol.version import PROTOCOL_VERSION

R = TypeVar("R", bound=Record)

_encoder = msgspec.msgpack.Encoder(order="deterministic")
_any_decoder = msgspec.msgpack.Decoder(AnyRecord)
_typed_decoders: dict[type, msgspec.msgpack.Decoder] = {}


class _Header(msgspec.Struct):
    """Read first, leniently, so a newer protocol is refused with a clear message, not a schema error."""

    protocol: int = 0
    kind: str = ""


_header_decoder = msgspec.msgpack.Decoder(_Header)


def encode_record(record: Record) -> bytes:
    """Encode a record for the wire (deterministic msgpack)."""
    data = _encoder.encode(record)
    cap = MAX_BYTES[kind_of(type(record))]
    if len(data) > cap:
        raise RecordError(f"{type(record).__name__} encodes to {len(data)} bytes, over its {cap}-byte cap")
    return data


def canonical_bytes(record: Record) -> bytes:
    """The bytes a signature covers: the record without its signature, deterministically encoded."""
    return _encoder.encode(msgspec.structs.replace(record, signature=b""))


@overload
def decode_record(data: bytes, expected: type[R]) -> R: ...
@overload
def decode_record(data: bytes, expected: None = None) -> Record: ...
def decode_record(data: bytes, expected: type[Record] | None = None) -> Record:
    """Decode and validate a record; any failure raises `RecordError` and nothing else."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise RecordError(f"a record must be bytes, got {type(data).__name__}")
    cap = MAX_BYTES[kind_of(expected)] if expected is not None else MAX_RECORD_BYTES
    if len(data) > cap:
        raise RecordError(f"record is {len(data)} bytes, over the {cap}-byte cap")
    try:
        header = _header_decoder.decode(data)
    except (msgspec.MsgspecError, ValueError, TypeError, OverflowError, RecursionError) as e:
        raise RecordError(f"not a skillswarm record: {e}") from None
    if header.protocol > PROTOCOL_VERSION:
        raise RecordError(
            f"record uses protocol version {header.protocol} but this node speaks {PROTOCOL_VERSION}; "
            "upgrade skillswarm (pip install -U skillswarm) to read it"
        )
    if expected is not None and header.kind != kind_of(expected):
        raise RecordError(f"expected a `{kind_of(expected)}` record, got kind `{header.kind or '?'}`")
    if len(data) > MAX_BYTES.get(header.kind, cap):
        raise RecordError(f"{header.kind} record is {len(data)} bytes, over its {MAX_BYTES[header.kind]}-byte cap")
    decoder = _any_decoder if expected is None else _typed_decoder(expected)
    try:
        record = decoder.decode(data)
    except msgspec.ValidationError as e:
        raise RecordError(f"invalid {header.kind or 'record'}: {_where(str(e))}") from None
    except (msgspec.MsgspecError, ValueError, TypeError, OverflowError, RecursionError) as e:
        raise RecordError(f"malformed {header.kind or 'record'}: {e}") from None
    return record


def _typed_decoder(expected: type[Record]) -> msgspec.msgpack.Decoder:
    dec = _typed_decoders.get(expected)
    if dec is None:
        dec = _typed_decoders[expected] = msgspec.msgpack.Decoder(expected)
    return dec


def _where(message: str) -> str:
    """msgspec says '... - at `$.hardware.ram_gb`'; name the field the way a user writes it."""
    text, sep, path = message.rpartition(" - at `")
    if not sep:
        return message
    field = path.rstrip("`").removeprefix("$.").removeprefix("$") or "record"
    return f"field `{field}`: {text}"
