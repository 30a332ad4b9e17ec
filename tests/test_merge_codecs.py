"""Delta codecs and delta files: round trips, hand-computed encodings, self-description, bad files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from skillswarm.merge.codecs import encode_tensor
from skillswarm.merge.deltas import compute_delta, encode_delta, read_delta
from skillswarm.merge.exact import lora_product
from skillswarm.merge.tensorfile import TensorFile
from skillswarm.protocol.errors import MergeError
from skillswarm.protocol.hashing import sha256_file


def _delta(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"emb": torch.randn(40, 24, generator=g), "w": torch.randn(24, 24, generator=g) * 0.1,
            "norm": torch.randn(24, generator=g), "scalar": torch.tensor(0.5), "conv": torch.randn(4, 3, 2, generator=g)}


@pytest.mark.parametrize("codec, params", [("dense_fp32", {}), ("dense_bf16", {}), ("dense_fp16", {}),
                                           ("topk", {"density": 0.3}), ("topk", {"density": 0.3, "value_bits": 32}),
                                           ("topk", {"density": 0.3, "value_bits": 8}), ("int8", {}), ("lora", {"rank": 4})])
def test_round_trip_rows_and_self_description(tmp_path: Path, codec: str, params: dict) -> None:
    delta = _delta()
    info = encode_delta(delta, tmp_path / "d.safetensors", codec, base_hash="ab" * 32, skill="math", **params)
    assert info.sha256 == sha256_file(tmp_path / "d.safetensors") and info.size == (tmp_path / "d.safetensors").stat().st_size
    f = read_delta(tmp_path / "d.safetensors")
    assert (f.codec, f.base_hash, f.skill, f.names()) == (codec, "ab" * 32, "math", sorted(delta))
    assert all(f.params[k] == v for k, v in params.items())
    sq_err = sq_ref = sq = 0.0
    for name, x in delta.items():
        got = f.get(name)
        assert got.dtype == torch.float32 and got.shape == x.shape
        if codec == "dense_fp32":
            assert torch.equal(got, x)
        elif codec.startswith("dense"):
            assert torch.equal(got, x.to({"dense_bf16": torch.bfloat16, "dense_fp16": torch.float16}[codec]).float())
        rows = x.shape[0] if x.shape else 1
        for r0, r1 in [(0, rows), (1, min(rows, 3)), (rows - 1, rows)] if x.shape else [(0, 1)]:
            assert torch.equal(f.rows(name, r0, r1), got[r0:r1] if x.shape else got)
        sq_err += float(((got.double() - x.double()) ** 2).sum())
        sq_ref += float((x.double() ** 2).sum())
        sq += float((got.double() ** 2).sum())
    assert info.error == pytest.approx((sq_err / sq_ref) ** 0.5, rel=1e-5, abs=1e-9)
    assert info.norm == pytest.approx(sq ** 0.5, rel=1e-6) == pytest.approx(f.norm(chunk_elems=50), rel=1e-6)
    assert info.num_tensors == len(delta)


def test_topk_keeps_the_k_largest_with_ties_to_the_lowest_index() -> None:
    x = torch.tensor([[0.5, -3.0, 1.0], [-1.0, 2.0, 1.0]])
    parts = encode_tensor("topk", "w", x, {"density": 0.5, "value_bits": 32.0})  # k = 3 of 6
    assert parts["w::idx"].tolist() == [1, 2, 4]  # |-3|, |2|, then the first of the three 1.0 ties
    assert parts["w::val"].tolist() == [-3.0, 1.0, 2.0]
    eight = encode_tensor("topk", "w", x, {"density": 0.5, "value_bits": 8.0})  # the same entries, int8 values
    assert eight["w::idx"].tolist() == [1, 2, 4] and eight["w::val"].dtype == torch.int8
    assert eight["w::val"].tolist() == [-127, 42, 85] and eight["w::vscale"].tolist() == [pytest.approx(3.0 / 127)]


def test_int8_uses_per_row_scales() -> None:
    x = torch.tensor([[1.0, -2.0, 0.5], [0.0, 0.0, 0.0]])
    parts = encode_tensor("int8", "w", x, {})
    assert torch.allclose(parts["w::scale"], torch.tensor([2.0 / 127.0, 1.0]))
    assert parts["w::q"].tolist() == [[64, -127, 32], [0, 0, 0]]  # 63.5 rounds half to even, 31.75 to 32


def test_lora_is_exact_on_a_low_rank_delta(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(1)
    low = torch.randn(64, 2, generator=g) @ torch.randn(2, 48, generator=g)
    big = torch.randn(300, 3, generator=g) @ torch.randn(3, 260, generator=g)  # takes the randomized SVD
    info = encode_delta({"a": low, "b": big}, tmp_path / "l.safetensors", "lora", rank=4)
    f = read_delta(tmp_path / "l.safetensors")
    assert torch.allclose(f.get("a"), low, atol=1e-4) and torch.allclose(f.get("b"), big, atol=1e-3)
    assert info.size < (64 * 48 + 300 * 260) * 4 / 3
    a, b = torch.randn(2, 48), torch.randn(64, 2)  # ready factors from a LoRA trainer
    encode_delta({"a": (a, b)}, tmp_path / "f.safetensors", "lora")
    got = read_delta(tmp_path / "f.safetensors").get("a")
    assert torch.equal(got, lora_product(b, a)) and torch.allclose(got, b @ a, atol=1e-5)  # B @ A, order-fixed
    with pytest.raises(MergeError, match="only be stored with the lora codec"):
        encode_delta({"a": (a, b)}, tmp_path / "g.safetensors", "int8")


def test_compute_delta_streams_two_model_dirs(tmp_path: Path) -> None:
    base, tuned = _delta(1), _delta(2)
    for name, sd in (("base", base), ("tuned", tuned)):
        (tmp_path / name).mkdir()
        save_file({k: v.bfloat16() for k, v in sd.items()}, str(tmp_path / name / "model.safetensors"))
    info = compute_delta(tmp_path / "base", tmp_path / "tuned", tmp_path / "d.safetensors", "dense_fp32", skill="s")
    f = read_delta(tmp_path / "d.safetensors")
    for k in base:
        assert torch.equal(f.get(k), tuned[k].bfloat16().float() - base[k].bfloat16().float())
        assert f.tensors[k].dtype == "BF16"  # the dtype of the weights it applies to
    assert info.num_tensors == 5 and f.skill == "s"


def test_bad_inputs_get_clear_errors(tmp_path: Path) -> None:
    (tmp_path / "junk.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!")
    with pytest.raises(MergeError, match="not a safetensors file"):
        read_delta(tmp_path / "junk.safetensors")
    save_file({"w": torch.zeros(2)}, str(tmp_path / "plain.safetensors"))
    with pytest.raises(MergeError, match="not a skillswarm delta"):
        read_delta(tmp_path / "plain.safetensors")
    with pytest.raises(MergeError, match="has no parameter 'rank'"):
        encode_delta({"w": torch.zeros(2)}, tmp_path / "x.safetensors", "topk", rank=3)
    with pytest.raises(MergeError, match="unknown codec"):
        encode_delta({"w": torch.zeros(2)}, tmp_path / "x.safetensors", "zip")
    with pytest.raises(MergeError, match="NaN or inf"):
        encode_delta({"w": torch.tensor([1.0, float("nan")])}, tmp_path / "x.safetensors", "dense_fp32")
    assert not (tmp_path / "x.safetensors").exists()
    # a declared tensor whose stored part has the wrong shape
    encode_delta({"w": torch.ones(3)}, tmp_path / "ok.safetensors", "dense_fp32")
    md = TensorFile(tmp_path / "ok.safetensors").metadata
    md["tensors"] = json.dumps({"w": ["", [4]]})
    save_file({"w": torch.ones(3)}, str(tmp_path / "bad.safetensors"), metadata=md)
    with pytest.raises(MergeError, match="stored as"):
        read_delta(tmp_path / "bad.safetensors")
