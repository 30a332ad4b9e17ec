"""The streaming merge: equal to whole-tensor merging, deterministic, sharded HF output that loads,
two-level coordinator merges, bit-identical apply, atomic output, and flat memory."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import skillswarm.merge.streaming as streaming
from skillswarm.merge.aggregate import aggregate
from skillswarm.merge.deltas import encode_delta
from skillswarm.merge.methods import get_method, merge, merge_tensors
from skillswarm.merge.pipeline import apply_delta
from skillswarm.merge.streaming import MergeInput, MergeSpec, merge_checkpoint, merge_deltas, merge_models
from skillswarm.protocol.errors import MergeError
from skillswarm.protocol.hashing import sha256_file, weights_hash
from skillswarm.protocol.records import MergePolicy

PARAMS = {"linear": {}, "task_arithmetic": {"lambda": 0.7}, "ties": {"density": 0.3}, "dare_linear": {"density": 0.5},
          "dare_ties": {"density": 0.5}, "breadcrumbs": {"density": 0.3, "gamma": 0.05}}


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, torch.Tensor]]:
    """A tiny random Llama saved by transformers (config, generation config, safetensors)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, tie_word_embeddings=False)
    d = tmp_path_factory.mktemp("llama") / "base"
    LlamaForCausalLM(cfg).save_pretrained(d)
    return d, load_file(str(d / "model.safetensors"))


def _deltas(base: dict[str, torch.Tensor], n: int, seed: int = 1) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [{k: torch.randn(v.shape, generator=g) * 0.01 for k, v in base.items()} for _ in range(n)]


def _write(deltas: list[dict[str, torch.Tensor]], where: Path, codec: str = "dense_fp32") -> list[Path]:
    return [encode_delta(d, where / f"d{i}.safetensors", codec).path for i, d in enumerate(deltas)]


@pytest.mark.parametrize("method", list(PARAMS))
def test_streaming_equals_whole_tensor_merge(model, tmp_path: Path, method: str, monkeypatch) -> None:
    base_dir, base = model
    deltas = _deltas(base, 3)
    paths = _write(deltas, tmp_path)
    monkeypatch.setattr(streaming, "FULL_TENSOR_ELEMS", 700)  # big tensors take the histogram path
    res = merge_deltas(base_dir, [MergeInput(p, w) for p, w in zip(paths, [1.0, 0.5, 2.0])],
                       MergeSpec(method, PARAMS[method]), tmp_path / "out", seed=3, chunk_elems=500, progress=False)
    out = load_file(str(tmp_path / "out" / "model.safetensors"))
    for name, b in base.items():
        m = get_method(method)
        merged = merge_tensors(m, [d[name] for d in deltas], [1.0, 0.5, 2.0], m.make_params(PARAMS[method]),
                                         seed=3, name=name, keys=["0", "1", "2"])
        assert torch.equal(out[name], b + merged), name
    assert res.weights_hash == weights_hash(tmp_path / "out")
    assert {f.path for f in res.files} == {"config.json", "generation_config.json", "model.safetensors"}
    assert all(f.sha256 == sha256_file(tmp_path / "out" / f.path) for f in res.files)


def test_deterministic_across_runs_threads_and_chunking_and_loads_sharded(model, tmp_path: Path) -> None:
    base_dir, base = model
    paths = _write(_deltas(base, 4), tmp_path, "dense_bf16")
    spec = MergeSpec("ties", {"density": 0.2})
    runs = [merge_deltas(base_dir, paths, spec, tmp_path / f"o{i}", workers=w, chunk_elems=c, max_shard_bytes=40_000,
                         progress=False) for i, (w, c) in enumerate([(2, 1 << 18), (2, 1 << 18), (1, 300)])]
    assert len({r.weights_hash for r in runs}) == 1
    assert [f.sha256 for f in runs[0].files] == [f.sha256 for f in runs[1].files] == [f.sha256 for f in runs[2].files]
    shards = sorted(p.name for p in (tmp_path / "o0").glob("*.safetensors"))
    assert len(shards) > 1 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    index = json.loads((tmp_path / "o0" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(base) and set(index["weight_map"].values()) == set(shards)
    from transformers import LlamaForCausalLM

    loaded = LlamaForCausalLM.from_pretrained(tmp_path / "o0")
    ours = {k: v for p in shards for k, v in load_file(str(tmp_path / "o0" / p)).items()}
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in ours.items())


def test_coordinator_merge_two_levels_and_bit_identical_apply(model, tmp_path: Path) -> None:
    base_dir, base = model
    bf = tmp_path / "bf16"  # a bf16 checkpoint V, as real networks run
    bf.mkdir()
    save_file({k: v.bfloat16() for k, v in base.items()}, str(bf / "model.safetensors"), metadata={"format": "pt"})
    (bf / "config.json").write_text((base_dir / "config.json").read_text())
    deltas = _deltas(base, 5, seed=2)
    paths = _write(deltas, tmp_path)
    groups = {"math": [(paths[0], 1.0), (paths[1], 1.0), (paths[2], 1.0)], "code": [(paths[3], 2.0), (paths[4], 1.0)]}
    policy = MergePolicy(method="ties", aggregator="median", density=0.5, scale=1.0)
    res = merge_checkpoint(bf, groups, policy, tmp_path / "v1", delta_out=tmp_path / "v0-v1.safetensors",
                           delta_codec="dense_bf16", base_hash="cd" * 32, chunk_elems=400, progress=False)
    out = load_file(str(tmp_path / "v1" / "model.safetensors"))
    for name, b in base.items():
        code = aggregate("median", [deltas[3][name], deltas[4][name]])
        math_ = aggregate("median", [d[name] for d in deltas[:3]])
        merged = merge("ties", [code, math_], density=0.5)  # skills in sorted order: code, math
        want = (b.bfloat16().float() + merged.bfloat16().float()).bfloat16()
        assert torch.equal(out[name], want), name
    assert res.delta is not None and res.delta.base_hash == "cd" * 32
    applied = apply_delta(bf, tmp_path / "v0-v1.safetensors", tmp_path / "v1-worker", progress=False)
    assert applied.weights_hash == res.weights_hash
    assert [(f.path, f.sha256) for f in applied.files] == [(f.path, f.sha256) for f in res.files]


def test_models_in_equal_deltas_in_and_recipe_dtype(model, tmp_path: Path) -> None:
    base_dir, base = model
    deltas = _deltas(base, 2)
    dirs = []
    for i, d in enumerate(deltas):
        (tmp_path / f"m{i}").mkdir()
        save_file({k: base[k] + d[k] for k in base}, str(tmp_path / f"m{i}" / "model.safetensors"))
        dirs.append(tmp_path / f"m{i}")
    exact = [{k: (base[k] + d[k]) - base[k] for k in base} for d in deltas]
    a = merge_models(base_dir, dirs, MergeSpec("ties", {"density": 0.4}), tmp_path / "a", progress=False)
    b = merge_deltas(base_dir, _write(exact, tmp_path), MergeSpec("ties", {"density": 0.4}), tmp_path / "b", progress=False)
    assert a.weights_hash == b.weights_hash
    c = merge_models(base_dir, dirs, MergeSpec("linear"), tmp_path / "c", out_dtype=torch.bfloat16, progress=False)
    assert all(v.dtype == torch.bfloat16 for v in load_file(str(c.out_dir / "model.safetensors")).values())


def test_output_is_atomic_and_inputs_are_checked(model, tmp_path: Path, monkeypatch) -> None:
    base_dir, base = model
    paths = _write(_deltas(base, 2), tmp_path)
    spec = MergeSpec("task_arithmetic")
    calls = {"n": 0}
    real = streaming._MergeEngine.compute

    def crash(self, *a):
        calls["n"] += 1
        if calls["n"] == 5:
            raise RuntimeError("disk on fire")
        return real(self, *a)

    monkeypatch.setattr(streaming._MergeEngine, "compute", crash)
    with pytest.raises(RuntimeError, match="disk on fire"):
        merge_deltas(base_dir, paths, spec, tmp_path / "out", progress=False, delta_out=tmp_path / "md.safetensors")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d0.safetensors", "d1.safetensors"]  # no debris
    monkeypatch.undo()
    merge_deltas(base_dir, paths, spec, tmp_path / "out", progress=False)
    with pytest.raises(MergeError, match="already exists"):
        merge_deltas(base_dir, paths, spec, tmp_path / "out", progress=False)
    merge_deltas(base_dir, paths, spec, tmp_path / "out", progress=False, overwrite=True)
    wrong = {k: torch.zeros(3) for k in base}
    encode_delta(wrong, tmp_path / "wrong.safetensors", "dense_fp32")
    with pytest.raises(MergeError, match="another model"):
        merge_deltas(base_dir, [tmp_path / "wrong.safetensors"], spec, tmp_path / "x", progress=False)
    with pytest.raises(MergeError, match="is not a model directory"):
        merge_models(base_dir, [paths[0]], spec, tmp_path / "x", progress=False)


# VmHWM, not ru_maxrss: Linux carries ru_maxrss over exec from the forked (pytest-sized) parent. A tiny merge
# first pays the one-time costs (lazy kernel and thread set-up, ~20 MB) so that the figure is the merge's own.
MEMORY_PROBE = """
import re, sys, psutil, torch
from pathlib import Path
from safetensors.torch import save_file
from skillswarm.merge.deltas import encode_delta
from skillswarm.merge.streaming import MergeSpec, merge_deltas
hwm = lambda: int(re.search(r"VmHWM:\\s+(\\d+) kB", open("/proc/self/status").read()).group(1)) * 1024
d = Path(sys.argv[1])
spec = MergeSpec("ties", {"density": 0.2})
(d / "warm").mkdir()
save_file({"w": torch.ones(8, 8)}, str(d / "warm" / "model.safetensors"))
encode_delta({"w": torch.ones(8, 8)}, d / "warm.safetensors", "dense_bf16")
merge_deltas(d / "warm", [d / "warm.safetensors"] * 8, spec, d / "warm-out", chunk_elems=1 << 16, progress=False)
before = psutil.Process().memory_info().rss
deltas = sorted(d.glob("d*.safetensors"))
runs = [merge_deltas(d / "base", deltas, spec, d / f"out{i}", chunk_elems=1 << 16, progress=False) for i in range(2)]
print(hwm() - before, [(r.weights_hash, [f.sha256 for f in r.files]) == (runs[0].weights_hash, [f.sha256 for f in runs[0].files]) for r in runs])
"""


@pytest.mark.slow
def test_memory_stays_flat_and_two_runs_agree(tmp_path: Path) -> None:
    """8 deltas of a 128 MiB fp32 model: a naive merge holds >= 9 models (1.1 GiB); this one grows by less than
    half a model (a few row chunks per input plus one whole tensor per worker), and two runs agree byte for byte.
    (bench/merge.py --memory gives the 1 GB-model figure.)"""
    g = torch.Generator().manual_seed(0)
    shapes = {f"layer{i}.w": (1024, 1024) for i in range(32)}
    (tmp_path / "base").mkdir()
    save_file({k: torch.randn(s, generator=g) for k, s in shapes.items()}, str(tmp_path / "base" / "model.safetensors"))
    for i in range(8):  # two distinct deltas, four copies each (the merge reads eight files all the same)
        if i < 2:
            encode_delta({k: torch.randn(s, generator=g) * 0.01 for k, s in shapes.items()},
                         tmp_path / f"d{i}.safetensors", "dense_bf16")
        else:
            shutil.copyfile(tmp_path / f"d{i % 2}.safetensors", tmp_path / f"d{i}.safetensors")
    model_bytes = sum(a * b for a, b in shapes.values()) * 4
    out = subprocess.run([sys.executable, "-c", MEMORY_PROBE, str(tmp_path)], capture_output=True, text=True,
                         timeout=300, check=True).stdout.split(" ", 1)
    growth = int(out[0])
    assert growth < model_bytes / 2, f"peak RSS grew by {growth / 2**20:.0f} MiB for a {model_bytes >> 20} MiB model"
    assert out[1].strip() == "[True, True]"  # the second run wrote the same bytes and hash
