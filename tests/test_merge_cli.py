"""`skillswarm merge run/delta/apply/analyze`: the console script for a run and an error (a process each costs
seconds of torch import), the rest in-process through typer's runner (the same command code)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from skillswarm.merge.methods import merge
from skillswarm.node.cli.app import app
from skillswarm.protocol.errors import MergeError
from skillswarm.protocol.hashing import weights_hash
from skillswarm.protocol.records import MergePolicy
from tests.conftest import run_cli


def cli(*args: str) -> str:
    """Run a command in-process; return its stdout (raising what the command raised)."""
    result = CliRunner().invoke(app, list(args), catch_exceptions=True, env={"COLUMNS": "200"})
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    assert result.exit_code == 0, result.output
    return result.stdout


@pytest.fixture
def models(tmp_path: Path) -> dict[str, Path]:
    g = torch.Generator().manual_seed(0)
    base = {"emb": torch.randn(40, 16, generator=g), "norm": torch.ones(16)}
    paths = {}
    for name, scale in (("base", 0.0), ("ft1", 0.02), ("ft2", 0.02)):
        d = tmp_path / name
        d.mkdir()
        sd = {k: v + torch.randn(v.shape, generator=g) * scale for k, v in base.items()}
        save_file(sd, str(d / "model.safetensors"), metadata={"format": "pt"})
        (d / "config.json").write_text('{"model_type": "tiny"}')
        paths[name] = d
    return paths


def test_merge_delta_run_apply_and_analyze(models: dict[str, Path], tmp_path: Path) -> None:
    for i, ft in enumerate(("ft1", "ft2")):
        made = json.loads(cli("merge", "delta", "--base", str(models["base"]), "--tuned", str(models[ft]),
                                  "--out", str(tmp_path / f"d{i}.safetensors"), "--codec", "dense_fp32",
                                  "--skill", f"s{i}", "--json"))
        assert made["codec"] == "dense_fp32" and made["rel_error"] == 0.0 and made["num_tensors"] == 2
    topk = json.loads(cli("merge", "delta", "--base", str(models["base"]), "--tuned", str(models["ft1"]),
                              "--out", str(tmp_path / "t.safetensors"), "--codec", "topk", "--density", "0.25",
                              "--json"))
    assert topk["size"] < made["size"] and 0 < topk["rel_error"] < 1
    out = json.loads(run_cli("merge", "run", "--base", str(models["base"]), "--delta", str(tmp_path / "d0.safetensors"),
                             "--delta", str(tmp_path / "d1.safetensors"), "--method", "ties", "--density", "0.5",
                             "--lambda", "1.0", "--out", str(tmp_path / "merged"), "--delta-out",
                             str(tmp_path / "m.safetensors"), "--json").stdout)
    assert out["weights_hash"] == weights_hash(tmp_path / "merged")
    assert {f["path"] for f in out["files"]} == {"config.json", "model.safetensors"}
    base, a, b = (load_file(str(models[n] / "model.safetensors")) for n in ("base", "ft1", "ft2"))
    got = load_file(str(tmp_path / "merged" / "model.safetensors"))
    for k in base:
        assert torch.equal(got[k], base[k] + merge("ties", [a[k] - base[k], b[k] - base[k]], density=0.5))
    same = json.loads(cli("merge", "run", "--base", str(models["base"]), "--model", str(models["ft1"]), "--model",
                              str(models["ft2"]), "--method", "ties", "--density", "0.5", "--out", str(tmp_path / "merged2"),
                              "--json"))
    assert same["weights_hash"] == out["weights_hash"]
    applied = json.loads(cli("merge", "apply", "--base", str(models["base"]), "--delta", str(tmp_path / "m.safetensors"),
                                 "--out", str(tmp_path / "applied"), "--json"))
    assert applied["weights_hash"] == out["weights_hash"]
    report = json.loads(cli("merge", "analyze", str(tmp_path / "d0.safetensors"), str(tmp_path / "d1.safetensors"),
                                "--plot", str(tmp_path / "cos.png"), "--json"))
    d0 = torch.cat([(a[k] - base[k]).reshape(-1) for k in sorted(base)])
    d1 = torch.cat([(b[k] - base[k]).reshape(-1) for k in sorted(base)])
    assert report["cosine"][0][1] == pytest.approx(float(torch.nn.functional.cosine_similarity(d0, d1, dim=0)), abs=1e-5)
    assert report["norms"][0] == pytest.approx(float(d0.norm()), rel=1e-5) and report["skills"] == ["s0", "s1"]
    assert (tmp_path / "cos.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = cli("merge", "analyze", str(tmp_path / "d0.safetensors"), str(tmp_path / "d1.safetensors"), "--no-progress")
    assert "cosine similarity" in table and "emb" in table


def test_recipe_and_errors(models: dict[str, Path], tmp_path: Path) -> None:
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"""
merge_method: dare_ties
base_model: {models['base']}
models:
  - model: {models['base']}
  - model: {models['ft1']}
    parameters: {{weight: 1.0, density: 0.6}}
  - model: {models['ft2']}
    parameters: {{weight: 0.5}}
parameters: {{density: 0.4, lambda: 0.9, int8_mask: true}}
dtype: bfloat16
seed: 5
""")
    a = json.loads(cli("merge", "run", "--recipe", str(recipe), "--out", str(tmp_path / "a"), "--json"))
    from skillswarm.merge.streaming import MergeInput, MergeSpec, merge_models

    # a recipe's dare_ties is mergekit's: random drop, then the L1 rescale (DELLA's sparsifier at epsilon 0)
    lib = merge_models(models["base"], [MergeInput(models["ft1"], 1.0, 0.6), MergeInput(models["ft2"], 0.5)],
                       MergeSpec("della", {"density": 0.4, "scale": 0.9, "epsilon": 0.0, "normalize": False}),
                       tmp_path / "b", seed=5, out_dtype=torch.bfloat16, progress=False)
    assert a["weights_hash"] == lib.weights_hash and a["inputs"] == [str(models["ft1"]), str(models["ft2"])]
    assert a["method"] == "dare_ties"
    bad = run_cli("merge", "run", "--base", str(models["base"]), "--model", str(models["ft1"]), "--method", "karcher",
                  "--out", str(tmp_path / "c"), check=False)
    assert bad.returncode == 1 and "unknown merge method 'karcher'" in bad.stderr and not (tmp_path / "c").exists()
    recipe.write_text("merge_method: ties\nbase_model: x\nmodels: []\nslices: []\n")
    with pytest.raises(MergeError, match="slices"):
        cli("merge", "run", "--recipe", str(recipe), "--out", str(tmp_path / "c"))
    with pytest.raises(MergeError, match="not a skillswarm delta"):
        cli("merge", "run", "--base", str(models["base"]), "--delta", str(models["base"] / "model.safetensors"),
            "--out", str(tmp_path / "c"))


def test_merge_run_defaults_are_the_network_policys(models: dict[str, Path], tmp_path: Path) -> None:
    # With no --method, --density or --lambda, `merge run` merges as a coordinator would (MergePolicy), not with
    # the method's own defaults (TIES's density 0.2).
    policy = MergePolicy()
    out = json.loads(cli("merge", "run", "--base", str(models["base"]), "--model", str(models["ft1"]), "--model",
                         str(models["ft2"]), "--out", str(tmp_path / "merged"), "--json"))
    assert out["method"] == policy.method and out["params"] == {"density": policy.density, "scale": policy.scale}
    base, a, b = (load_file(str(models[n] / "model.safetensors")) for n in ("base", "ft1", "ft2"))
    got = load_file(str(tmp_path / "merged" / "model.safetensors"))
    for k in base:
        want = base[k] + merge(policy.method, [a[k] - base[k], b[k] - base[k]], density=policy.density, scale=policy.scale)
        assert torch.equal(got[k], want)
    # a method without a density takes none of the policy's: task_arithmetic gets only lambda
    ta = json.loads(cli("merge", "run", "--base", str(models["base"]), "--model", str(models["ft1"]), "--method",
                        "task_arithmetic", "--out", str(tmp_path / "ta"), "--json"))
    assert ta["params"] == {"scale": policy.scale}
