"""Hashing: streaming file hashes and the canonical state-dict hash."""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch
from safetensors.torch import save_file

from skillswarm.protocol.hashing import safetensors_hash, sha256_file, state_dict_hash, weights_hash


def test_sha256_file_matches_hashlib_across_chunk_boundaries(tmp_path: Path) -> None:
    data = bytes(range(256)) * 10_000 + b"tail"
    p = tmp_path / "blob"
    p.write_bytes(data)
    assert sha256_file(p, chunk_size=4096) == hashlib.sha256(data).hexdigest() == sha256_file(p)


def test_state_dict_hash_is_order_independent_and_sensitive() -> None:
    g = torch.Generator().manual_seed(1)
    a, b = torch.randn(3, 4, generator=g), torch.randn(5, generator=g)
    h = state_dict_hash({"a": a, "b": b})
    assert h == state_dict_hash({"b": b.clone(), "a": a.clone()})
    assert h != state_dict_hash({"a": a, "c": b})  # a name
    assert h != state_dict_hash({"a": a.reshape(4, 3), "b": b})  # a shape
    assert h != state_dict_hash({"a": a.double(), "b": b})  # a dtype
    bumped = a.clone()
    bumped[1, 2] = torch.nextafter(bumped[1, 2], torch.tensor(10.0))  # one ulp of one value
    assert h != state_dict_hash({"a": bumped, "b": b})
    assert h == state_dict_hash({"a": a.t().contiguous().t(), "b": b})  # memory layout does not matter
    # names cannot be forged by concatenation ("ab" + "" vs "a" + "b")
    assert state_dict_hash({"ab": torch.zeros(0)}) != state_dict_hash({"a": torch.zeros(0), "b": torch.zeros(0)})


def test_safetensors_hash_equals_state_dict_hash_whatever_the_sharding(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(2)
    sd = {f"layer.{i}.w": torch.randn(8, 8, generator=g).to(torch.bfloat16 if i % 2 else torch.float32) for i in range(6)}
    save_file(sd, str(tmp_path / "one.safetensors"))
    shard = tmp_path / "sharded"
    shard.mkdir()
    save_file({k: sd[k] for k in list(sd)[:2]}, str(shard / "model-00001-of-00002.safetensors"))
    save_file({k: sd[k] for k in list(sd)[2:]}, str(shard / "model-00002-of-00002.safetensors"))
    expected = state_dict_hash(sd)
    assert safetensors_hash([tmp_path / "one.safetensors"]) == expected == weights_hash(shard)
