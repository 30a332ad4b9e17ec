"""mergekit recipes as mergekit documents them: every method (slerp, della, model_stock and breadcrumbs_ties
included) against its formula on small real safetensors models, gradients and filters per tensor, `dtype`
recorded in config.json (transformers loads it back in that dtype), hub ids, tokenizer_source, and a clear
error naming the key for what is not supported."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import skillswarm.merge.streaming as streaming
from skillswarm.merge.deltas import encode_delta
from skillswarm.merge.methods import get_method, merge, merge_tensors
from skillswarm.merge.methods.model_stock import model_stock
from skillswarm.merge.methods.slerp import slerp
from skillswarm.merge.recipe import load_recipe, plan_recipe
from skillswarm.merge.recipe_params import evaluate, layer_t
from skillswarm.merge.streaming import MergeInput, MergeSpec, merge_deltas
from skillswarm.protocol.errors import MergeError
from tests.conftest import run_cli

T = torch.tensor


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A 3-layer random Llama saved by transformers, two fine-tunes of it and an unrelated model."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=48, hidden_size=16, intermediate_size=32, num_hidden_layers=3, num_attention_heads=2,
                      num_key_value_heads=1, tie_word_embeddings=False)
    root = tmp_path_factory.mktemp("recipes")
    LlamaForCausalLM(cfg).save_pretrained(root / "base")
    base = load_file(str(root / "base" / "model.safetensors"))
    g = torch.Generator().manual_seed(1)
    out = {"base": root / "base"}
    for name, scale, offset in (("ft1", 0.01, 0.0), ("ft2", 0.01, 0.0), ("ft3", 0.01, 0.0), ("far", 0.05, 1.0)):
        d = root / name
        shutil.copytree(root / "base", d)
        sd = {k: v + (torch.randn(v.shape, generator=g) * scale if offset == 0 else
                      torch.randn(v.shape, generator=g) * scale) for k, v in base.items()}
        save_file(sd, str(d / "model.safetensors"), metadata={"format": "pt"})
        out[name] = d
    return out


def sd(path: Path) -> dict[str, torch.Tensor]:
    return load_file(str(path / "model.safetensors"))


def run_recipe(tmp_path: Path, text: str, name: str = "out") -> dict[str, torch.Tensor]:
    r = tmp_path / f"{name}.yaml"
    r.write_text(text)
    plan = plan_recipe(load_recipe(r))
    merge_deltas(plan.base, plan.inputs, plan.spec, tmp_path / name, seed=plan.seed, out_dtype=plan.out_dtype,
                 tensor_params=plan.tensor_params, tokenizer_from=plan.tokenizer_from, progress=False)
    return sd(tmp_path / name)


def test_dtype_is_recorded_in_config_and_loads_back(llama, tmp_path: Path) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    text = (f"merge_method: ties\nbase_model: {llama['base']}\ndtype: float16\nmodels:\n"
            f"  - model: {llama['base']}\n  - model: {llama['ft1']}\n    parameters: {{weight: 1.0, density: 0.5}}\n"
            f"  - model: {llama['ft2']}\n    parameters: {{weight: 1.0, density: 0.5}}\n")
    out = run_recipe(tmp_path, text)
    assert {v.dtype for v in out.values()} == {torch.float16}
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["dtype"] == config["torch_dtype"] == "float16"
    assert AutoConfig.from_pretrained(tmp_path / "out").dtype == torch.float16
    assert next(AutoModelForCausalLM.from_pretrained(tmp_path / "out").parameters()).dtype == torch.float16
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype="auto")
    assert next(model.parameters()).dtype == torch.float16
    base, a, b = sd(llama["base"]), sd(llama["ft1"]), sd(llama["ft2"])
    for k, v in base.items():  # default density is mergekit's 1, per-model 0.5 here; computed in float32
        assert torch.equal(out[k], (v + merge("ties", [a[k] - v, b[k] - v], density=0.5)).half())
    mixed = run_recipe(tmp_path, text.replace("dtype: float16", "dtype: float32\nout_dtype: bfloat16"), "bf")
    assert {v.dtype for v in mixed.values()} == {torch.bfloat16}  # out_dtype wins, as in mergekit
    assert json.loads((tmp_path / "bf" / "config.json").read_text())["torch_dtype"] == "bfloat16"


def test_gradients_and_filters_per_tensor(llama, tmp_path: Path) -> None:
    assert evaluate([0.2, 1.0], "x", 0.5) == pytest.approx(0.6) and evaluate([0, 1, 0], "x", 0.75) == 0.5
    assert evaluate([{"filter": "mlp", "value": 3}, {"value": 1}], "model.layers.0.mlp.up_proj.weight", 0) == 3
    assert evaluate([{"filter": "mlp", "value": 3}], "model.norm.weight", 0) is None
    assert layer_t("model.layers.2.self_attn.q_proj.weight", 3) == 1.0 and layer_t("lm_head.weight", 3) == 0.0
    text = (f"merge_method: task_arithmetic\nbase_model: {llama['base']}\nmodels:\n"
            f"  - model: {llama['ft1']}\n    parameters:\n"
            "      weight:\n        - {filter: self_attn, value: [0.2, 1.0]}\n        - value: 0.6\n"
            f"  - model: {llama['ft2']}\nparameters: {{lambda: [1.0, 0.5], weight: 2.0}}\n")
    out = run_recipe(tmp_path, text)
    base, a, b = sd(llama["base"]), sd(llama["ft1"]), sd(llama["ft2"])
    for k, v in base.items():
        t = layer_t(k, 3)
        w = 0.2 + 0.8 * t if "self_attn" in k else 0.6
        lam = 1.0 - 0.5 * t
        assert torch.equal(out[k], v + merge("task_arithmetic", [a[k] - v, b[k] - v], [w, 2.0], scale=lam)), k
    # one slice spanning every layer is the same as `models`
    sliced = (f"merge_method: task_arithmetic\nbase_model: {llama['base']}\nslices:\n  - sources:\n"
              f"      - model: {llama['ft1']}\n        layer_range: [0, 3]\n        parameters: {{weight: 0.5}}\n"
              f"      - model: {llama['ft2']}\n        layer_range: [0, 3]\n")
    plain = (f"merge_method: task_arithmetic\nbase_model: {llama['base']}\nmodels:\n"
             f"  - model: {llama['ft1']}\n    parameters: {{weight: 0.5}}\n  - model: {llama['ft2']}\n")
    one, two = run_recipe(tmp_path, sliced, "s"), run_recipe(tmp_path, plain, "p")
    assert all(torch.equal(one[k], two[k]) for k in one)


def _slerp_reference(a: torch.Tensor, b: torch.Tensor, t: float) -> torch.Tensor:
    a64, b64 = a.double().reshape(-1), b.double().reshape(-1)
    cos = float(a64 @ b64 / a64.norm() / b64.norm())
    if abs(cos) > 0.9995:
        return ((1 - t) * a.double() + t * b.double()).float()
    th = math.acos(cos)
    return (math.sin((1 - t) * th) / math.sin(th) * a.double() + math.sin(t * th) / math.sin(th) * b.double()).float()


def test_slerp_with_filtered_gradient_t(llama, tmp_path: Path) -> None:
    text = (f"merge_method: slerp\nbase_model: {llama['base']}\nmodels:\n  - model: {llama['base']}\n"
            f"  - model: {llama['far']}\nparameters:\n  t:\n    - {{filter: self_attn, value: [0, 0.5, 1]}}\n"
            "    - {filter: mlp, value: [1, 0.5, 0]}\n    - value: 0.3\n")
    out = run_recipe(tmp_path, text)
    base, far = sd(llama["base"]), sd(llama["far"])
    for k, v in base.items():
        t = layer_t(k, 3)
        t = t if "self_attn" in k else 1 - t if "mlp" in k else 0.3
        assert torch.equal(out[k], v + (slerp(v, far[k], t) - v)), k  # the pure function, bit for bit
        assert torch.allclose(out[k], _slerp_reference(v, far[k], t), rtol=1e-5, atol=1e-6), k
        if t == 0.0:
            assert torch.equal(out[k], v)
    w = base["lm_head.weight"]
    tuned = w + torch.randn(w.shape, generator=torch.Generator().manual_seed(0)) * 1e-4  # nearly parallel: linear
    assert torch.equal(slerp(w, tuned, 0.25), w * 0.75 + tuned * 0.25)


def test_model_stock_against_its_formula(llama, tmp_path: Path) -> None:
    text = (f"merge_method: model_stock\nbase_model: {llama['base']}\nmodels:\n"
            + "".join(f"  - model: {llama[n]}\n" for n in ("base", "ft1", "ft2", "ft3")))
    out = run_recipe(tmp_path, text)
    base, ms = sd(llama["base"]), [sd(llama[n]) for n in ("ft1", "ft2", "ft3")]
    for k, w0 in base.items():
        ws = [m[k].double() for m in ms]
        off = [(w - w0.double()).reshape(-1) for w in ws]
        cos = [float(off[i] @ off[j] / (off[i].norm() * off[j].norm())) for i in range(3) for j in range(i + 1, 3)]
        c = sum(cos) / 3
        t = 3 * c / (1 + 2 * c)
        expected = t * sum(ws) / 3 + (1 - t) * w0.double()
        assert torch.allclose(out[k].double(), expected, rtol=1e-5, atol=1e-6), k
        assert torch.equal(out[k], w0 + (model_stock(w0, [m[k] for m in ms]) - w0)), k


def test_della_breadcrumbs_ties_and_linear_without_base(llama, tmp_path: Path) -> None:
    a, b = T([1.0, -2.0, 3.0, 0.5]), T([-1.0, -1.0, 1.0, 2.0])
    # breadcrumbs keeps a: [1, -2, 0, 0], b: [-1, -1, 1, 0]; signs by mass: [0 -> +, -3 -> -, +, 0 -> +]
    assert torch.equal(merge("breadcrumbs_ties", [a, b], density=0.5, gamma=0.25), T([1.0, -3.0, 1.0, 0.0]))
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(64, 512, generator=g) for _ in range(2)]
    assert torch.equal(merge("della", xs, density=1.0), merge("ties", xs, density=1.0))  # no drop: TIES itself
    one = merge("della_linear", xs[:1], density=0.5, epsilon=0.2, rescale=False)
    kept = one != 0
    assert abs(float(kept.float().mean()) - 0.5) < 0.01 and torch.equal(one[kept], xs[0][kept])
    mag = xs[0].abs()
    big, small = mag > mag.median(dim=1, keepdim=True).values, mag < mag.median(dim=1, keepdim=True).values
    assert float(kept[big].float().mean()) > 0.57 and float(kept[small].float().mean()) < 0.43  # 0.6 / 0.4 in mean
    scaled = merge("della_linear", xs[:1], density=0.5, epsilon=0.2)
    assert float(scaled.abs().sum()) == pytest.approx(float(xs[0].abs().sum()), rel=1e-5)  # L1 restored
    assert torch.equal(scaled, merge("della_linear", xs[:1], density=0.5, epsilon=0.2))  # seeded
    text = (f"merge_method: linear\ndtype: float32\nmodels:\n  - model: {llama['ft1']}\n    parameters: {{weight: 1.0}}\n"
            f"  - model: {llama['ft2']}\n    parameters: {{weight: 3.0}}\n")
    out = run_recipe(tmp_path, text)
    x, y = sd(llama["ft1"]), sd(llama["ft2"])
    for k in out:
        assert torch.allclose(out[k], (x[k] + 3 * y[k]) / 4, rtol=1e-6, atol=1e-7)


def test_slerp_and_model_stock_hand_computed() -> None:
    base, other = T([1.0, 0.0]), T([0.0, 1.0])  # theta = pi / 2: coefficients sin((1 - t) pi/2), sin(t pi/2)
    assert torch.allclose(slerp(base, other, 0.5), T([0.70710678, 0.70710678]), rtol=0, atol=6e-8)
    assert torch.allclose(slerp(base, other, 1 / 3), T([0.86602540, 0.5]), rtol=0, atol=6e-8)
    assert torch.equal(slerp(base, other, 0.0), base) and torch.equal(slerp(base, other, 1.0), other)
    # model_stock, base 0: orthogonal task vectors give t = 0 (the base); at 45 degrees (cos 1/sqrt 2, N = 2)
    # t = 2 cos / (1 + cos) = 2 (sqrt 2 - 1), times the mean [2, 1]
    zero = T([0.0, 0.0])
    assert torch.equal(model_stock(zero, [T([1.0, 0.0]), T([0.0, 1.0])]), zero)
    t = 2 * (math.sqrt(2) - 1)
    assert torch.allclose(model_stock(zero, [T([2.0, 0.0]), T([2.0, 2.0])]), T([2 * t, t]), rtol=0, atol=2e-7)


def test_dare_runs_as_mergekit_does(llama, tmp_path: Path) -> None:
    """mergekit's dare: keep with probability density, then restore the L1 norm (rescale, its default) or not."""
    head = f"merge_method: dare_linear\nbase_model: {llama['base']}\nseed: 4\nmodels:\n  - model: {llama['ft1']}\n"
    plan = plan_recipe(load_recipe(_write(tmp_path / "p.yaml", head + "    parameters: {weight: 1.0, density: 0.5}\n")))
    assert plan.method == "dare_linear" and plan.spec.method == "della_linear"
    assert dict(plan.tensor_params("lm_head.weight").shared) == {"epsilon": 0.0, "normalize": False, "rescale": True}
    scaled = run_recipe(tmp_path, head + "    parameters: {weight: 1.0, density: 0.5}\n", "scaled")
    plain = run_recipe(tmp_path, head + "    parameters: {weight: 1.0, density: 0.5}\nparameters: {rescale: false}\n",
                       "plain")
    base, a = sd(llama["base"]), sd(llama["ft1"])
    kept_total = n_total = 0
    for k, v in base.items():
        d = a[k] - v
        kept = plain[k] != v
        assert torch.equal(plain[k], v + torch.where(kept, d, 0.0)), k  # survivors as they are
        factor = float(d.double().abs().sum() / d[kept].double().abs().sum())
        assert torch.allclose(scaled[k], v + torch.where(kept, d * factor, 0.0), rtol=1e-6, atol=1e-9), k  # same mask
        kept_total, n_total = kept_total + int(kept.sum()), n_total + kept.numel()
    assert abs(kept_total / n_total - 0.5) < 0.03


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


@pytest.mark.parametrize("method,params", [("della", {"density": 0.6, "epsilon": 0.2}),
                                           ("della_linear", {"density": 0.5, "epsilon": 0.1, "rescale": False}),
                                           ("breadcrumbs_ties", {"density": 0.3, "gamma": 0.05}),
                                           ("slerp", {"t": 0.4}), ("model_stock", {})])
def test_streaming_equals_whole_tensor(llama, tmp_path: Path, method: str, params: dict, monkeypatch) -> None:
    base = sd(llama["base"])
    g = torch.Generator().manual_seed(5)
    deltas = [{k: torch.randn(v.shape, generator=g) * 0.3 for k, v in base.items()} for _ in range(2 if method != "slerp" else 1)]
    paths = [encode_delta(d, tmp_path / f"d{i}.safetensors", "dense_fp32").path for i, d in enumerate(deltas)]
    monkeypatch.setattr(streaming, "FULL_TENSOR_ELEMS", 300)  # big tensors take the chunk-iterator path
    merge_deltas(llama["base"], [MergeInput(p, w) for p, w in zip(paths, [1.0, 0.5])], MergeSpec(method, params),
                 tmp_path / "out", seed=3, chunk_elems=100, progress=False)
    out = sd(tmp_path / "out")
    m = get_method(method)
    for k, v in base.items():
        models = [v + d[k] for d in deltas]
        if method == "slerp":
            want = slerp(v, models[0], 0.4) - v
        elif method == "model_stock":
            want = model_stock(v, models) - v
        else:
            want = merge_tensors(m, [d[k] for d in deltas], [1.0, 0.5], m.make_params(params), seed=3, name=k,
                                 keys=["0", "1"])
        assert torch.equal(out[k], v + want), k


def _write_tokenizer(d: Path, words: list[str]) -> None:
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    Tokenizer(WordLevel({w: i for i, w in enumerate(words)}, unk_token=words[0])).save(str(d / "tokenizer.json"))


def test_tokenizer_source(llama, tmp_path: Path) -> None:
    dirs = {n: tmp_path / n for n in ("base", "ft1", "ft2")}
    words = ["<unk>"] + [f"w{i}" for i in range(47)]  # as many tokens as the embedding has rows
    for n, d in dirs.items():
        shutil.copytree(llama[n], d)
        _write_tokenizer(d, words)
    (dirs["ft1"] / "tokenizer_config.json").write_text('{"model_max_length": 77}')
    head = f"merge_method: task_arithmetic\nbase_model: {dirs['base']}\nmodels:\n  - model: {dirs['ft1']}\n"
    run_recipe(tmp_path, head + "tokenizer_source: base\n", "tb")
    assert not (tmp_path / "tb" / "tokenizer_config.json").exists()
    run_recipe(tmp_path, head + f"tokenizer_source: {dirs['ft1']}\n", "tm")
    assert json.loads((tmp_path / "tm" / "tokenizer_config.json").read_text())["model_max_length"] == 77
    assert (tmp_path / "tm" / "tokenizer.json").read_bytes() == (dirs["ft1"] / "tokenizer.json").read_bytes()
    _write_tokenizer(dirs["ft2"], words[::-1])
    with pytest.raises(MergeError, match="tokenizer_source: union: .*different vocabulary"):
        run_recipe(tmp_path, head + f"  - model: {dirs['ft2']}\ntokenizer_source: union\n", "tu")
    for d in dirs.values():  # 3 tokens for 48 rows: mergekit would cut the embeddings to 3 rows
        _write_tokenizer(d, words[:3])
    with pytest.raises(MergeError, match="tokenizer_source: base: mergekit resizes the embeddings .*3 tokens.*48"):
        run_recipe(tmp_path, head + "tokenizer_source: base\n", "tr")


def _models(llama: dict[str, Path], params: str = "{weight: 1.0}") -> str:
    return f"base_model: {llama['base']}\nmodels:\n  - model: {llama['ft1']}\n    parameters: {params}\n"


@pytest.mark.parametrize("text,key", [
    ("merge_method: ties\n{models}modules: {{}}\n", "modules"),
    ("merge_method: ties\n{models}frobnicate: 1\n", "`frobnicate`"),
    ("merge_method: karcher\n{models}", "merge_method: unknown merge method 'karcher'"),
    ("merge_method: ties\n{models_lambda}", r"models\[0\].parameters.lambda"),
    ("merge_method: ties\n{models_gamma}", r"models\[0\].parameters.gamma"),
    ("merge_method: ties\n{models}parameters: {{rescale: true}}\n", "parameters.rescale: ties with rescale"),
    ("merge_method: breadcrumbs\n{models}parameters: {{rescale: [false, true]}}\n", "parameters.rescale"),
    ("merge_method: ties\n{models}parameters: {{density: [0.5, {{a: 1}}]}}\n", r"parameters.density\[0\]: a condition"),
    ("merge_method: ties\n{models}parameters: {{normalize: 3}}\n", "parameters.normalize"),
    ("merge_method: ties\n{models}tokenizer: {{source: base, tokens: {{x: 1}}}}\n", "tokenizer.tokens"),
    ("merge_method: ties\n{models}chat_template: chatml\n", "chat_template"),
    ("merge_method: slerp\n{bare}", "parameters.t"),
    ("merge_method: slerp\n{models}parameters: {{t: 0.5}}\n", r"models\[0\].parameters.weight: slerp has no"),
    ("merge_method: model_stock\n{bare}  - model: {ft2}\nparameters: {{filter_wise: true}}\n",
     "parameters.filter_wise"),
    ("merge_method: model_stock\n{bare}", "model_stock needs at least two models"),
    ("merge_method: ties\nbase_model: {base}\nslices:\n  - sources:\n      - model: {ft1}\n        layer_range: [0, 2]\n",
     r"slices\[0\].sources\[0\].layer_range"),
    ("merge_method: ties\nbase_model: {base}\nmodels:\n  - model: {ft1}+some/lora\n", r"models\[0\].model"),
    ("merge_method: ties\nbase_model: ./no/such/dir\nmodels:\n  - model: {ft1}\n", "base_model: './no/such/dir'"),
])
def test_unsupported_keys_are_named(llama, tmp_path: Path, text: str, key: str) -> None:
    models = _models(llama)
    r = tmp_path / "r.yaml"
    r.write_text(text.format(models=models, models_lambda=_models(llama, "{weight: 1.0, lambda: 0.5}"),
                             models_gamma=_models(llama, "{gamma: 0.1}"), base=llama["base"], ft1=llama["ft1"],
                             ft2=llama["ft2"], bare=_models(llama, "{}")))
    with pytest.raises(MergeError, match=key):
        plan_recipe(load_recipe(r))


def test_cli_errors_are_one_line_and_hub_ids_resolve(llama, tmp_path: Path) -> None:
    r = tmp_path / "r.yaml"
    r.write_text(f"merge_method: ties\n{_models(llama, '{weight: 1.0, lambda: 0.5}')}")
    bad = run_cli("merge", "run", "--recipe", str(r), "--out", str(tmp_path / "o"), check=False)
    assert bad.returncode == 1 and "models[0].parameters.lambda" in bad.stderr
    assert "Traceback" not in bad.stderr and len(bad.stderr.strip().splitlines()) <= 3 and not (tmp_path / "o").exists()
    # a hub id: offline and not cached, a clear error; cached, it resolves to the snapshot
    cache = tmp_path / "hub"
    snap = cache / "models--someorg--tiny" / "snapshots" / ("0" * 40)
    shutil.copytree(llama["ft1"], snap)
    (cache / "models--someorg--tiny" / "refs").mkdir()
    (cache / "models--someorg--tiny" / "refs" / "main").write_text("0" * 40)
    env = {"HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}
    r.write_text(f"merge_method: ties\nbase_model: {llama['base']}\nmodels:\n  - model: someorg/missing\n")
    bad = run_cli("merge", "run", "--recipe", str(r), "--out", str(tmp_path / "o"), check=False, env=env)
    assert bad.returncode == 1 and "models[0].model: 'someorg/missing'" in bad.stderr and "hub" in bad.stderr
    r.write_text(f"merge_method: ties\nbase_model: {llama['base']}\nmodels:\n  - model: someorg/tiny\n"
                 "    parameters: {density: 0.5}\n")
    ok = json.loads(run_cli("merge", "run", "--recipe", str(r), "--out", str(tmp_path / "o"), "--json", env=env).stdout)
    assert ok["inputs"] == [str(snap)]
    base, a, out = sd(llama["base"]), sd(llama["ft1"]), sd(tmp_path / "o")
    assert all(torch.equal(out[k], v + merge("ties", [a[k] - v], density=0.5)) for k, v in base.items())
    # a hub id at a revision as the base
    r.write_text(f"merge_method: task_arithmetic\nbase_model: someorg/tiny@{'0' * 40}\nmodels:\n"
                 f"  - model: {llama['ft2']}\n    parameters: {{weight: 0.5}}\n")
    run_cli("merge", "run", "--recipe", str(r), "--out", str(tmp_path / "hb"), "--json", env=env)
    b, out = sd(llama["ft2"]), sd(tmp_path / "hb")
    assert all(torch.equal(out[k], v + merge("task_arithmetic", [b[k] - v], [0.5])) for k, v in a.items())
