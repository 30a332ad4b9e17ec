"""Records: every kind round-trips; any bad input raises RecordError and nothing else."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from skillswarm.protocol.codec import decode_record, encode_record
from skillswarm.protocol.errors import RecordError
from skillswarm.protocol.records import (
    MAX_BYTES, CheckpointManifest, DeltaManifest, FileEntry, PeerRecord, Record, kind_of,
)
from skillswarm.protocol.version import PROTOCOL_VERSION
from tests import strategies as S

fast = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
raw = msgspec.msgpack.Encoder()


def _plain(record: Record) -> dict:
    """A record as the plain map it is on the wire (bytes stay bytes)."""
    return msgspec.msgpack.decode(encode_record(record))


def _valid_peer(**over) -> PeerRecord:
    fields = dict(network="net", peer_id="12D3KooWK3D9merVPzWSQi6Y4d3n5xqUrfM1t2xXxtf83BGwsciL", role="worker",
                  skills=["arith"], engine="hf")
    return PeerRecord(**{**fields, **over})


@fast
@given(S.any_record)
def test_every_record_round_trips(record: Record) -> None:
    data = encode_record(record)
    assert decode_record(data) == record
    assert decode_record(data, type(record)) == record
    assert len(data) <= MAX_BYTES[kind_of(type(record))]


@fast
@given(st.binary(max_size=2048))
def test_random_bytes_raise_record_error_only(data: bytes) -> None:
    try:
        decode_record(data)
    except RecordError:
        pass


@fast
@given(S.any_record, st.data())
def test_truncated_payloads_are_rejected(record: Record, data: st.DataObject) -> None:
    encoded = encode_record(record)
    cut = data.draw(st.integers(0, len(encoded) - 1))
    with pytest.raises(RecordError):
        decode_record(encoded[:cut])


@fast
@given(S.any_record, st.data())
def test_wrong_types_and_out_of_range_values_are_rejected(record: Record, data: st.DataObject) -> None:
    as_dict = _plain(record)
    field = data.draw(st.sampled_from(sorted(k for k in as_dict if k != "kind")))
    bad = data.draw(st.sampled_from([
        None, "not-a-number", -1, 10**20, 1.5e300, float("nan"), ["x"] * 300, {"nested": 1}, "x" * 2000, b"\x00" * 100,
    ]))
    as_dict[field] = bad
    try:
        encoded = raw.encode(as_dict)
    except (TypeError, OverflowError):
        return
    try:
        decoded = decode_record(encoded)
    except RecordError:
        return
    # A few substitutions are legitimately valid (e.g. None for an optional field); then it must be a faithful decode.
    assert _plain(decoded)[field] == msgspec.msgpack.decode(encoded)[field]


def test_out_of_range_fields_name_the_field() -> None:
    good = _plain(_valid_peer())
    cases = {
        ("hardware", "ram_gb"): -3.0,
        ("checkpoint_version",): -1,
        ("role",): "king",
        ("engine",): "tensorrt",
        ("peer_id",): "not a peer id!",
        ("skills",): ["Bad Name"],
        ("network",): "",
    }
    for path, value in cases.items():
        d = dict(good, hardware=dict(good['hardware']))
        target = d
        for p in path[:-1]:
            target = target[p]
        target[path[-1]] = value
        with pytest.raises(RecordError, match=path[-1]):
            decode_record(raw.encode(d))


def test_sha256_and_codec_validation() -> None:
    base = dict(network="net", skill="arith", base_version=0, base_hash="a" * 64, blob="b" * 64, size=10,
                codec="dense_bf16", norm=1.0, num_tensors=3)
    decode_record(encode_record(DeltaManifest(**base)))
    for field, value in [("base_hash", "A" * 64), ("blob", "abc"), ("codec", "zip"), ("size", 0), ("norm", float("inf"))]:
        d = {**_plain(DeltaManifest(**base)), field: value}
        with pytest.raises(RecordError, match=field):
            decode_record(raw.encode(d))


def test_cross_field_rules() -> None:
    f = FileEntry(path="model.safetensors", sha256="c" * 64, size=1)
    with pytest.raises(ValueError, match="parent"):
        CheckpointManifest(network="n", version=2, weights_hash="a" * 64, files=[f])
    ok = CheckpointManifest(network="n", version=2, parent_version=1, parent_hash="b" * 64, weights_hash="a" * 64, files=[f])
    d = _plain(ok)
    d["parent_version"] = 5
    with pytest.raises(RecordError, match="parent_version"):
        decode_record(raw.encode(d))
    d = _plain(ok)
    d["files"] = [d["files"][0], d["files"][0]]
    with pytest.raises(RecordError, match="duplicate"):
        decode_record(raw.encode(d))
    d = _plain(ok)
    d["files"][0]["path"] = "../../etc/passwd"
    with pytest.raises(RecordError, match="path"):
        decode_record(raw.encode(d))


def test_newer_protocol_is_refused_with_a_clear_message() -> None:
    d = _plain(_valid_peer())
    d["protocol"] = PROTOCOL_VERSION + 1
    d["some_future_field"] = 1
    with pytest.raises(RecordError, match=rf"protocol version {PROTOCOL_VERSION + 1} .* upgrade skillswarm"):
        decode_record(raw.encode(d))


def test_a_delta_manifest_of_an_older_protocol_is_refused_with_a_clear_message() -> None:
    base = dict(network="net", skill="arith", base_version=0, base_hash="a" * 64, blob="b" * 64, size=10,
                codec="dense_bf16", norm=1.0, num_tensors=3)
    with_tree = DeltaManifest(**base, tree="c" * 64)
    assert decode_record(encode_record(with_tree)).tree == "c" * 64
    d = _plain(DeltaManifest(**base))  # a protocol 2 worker's record: no tree
    d["protocol"] = 2
    with pytest.raises(RecordError, match="protocol 2 names no piece tree; its worker runs an older skillswarm"):
        decode_record(raw.encode(d))


def test_oversized_payloads_are_rejected_before_decoding() -> None:
    d = _plain(_valid_peer())
    d["software"] = "x" * 9000
    with pytest.raises(RecordError, match="cap"):
        decode_record(raw.encode(d), PeerRecord)
    with pytest.raises(RecordError, match="cap"):
        decode_record(b"\x00" * (max(MAX_BYTES.values()) + 1))
    with pytest.raises(RecordError, match="cap"):  # within the global cap, over the peer cap
        decode_record(raw.encode(d))


def test_unknown_fields_and_wrong_kind_are_rejected() -> None:
    d = _plain(_valid_peer())
    with pytest.raises(RecordError, match="expected a `delta` record"):
        decode_record(raw.encode(d), DeltaManifest)
    d["extra"] = 1
    with pytest.raises(RecordError, match="extra"):
        decode_record(raw.encode(d))
    d = _plain(_valid_peer())
    d["kind"] = "mystery"
    with pytest.raises(RecordError):
        decode_record(raw.encode(d))


@pytest.mark.parametrize("value", [None, 3, "text", [1, 2], 1.5])
def test_non_bytes_input_is_rejected(value) -> None:
    with pytest.raises(RecordError):
        decode_record(value)  # type: ignore[arg-type]
