"""LoRA deltas in PEFT's format, end to end on the nano model: a LoRA run's delta is a PEFT adapter that
`PeftModel.from_pretrained` loads and that computes what base + delta computes; the coordinator's merge of
two adapters is the exact LoRA product (PEFT's scaling included) and recomputes to the same bits with
other threads and chunk sizes; `merge delta --codec lora` writes an adapter PEFT loads."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from skillswarm.merge import apply_delta, encode_delta, merge_checkpoint, read_delta, screen_deltas
from skillswarm.merge.deltas import dense_codec_for
from skillswarm.merge.exact import lora_product
from skillswarm.merge.peft_format import CONFIG_NAME, WEIGHTS_NAME, part_names, write_adapter_dir
from skillswarm.merge.screening import DeltaCandidate
from skillswarm.protocol.errors import MergeError
from skillswarm.protocol.hashing import sha256_file, weights_hash
from skillswarm.protocol.records import MergePolicy

RANK, ALPHA = 4, 16.0  # scaling 4: PEFT's B is unscaled in the file, so decoding must apply it
IDS = torch.tensor([[5, 9, 14, 20, 27, 33, 41, 2]])


@pytest.fixture(scope="module")
def runs(nano_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Two real LoRA training runs (two skills, two GRPO steps each) that publish their adapters."""
    from skillswarm.node.rl.config import TrainConfig
    from skillswarm.node.rl.run import train

    out = {}
    for skill in ("reverse", "sort"):
        cfg = TrainConfig(model_dir=nano_model, skill=skill, steps=2, out_dir=tmp_path_factory.mktemp(skill) / "run",
                          lora=True, lora_rank=RANK, lora_alpha=ALPHA, codec="lora", group_size=4, batch=2,
                          max_new_tokens=16, eval_n=0, lr=1e-2, warmup_steps=0, async_mode="thread", threads=1)
        out[skill] = train(cfg, progress=False)
    return out


def _logits(model: Any) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=IDS).logits


def _base(nano_model: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(nano_model, dtype=torch.float32)


@pytest.mark.slow  # trains
def test_a_lora_run_publishes_a_peft_adapter(runs: dict[str, Any], nano_model: Path, tmp_path: Path) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    result = runs["reverse"]
    adapter = result.adapter_dir
    assert adapter is not None and sorted(p.name for p in adapter.iterdir()) == [CONFIG_NAME, WEIGHTS_NAME]
    config = json.loads((adapter / CONFIG_NAME).read_text())
    assert config["peft_type"] == "LORA" and config["r"] == RANK and config["lora_alpha"] == ALPHA
    assert sha256_file(adapter / WEIGHTS_NAME) == result.delta.sha256  # the published blob is the adapter itself
    assert result.delta.codec == "lora" and result.delta.base_hash == weights_hash(nano_model)

    peft_model = PeftModel.from_pretrained(_base(nano_model), str(adapter))
    applied = apply_delta(nano_model, result.delta.path, tmp_path / "applied", progress=False)
    plain = AutoModelForCausalLM.from_pretrained(applied.out_dir, dtype=torch.float32)
    got, want, base = _logits(peft_model), _logits(plain), _logits(_base(nano_model))
    assert (want - base).abs().max() > 1e-2  # the adapter learned something
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)

    # the delta is (B * lora_alpha / r) @ A as the exact product, B as PEFT stores it (unscaled)
    tensors = load_file(result.delta.path)
    with read_delta(result.delta.path) as d:
        name = d.names()[0]
        a, b = (tensors[n] for n in part_names(name))
        assert torch.equal(d.get(name), lora_product(b * (ALPHA / RANK), a))
        assert torch.equal(d.rows(name, 3, 7), d.get(name)[3:7])

    # a verifier holding only the blob rebuilds the adapter directory
    rebuilt = write_adapter_dir(result.delta.path, tmp_path / "rebuilt")
    again = json.loads((rebuilt / CONFIG_NAME).read_text())
    assert again | {"base_model_name_or_path": None} == config | {"base_model_name_or_path": None}
    torch.testing.assert_close(_logits(PeftModel.from_pretrained(_base(nano_model), str(rebuilt))), got)
    with pytest.raises(MergeError, match="exists"):
        write_adapter_dir(result.delta.path, rebuilt)


@pytest.mark.slow  # trains
def test_the_coordinator_merges_two_adapters_bit_stably(runs: dict[str, Any], nano_model: Path, tmp_path: Path) -> None:
    deltas = {skill: r.delta.path for skill, r in runs.items()}
    base_hash = weights_hash(nano_model)
    screened = screen_deltas(nano_model, [DeltaCandidate(p, key=s, skill=s, base_hash=base_hash) for s, p in deltas.items()],
                             base_hash=base_hash)
    assert not screened.rejected and len(screened.accepted) == 2

    def merge(groups: dict[str, list[tuple[Path, float]]], out: str, **options: int) -> tuple[str, str]:
        r = merge_checkpoint(nano_model, groups, MergePolicy(), tmp_path / out, delta_out=tmp_path / f"{out}.safetensors",
                             delta_codec=dense_codec_for(nano_model), base_hash=base_hash, progress=False, **options)
        assert r.delta is not None
        return r.weights_hash, r.delta.sha256

    groups = {s: [(p, 1.0)] for s, p in deltas.items()}
    first = merge(groups, "a", workers=1, chunk_elems=1 << 20)
    assert first[0] != base_hash
    assert merge(groups, "b", workers=2, chunk_elems=37) == first  # another machine's threads and chunks

    # the same adapters in the lora codec's own layout, PEFT's scaling folded into B, merge to the same bits
    folded = {}
    for skill, path in deltas.items():
        tensors = load_file(path)
        with read_delta(path) as d:
            factors = {}
            for name in d.names():
                a, b = (tensors[n] for n in part_names(name))
                factors[name] = (a, b * (ALPHA / RANK))
        folded[skill] = encode_delta(factors, tmp_path / f"{skill}-folded.safetensors", "lora", base_hash=base_hash,
                                     skill=skill).path
    assert merge({s: [(p, 1.0)] for s, p in folded.items()}, "c", workers=2, chunk_elems=1000) == first


@pytest.mark.slow  # trains
def test_merge_delta_lora_writes_a_peft_adapter(runs: dict[str, Any], nano_model: Path, tmp_path: Path) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM
    from typer.testing import CliRunner

    from skillswarm.node.cli.app import app

    def cli(*args: str) -> Any:  # in-process through typer's runner: the command's own code, no torch import
        return CliRunner().invoke(app, list(args), env={"COLUMNS": "200"})

    tuned = runs["sort"].model_dir  # its change is rank RANK on the linear layers: SVD of rank RANK recovers it
    proc = cli("merge", "delta", "--base", str(nano_model), "--tuned", str(tuned), "--out", str(tmp_path / "d.safetensors"),
               "--codec", "lora", "--rank", str(RANK), "--adapter-out", str(tmp_path / "adapter"), "--json")
    assert proc.exit_code == 0, proc.output
    data = json.loads(proc.stdout)
    assert data["codec"] == "lora" and data["rel_error"] < 1e-3 and Path(data["adapter"]) == tmp_path / "adapter"
    with safe_open(str(tmp_path / "d.safetensors"), "pt") as f:
        assert all(k.startswith("base_model.model.") and ".lora_" in k for k in f.keys())
    peft_model = PeftModel.from_pretrained(_base(nano_model), str(tmp_path / "adapter"))
    want = _logits(AutoModelForCausalLM.from_pretrained(tuned, dtype=torch.float32))
    torch.testing.assert_close(_logits(peft_model), want, atol=1e-3, rtol=1e-3)

    bad = cli("merge", "delta", "--base", str(nano_model), "--tuned", str(tuned), "--out", str(tmp_path / "x.safetensors"),
              "--adapter-out", str(tmp_path / "x"))
    assert bad.exit_code == 1 and "needs --codec lora" in bad.output and not (tmp_path / "x.safetensors").exists()


@pytest.mark.slow  # trains
def test_a_network_of_another_codec_admits_adapters(runs: dict[str, Any], nano_model: Path, tmp_path: Path) -> None:
    from skillswarm.node.roles.rounds import Candidate, RoundInputs, RoundState
    from skillswarm.node.roles.rounds.inspection import Inspect
    from skillswarm.protocol.identity import Identity
    from skillswarm.protocol.records import CheckpointManifest, DeltaManifest, FileEntry, NetworkSpec, ScreenPolicy
    from skillswarm.protocol.transport.blobs import BlobStore

    h, key = weights_hash(nano_model), Identity.generate()
    spec = NetworkSpec(network="peft", base_model=str(nano_model), base_hash=h, skills=["reverse", "sort"],
                       codec="dense_bf16", screen=ScreenPolicy(eval_n=0))
    parent = CheckpointManifest(network="peft", version=0, weights_hash=h,
                                files=[FileEntry(path="config.json", sha256="1" * 64, size=2)])
    inputs = RoundInputs(spec=spec, parent=parent, base_dir=nano_model, blobs=BlobStore(tmp_path / "blobs"),
                         history=[parent])
    candidates = [Candidate(key.sign_record(DeltaManifest(
        network="peft", skill=skill, base_version=0, base_hash=h, blob=r.delta.sha256, size=r.delta.size, codec="lora",
        codec_params=r.delta.params, norm=r.delta.norm, num_tensors=r.delta.num_tensors)), path=r.delta.path)
        for skill, r in runs.items()]
    verdict = Inspect()(inputs, RoundState(candidates))
    kept = verdict.passed
    assert len(kept) == 2 and not verdict.rejected  # the file's norm is the claimed one, to the bit
    assert all(c.norm == c.manifest.norm for c in kept)


def _peft_file(path: Path, config: dict[str, Any], factors: dict[str, tuple[torch.Tensor, torch.Tensor]],
               shapes: dict[str, list[int]]) -> Path:
    """A PEFT delta written by hand, as another implementation (or an attacker) could write one."""
    from safetensors.torch import save_file

    tensors = {}
    for name, (a, b) in factors.items():
        tensors.update(zip(part_names(name), (a, b)))
    metadata = {"format": "skillswarm-delta", "format_version": "2", "codec": "lora", "codec_params": "{}",
                "tensors": json.dumps({n: ["F32", s] for n, s in shapes.items()}), "peft_config": json.dumps(config)}
    save_file(tensors, str(path), metadata=metadata)
    return path


def test_peft_files_decode_with_their_scaling_and_layout(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(3, 5, generator=g), torch.randn(7, 3, generator=g)
    config = {"peft_type": "LORA", "r": 3, "lora_alpha": 6, "alpha_pattern": {"h.c_fc": 1.5}, "fan_in_fan_out": True}
    # a Conv1D module (GPT-2 style) stores its weight [in, out]: the delta is (B @ A)^T
    path = _peft_file(tmp_path / "t.safetensors", config, {"h.c_fc.weight": (a, b)}, {"h.c_fc.weight": [5, 7]})
    with read_delta(path) as d:
        want = lora_product(b * (1.5 / 3), a).T  # alpha_pattern's alpha for this module
        assert torch.equal(d.get("h.c_fc.weight"), want)
        assert all(torch.equal(d.rows("h.c_fc.weight", r, r + 2), want[r:r + 2]) for r in range(0, 5, 2))

    rsl = _peft_file(tmp_path / "r.safetensors", {"peft_type": "LORA", "r": 3, "lora_alpha": 6, "use_rslora": True},
                     {"q.weight": (a, b)}, {"q.weight": [7, 5]})
    with read_delta(rsl) as d:
        assert torch.equal(d.get("q.weight"), lora_product(b * (6 / 3 ** 0.5), a))

    hostile = [({"peft_type": "LORA", "r": 3, "lora_alpha": 6, "rank_pattern": {"(a+)+$": 3}}, "rank_pattern"),
               ({"peft_type": "LORA", "r": 3, "lora_alpha": 6, "use_dora": True}, "use_dora"),
               ({"peft_type": "LORA", "r": 2, "lora_alpha": 6}, "rank 3 but the adapter config says 2"),
               ({"peft_type": "IA3", "r": 3, "lora_alpha": 6}, "only LoRA")]
    for i, (cfg, why) in enumerate(hostile):
        bad = _peft_file(tmp_path / f"bad{i}.safetensors", cfg, {"q.weight": (a, b)}, {"q.weight": [7, 5]})
        with pytest.raises(MergeError, match=why):
            read_delta(bad)
    wrong_shape = _peft_file(tmp_path / "s.safetensors", {"peft_type": "LORA", "r": 3, "lora_alpha": 3},
                             {"q.weight": (a, b)}, {"q.weight": [5, 7]})
    with pytest.raises(MergeError, match="expected A"):
        read_delta(wrong_shape)
    with pytest.raises(MergeError, match="not a PEFT adapter"):
        write_adapter_dir(encode_delta({"q.weight": torch.ones(2, 2)}, tmp_path / "d.safetensors", "dense_fp32").path,
                          tmp_path / "nope")
