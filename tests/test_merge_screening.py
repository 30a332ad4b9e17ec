"""Screening: good deltas pass; each kind of bad delta is rejected with a reason that says why."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from skillswarm.merge.deltas import encode_delta
from skillswarm.merge.screening import DeltaCandidate, screen_deltas
from skillswarm.merge.tensorfile import TensorFile

H0, H1 = "0" * 64, "1" * 64


def test_screening_accepts_good_deltas_and_explains_every_rejection(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(0)
    base = {"emb": torch.randn(50, 8, generator=g), "norm": torch.ones(8), "pos": torch.arange(4)}
    (tmp_path / "base").mkdir()
    save_file(base, str(tmp_path / "base" / "model.safetensors"))
    floats = {k: v for k, v in base.items() if v.is_floating_point()}
    dtypes = {k: v.dtype for k, v in floats.items()}

    def make(name: str, delta: dict, codec: str = "dense_bf16", base_hash: str | None = H0, **kw) -> Path:
        return encode_delta(delta, tmp_path / f"{name}.safetensors", codec, base_hash=base_hash,
                            dtypes=kw.pop("dtypes", dtypes), **kw).path

    small = lambda s=1.0: {k: torch.randn(v.shape, generator=g) * 0.01 * s for k, v in floats.items()}  # noqa: E731
    good = [make(f"good{i}", small()) for i in range(3)]
    good.append(make("lora", {"emb": torch.randn(50, 8, generator=g) * 0.01}, "lora", rank=2))  # may leave tensors out
    good.append(make("topk", small(), "topk", density=0.25))
    cases = {
        "huge": (make("huge", small(100.0)), "median"),
        "other-base": (make("other", small(), base_hash=H1), "not this round's base"),
        "no-hash": (make("nohash", small(), base_hash=None), "records no base hash"),
        "unknown": (make("unknown", {**small(), "extra": torch.zeros(2)}, dtypes=dtypes), "unknown tensor names"),
        "missing": (make("missing", {"emb": torch.zeros(50, 8)}), "missing tensors"),
        "shape": (make("shape", {**small(), "norm": torch.zeros(9)}), "wrong shape"),
        "dtype": (make("dtype", small(), dtypes={"emb": torch.bfloat16, "norm": torch.float32}), "wrong dtype"),
        "int": (make("int", {**small(), "pos": torch.zeros(4)}, dtypes=dtypes), "non-floating-point"),
    }
    # non-finite values and broken top-k indices cannot be encoded by our writer: forge them
    nan = make("nan", small(), "dense_fp32")
    t = TensorFile(nan)
    forged = {k: t.read(k) for k in t.keys()}
    forged["norm"][3] = float("nan")
    save_file(forged, str(nan), metadata=t.metadata)
    cases["nan"] = (nan, "non-finite")
    topk = make("badtopk", small(), "topk", density=0.5)
    t = TensorFile(topk)
    forged = {k: t.read(k) for k in t.keys()}
    forged["emb::idx"] = forged["emb::idx"].flip(0).contiguous()
    save_file(forged, str(topk), metadata=t.metadata)
    cases["topk"] = (topk, "not strictly increasing")
    (tmp_path / "junk.safetensors").write_bytes(b"garbage")
    cases["junk"] = (tmp_path / "junk.safetensors", "unreadable delta")
    claim = make("claim", small())
    cases["claim"] = (claim, "its manifest claims")

    cands = [DeltaCandidate(p, key=p.stem) for p in good]
    cands += [DeltaCandidate(p, key=k, base_hash=H1 if k == "claim" else None) for k, (p, _) in cases.items()]
    result = screen_deltas(tmp_path / "base", cands, base_hash=H0, max_norm_ratio=5.0)
    assert [a.candidate.key for a in result.accepted] == [p.stem for p in good]
    reasons = {r.candidate.key: r.reason for r in result.rejected}
    assert set(reasons) == set(cases)
    for key, (_, words) in cases.items():
        assert words in reasons[key], (key, reasons[key])
        assert len(reasons[key]) <= 256
    assert result.median_norm and all(a.norm > 0 for a in result.accepted)
    # the outlier test is configurable
    loose = screen_deltas(tmp_path / "base", [*good, cases["huge"][0]], base_hash=H0, max_norm_ratio=None)
    assert len(loose.accepted) == len(good) + 1 and not loose.rejected
    assert json.loads(TensorFile(good[0]).metadata["tensors"])["emb"][0] == "F32"
