"""Hostile delta files: whatever bytes a worker publishes, reading them gives a one-line MergeError (never an
OverflowError, RecursionError or other crash), screening rejects them with that reason beside an accepted honest
delta, and a worker's round that fails is logged and retried instead of ending the worker."""

from __future__ import annotations

import copy
import json
import logging
import math
import tempfile
import threading
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from skillswarm.merge import peft_format
from skillswarm.merge.checkpoint import Checkpoint
from skillswarm.merge.deltas import DeltaFile, encode_delta
from skillswarm.merge.screening import REASON_CHARS, screen_deltas
from skillswarm.merge.tensorfile import TensorFile, row_chunks
from skillswarm.protocol.errors import MergeError

INF = float("inf")
DEEP = 100_000


# ---- crafting files byte by byte -------------------------------------------------------------------------------
class Raw:
    """A JSON token written as is (json.dumps cannot write 1e400 or nest 100,000 deep)."""

    def __init__(self, token: str) -> None:
        self.token, self.marker = token, f"\x01raw{id(self)}"


def _dumps(value: Any) -> str:
    raws: list[Raw] = []

    def plain(v: Any) -> Any:
        if isinstance(v, Raw):
            raws.append(v)
            return v.marker
        if isinstance(v, dict):
            return {k: plain(x) for k, x in v.items()}
        if isinstance(v, list):
            return [plain(x) for x in v]
        return v

    text = json.dumps(plain(value))  # Infinity and NaN as Python writes them
    for r in raws:
        text = text.replace(json.dumps(r.marker), r.token)
    return text


def _parts(path: Path) -> tuple[dict, bytes]:
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def _file(out: Path, header_text: str | bytes, data: bytes, length: int | None = None) -> Path:
    text = header_text.encode("utf-8", "surrogatepass") if isinstance(header_text, str) else header_text
    out.write_bytes((len(text) if length is None else length).to_bytes(8, "little") + text + data)
    return out


def _by_offset(header: dict) -> list[str]:
    return sorted((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"])


def _set(path: tuple, value: Any) -> Callable[[dict, bytes, Path], Path]:
    """A craft that puts `value` at `path` of the first tensor's entry (by offset)."""
    def craft(header: dict, data: bytes, out: Path) -> Path:
        node = header[_by_offset(header)[0]]
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value
        return _file(out, _dumps(header), data)
    return craft


def _metadata_deep(header: dict, data: bytes, out: Path) -> Path:
    header["__metadata__"] = Raw('{"x":' * DEEP + '""' + "}" * DEEP)
    return _file(out, _dumps(header), data)


def _tensors_deep(header: dict, data: bytes, out: Path) -> Path:
    header["__metadata__"]["tensors"] = "[" * DEEP + "]" * DEEP  # an otherwise valid skillswarm delta
    return _file(out, _dumps(header), data)


def _header_too_long(header: dict, data: bytes, out: Path) -> Path:
    text = _dumps(header)
    return _file(out, text, data, length=len(text) + len(data) + 1000)


def _overlap(header: dict, data: bytes, out: Path) -> Path:
    first, second = _by_offset(header)[:2]
    header[second]["data_offsets"] = [x - 4 for x in header[second]["data_offsets"]]  # 4 bytes inside the first
    return _file(out, _dumps(header), data)


def _duplicate(header: dict, data: bytes, out: Path) -> Path:
    name = _by_offset(header)[0]
    text = _dumps(header)
    entry = f"{json.dumps(name)}: {json.dumps(header[name])}"
    assert entry in text
    return _file(out, text.replace(entry, f"{entry}, {entry}"), data)  # which one counts? neither: refused


def _hostile_name(header: dict, data: bytes, out: Path) -> Path:
    tensors = json.loads(header["__metadata__"]["tensors"])
    tensors["x\n\ud800y"] = ["F32", [1]]  # a newline and a lone surrogate (UTF-8 cannot encode it)
    header["__metadata__"]["tensors"] = json.dumps(tensors)
    return _file(out, _dumps(header), data)


# name -> (craft, phrase its MergeError must hold, whether a TensorFile alone refuses it)
CASES: dict[str, tuple[Callable[[dict, bytes, Path], Path], str, bool]] = {
    "shape Infinity": (_set(("shape", 0), INF), "Infinity", True),
    "offset Infinity": (_set(("data_offsets", 1), INF), "Infinity", True),
    "offset 1e400": (_set(("data_offsets", 1), Raw("1e400")), "1e400 is not an integer", True),
    "offset -1": (_set(("data_offsets", 0), -1), "data_offsets must be", True),
    "offset 2^64": (_set(("data_offsets", 1), 2 ** 64), "data_offsets must be", True),
    "offset 10^30": (_set(("data_offsets", 1), 10 ** 30), "too large", True),
    "shape 8.5": (_set(("shape", 0), Raw("8.5")), "8.5 is not an integer", True),
    "__metadata__ 100,000 deep": (_metadata_deep, "nested at most", True),
    "tensors JSON 100,000 deep": (_tensors_deep, "`tensors` metadata is not JSON nested at most", False),
    "header length past the end": (_header_too_long, "header length", True),
    "overlapping offsets": (_overlap, "overlap", True),
    "duplicate tensor": (_duplicate, "appears twice", True),
    "unknown dtype": (_set(("dtype",), "F33"), "unknown dtype 'F33'", True),
    "hostile tensor name": (_hostile_name, "has no complete stored parts", False),
}


def _read_all(path: Path) -> None:
    """Open a delta and decode every row of it, as a merge would."""
    with DeltaFile(path) as f:
        for name in f.names():
            for r0, r1 in row_chunks(f.shape(name), 64):
                f.rows(name, r0, r1)


def _one_line(e: MergeError) -> str:
    text = str(e)
    assert "\n" not in text and len(text) < 1000, text
    text.encode("utf-8")  # no lone surrogate: it can go into a record
    return text


@pytest.fixture(scope="module")
def small_delta(tmp_path_factory: pytest.TempPathFactory) -> Path:
    g = torch.Generator().manual_seed(0)
    values = {"emb": torch.randn(50, 8, generator=g) * 0.01, "norm": torch.randn(8, generator=g) * 0.01}
    out = tmp_path_factory.mktemp("hostile") / "valid.safetensors"
    return encode_delta(values, out, "dense_fp32", dtypes={k: torch.float32 for k in values}).path


@pytest.mark.parametrize("case", list(CASES))
def test_a_crafted_file_gives_a_one_line_merge_error(small_delta: Path, tmp_path: Path, case: str) -> None:
    craft, phrase, header_level = CASES[case]
    _read_all(small_delta)  # the honest file it is made from reads
    path = craft(*_parts(small_delta), tmp_path / "crafted.safetensors")
    with pytest.raises(MergeError) as got:
        _read_all(path)
    assert phrase in _one_line(got.value), str(got.value)
    if header_level:
        with pytest.raises(MergeError) as got:
            TensorFile(path)
        assert phrase in _one_line(got.value), str(got.value)


def test_a_refused_file_closes_its_descriptor_once(small_delta: Path, tmp_path: Path) -> None:
    """A file refused while opening must not close its descriptor number again when collected: by then another
    file (the base model's, a socket) may hold that number."""
    import gc

    bad = CASES["header length past the end"][0](*_parts(small_delta), tmp_path / "crafted.safetensors")
    with pytest.raises(MergeError) as refused:  # its traceback keeps the half-made TensorFile alive
        TensorFile(bad)
    with TensorFile(small_delta) as good:  # most likely gets the descriptor number the refused file had
        del refused
        gc.collect()
        assert good.read("emb").shape == (50, 8)


def test_screening_rejects_each_crafted_file_with_its_reason_beside_a_valid_delta(nano_model: Path,
                                                                                  tmp_path: Path) -> None:
    ckpt = Checkpoint(nano_model)
    try:
        g = torch.Generator().manual_seed(3)
        floats = {n: ckpt.entry(n) for n in ckpt.names() if ckpt.entry(n).dtype.is_floating_point}
        values = {n: torch.randn(e.shape, generator=g) * 1e-3 for n, e in floats.items()}
        dtypes = {n: e.dtype for n, e in floats.items()}
    finally:
        ckpt.close()
    valid = encode_delta(values, tmp_path / "valid.safetensors", "dense_fp32", dtypes=dtypes).path
    crafted = [craft(*_parts(valid), tmp_path / f"crafted-{i}.safetensors") for i, (craft, _, _) in
               enumerate(CASES.values())]
    result = screen_deltas(nano_model, [crafted[0], valid, *crafted[1:]], max_norm_ratio=None)
    assert [Path(a.candidate.path) for a in result.accepted] == [valid]
    reasons = {Path(r.candidate.path): r.reason for r in result.rejected}
    assert set(reasons) == set(crafted)
    for (case, (_, phrase, _)), path in zip(CASES.items(), crafted):
        reason = reasons[path]
        assert reason.startswith("unreadable delta") and phrase in reason, (case, reason)
        assert len(reason) <= REASON_CHARS and "\n" not in reason and str(tmp_path) not in reason, reason
        reason.encode("utf-8")


# ---- a bounded fuzz of valid delta headers ---------------------------------------------------------------------
class Inner:
    """A metadata value that is JSON itself (tensors, codec_params, peft_config), mutated as a tree."""

    def __init__(self, value: Any) -> None:
        self.value = value


def _tree(header: dict) -> dict:
    md = {k: Inner(json.loads(v)) if k in ("tensors", "codec_params", "peft_config") else v
          for k, v in header.get("__metadata__", {}).items()}
    return {**header, "__metadata__": md}


def _text(tree: Any) -> str:
    def plain(v: Any) -> Any:
        if isinstance(v, Inner):
            return Raw(json.dumps(_dumps(v.value)))  # its JSON, as a JSON string (raw tokens inside kept)
        if isinstance(v, dict):
            return {k: plain(x) for k, x in v.items()}
        if isinstance(v, list):
            return [plain(x) for x in v]
        return v
    return _dumps(plain(tree))


def _paths(v: Any, at: tuple = ()) -> list[tuple]:
    out = [at]
    if isinstance(v, Inner):
        return out + _paths(v.value, at + (None,))
    items = v.items() if isinstance(v, dict) else enumerate(v) if isinstance(v, list) else ()
    for k, x in items:
        out += _paths(x, at + (k,))
    return out


def _replace(tree: Any, at: tuple, value: Any, delete: bool) -> Any:
    if not at:
        return value
    key, rest = at[0], at[1:]
    if key is None:
        tree.value = _replace(tree.value, rest, value, delete)
    elif delete and not rest and isinstance(tree, dict):
        del tree[key]
    else:
        tree[key] = _replace(tree[key], rest, value, delete)
    return tree


HOSTILE = st.one_of(
    st.sampled_from([INF, -INF, math.nan, -1, 0, 1, 8, 2 ** 63, 2 ** 64, 10 ** 30, 8.5, "", "F33", "I64", "U16", "BOOL",
                     "F8_E5M2", "\ud800", "a\nb", None, True, [], {}, [0, 0], [0, 2 ** 62], [8, 8], ["F32", [1]],
                     Raw("1e400"), Raw("-0"), Raw("[" * 3000 + "]" * 3000), Raw('{"a":' * 3000 + "0" + "}" * 3000)]),
    st.integers(-2 ** 70, 2 ** 70), st.floats(), st.text(max_size=6), st.lists(st.integers(-2, 2 ** 33), max_size=3),
).map(copy.deepcopy)  # a later mutation may edit a drawn list in place


@pytest.fixture(scope="module")
def valid_deltas(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    """One valid delta of every codec (top-k with 8-bit values too) and a PEFT adapter."""
    d = tmp_path_factory.mktemp("fuzz-seeds")
    g = torch.Generator().manual_seed(1)
    values = {"a.weight": torch.randn(6, 4, generator=g), "b.weight": torch.randn(4, 4, generator=g),
              "n": torch.randn(4, generator=g)}
    dtypes = {k: torch.float32 for k in values}
    out = [encode_delta(values, d / f"{i}.safetensors", codec, dtypes=dtypes, **kw).path for i, (codec, kw) in
           enumerate([("dense_bf16", {}), ("topk", {"density": 0.5}), ("topk", {"density": 0.5, "value_bits": 8}),
                      ("int8", {}), ("lora", {"rank": 2})])]
    a, b = torch.randn(2, 4, generator=g), torch.randn(6, 2, generator=g)
    out.append(encode_delta({"a.weight": (a, b)}, d / "peft.safetensors", "lora", dtypes=dtypes,
                            peft_config=peft_format.adapter_config({"a.weight": 2})).path)
    return out


@settings(max_examples=300, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=st.data())
def test_fuzzed_headers_raise_merge_error_and_nothing_else(valid_deltas: list[Path], data: st.DataObject) -> None:
    src = data.draw(st.sampled_from(valid_deltas), label="seed")
    header, payload = _parts(src)
    tree = _tree(header)
    for _ in range(data.draw(st.integers(1, 3), label="mutations")):
        paths = _paths(tree)[1:]
        if not paths:
            break
        at = data.draw(st.sampled_from(paths), label="path")
        tree = _replace(tree, at, data.draw(HOSTILE, label="value"), data.draw(st.booleans(), label="delete"))
    text = _text(tree).encode("utf-8", "surrogatepass")
    if data.draw(st.booleans(), label="byte edits"):
        for _ in range(data.draw(st.integers(1, 3), label="edits")):
            i = data.draw(st.integers(0, len(text)), label="at")
            token = data.draw(st.sampled_from([b"Infinity", b"1e400", b"-", b"9" * 25, b".5", b"[[", b"]", b"}", b"\\",
                                               b'"', b"\xff", b""]), label="bytes")
            text = text[:i] + token + text[i + 1:]
    with tempfile.TemporaryDirectory() as d:
        path = _file(Path(d) / "fuzzed.safetensors", text, payload)
        try:
            _read_all(path)
        except MergeError as e:
            _one_line(e)


# ---- a worker's round that fails ----------------------------------------------------------------------------
def test_a_failed_worker_round_is_logged_and_retried_not_fatal(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    """The first pull of a checkpoint raises (a corrupt blob, say): the worker logs why, pauses and tries again;
    the second attempt trains and publishes its round. Failpoints kill the process (node/roles/failpoints.py), so this
    failure is injected where the loop calls pull."""
    import skillswarm.node.roles.worker as worker_mod
    from skillswarm.node.checkpoints.store import CheckpointStore
    from skillswarm.node.roles.worker import Worker, WorkerOptions
    from skillswarm.protocol.identity import Identity
    from skillswarm.protocol.records import CheckpointManifest, DeltaManifest, NetworkSpec, RoundPolicy
    from skillswarm.protocol.transport.blobs import BlobStore

    spec = NetworkSpec(network="n", base_model="m", base_hash="ab" * 32, skills=["arith"],
                       round=RoundPolicy(max_backoff_s=0.05))
    v1 = CheckpointManifest(network="n", version=1, weights_hash="cd" * 32, parent_version=0, parent_hash="ab" * 32,
                            files=[])
    events: list[tuple[str, dict]] = []
    worker = Worker(spec, Identity.generate(), None, CheckpointStore(tmp_path / "store"), BlobStore(tmp_path / "blobs"),
                    WorkerOptions(skill="arith"), on_event=lambda kind, data: events.append((kind, data)))
    offered, pulls, trained = [v1, v1], [], []

    def wait_for_checkpoint(dht, spec, *, newer_than, timeout, stop):
        return offered.pop(0) if offered else None

    def pull(dht, spec, manifest, store, blobs, progress=True):
        pulls.append(manifest.version)
        if len(pulls) == 1:
            raise MergeError("checkpoint v1 blob is corrupt: header length 99 does not fit")

    def train_round(current: CheckpointManifest, stop: threading.Event) -> DeltaManifest:
        trained.append(current.version)
        return DeltaManifest(network="n", skill="arith", base_version=1, base_hash="cd" * 32, blob="ef" * 32, size=1,
                             codec="dense_fp32", norm=1.0, num_tensors=1)

    monkeypatch.setattr(worker_mod, "wait_for_checkpoint", wait_for_checkpoint)
    monkeypatch.setattr(worker_mod, "pull", pull)
    monkeypatch.setattr(worker_mod, "share", lambda *a, **k: None)
    monkeypatch.setattr(worker, "train_round", train_round)
    with caplog.at_level(logging.WARNING, logger="skillswarm.node.roles.worker"):
        assert worker.run(threading.Event(), max_rounds=1) == 1
    assert pulls == [1, 1] and trained == [1]
    assert any("round v1 failed" in r.getMessage() and "header length 99" in r.getMessage() for r in caplog.records)
    [(kind, failed)] = [e for e in events if e[0] == "round_failed"]
    assert failed["version"] == 1 and "MergeError" in failed["error"] and failed["retry_in"] == pytest.approx(0.05)


def test_an_error_while_the_user_stops_the_worker_still_raises(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import skillswarm.node.roles.worker as worker_mod
    from skillswarm.node.checkpoints.store import CheckpointStore
    from skillswarm.node.roles.worker import Worker, WorkerOptions
    from skillswarm.protocol.identity import Identity
    from skillswarm.protocol.records import CheckpointManifest, NetworkSpec
    from skillswarm.protocol.transport.blobs import BlobStore

    spec = NetworkSpec(network="n", base_model="m", base_hash="ab" * 32, skills=["arith"])
    worker = Worker(spec, Identity.generate(), None, CheckpointStore(tmp_path / "store"), BlobStore(tmp_path / "blobs"),
                    WorkerOptions(skill="arith"))
    stop = threading.Event()

    def pull(*a, **k):
        stop.set()
        raise RuntimeError("interrupted by the stop")

    v1 = CheckpointManifest(network="n", version=1, weights_hash="cd" * 32, parent_version=0, parent_hash="ab" * 32,
                            files=[])
    monkeypatch.setattr(worker_mod, "wait_for_checkpoint", lambda *a, **k: v1)
    monkeypatch.setattr(worker_mod, "pull", pull)
    with pytest.raises(RuntimeError, match="interrupted by the stop"):
        worker.run(stop)


def test_a_rejection_reason_quoting_a_hostile_name_stays_one_encodable_line(tmp_path: Path) -> None:
    # a reason may quote what a hostile file or peer wrote: a lone surrogate would make the manifest unencodable, a
    # newline would break the one-line reason, and the coordinator could then publish no round at all
    from skillswarm.node.roles.rounds import Candidate, RoundInputs
    from skillswarm.node.roles.rounds.state import reject
    from skillswarm.protocol.codec import encode_record
    from skillswarm.protocol.identity import Identity
    from skillswarm.protocol.records import CheckpointManifest, DeltaManifest, FileEntry, NetworkSpec
    from skillswarm.protocol.transport.blobs import BlobStore

    h = "ab" * 32
    parent = CheckpointManifest(network="hostile", version=0, weights_hash=h,
                                files=[FileEntry(path="config.json", sha256="1" * 64, size=2)])
    inputs = RoundInputs(spec=NetworkSpec(network="hostile", base_model="nano", base_hash=h, skills=["sort"]),
                         parent=parent, base_dir=tmp_path, blobs=BlobStore(tmp_path / "blobs"), history=[parent])
    cand = Candidate(Identity.generate().sign_record(DeltaManifest(
        network="hostile", skill="sort", base_version=0, base_hash=h, blob="c" * 64, size=1, codec="dense_fp32",
        norm=1.0, num_tensors=1)))
    _, r = reject(inputs, cand, "inspect", "tensor `evil\ud800\nname` " + "x" * 400)
    assert "\n" not in r.reason and len(r.reason) <= 256 and "\\ud800" in r.reason
    signer = Identity.generate()
    encode_record(signer.sign_record(CheckpointManifest(
        network="hostile", version=1, parent_version=0, parent_hash=h, weights_hash=h, files=parent.files,
        rejected=[r])))  # encodes: the round can be published
