"""The nano base model: tokenizer round-trip and chat template, warm-up data rendering, a
deterministic and cached build, Auto* loading, and `skillswarm base build`."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from skillswarm.protocol.errors import ModelError
from skillswarm.protocol.hashing import weights_hash
from skillswarm.skills.chat import episode_tokens, render
from skillswarm.skills.episode import Message
from skillswarm.skills.nano import build as nano_build
from skillswarm.skills.nano.build import PINNED_MANIFEST, build_base, build_info, cached_path, is_built, pin_build, pinned_build
from skillswarm.skills.nano.recipe import DEFAULT_RECIPE, NanoRecipe
from skillswarm.skills.nano.tokenizer import CHARS, build_tokenizer
from skillswarm.skills.nano.warmup import by_stratum, keeps_training, replay_rows, step_rows
from skillswarm.skills.registry import get_skill
from skillswarm.skills.toolcall import PROTOCOL_TOKENS
from tests.conftest import run_cli

# A model small enough to build in a second: the same code path as the default recipe.
TINY = NanoRecipe(steps=3, batch_size=4, hidden_size=32, layers=1, heads=2, intermediate_size=64, max_positions=256)


@pytest.fixture(scope="module")
def tok():  # noqa: ANN201
    return build_tokenizer()


def test_tokenizer_round_trips_text_one_token_per_character(tok) -> None:  # noqa: ANN001
    text = 'Hi there!\n<tool name="calc">12*7</tool> ~`{}|\\ "quoted"> <answer>84</answer>'
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text
    assert all(len(tok.encode(c, add_special_tokens=False)) == 1 for c in CHARS)
    for tag in PROTOCOL_TOKENS:  # the protocol's tags are single tokens a tiny model writes in one step
        assert tok.convert_ids_to_tokens(tok.encode(tag, add_special_tokens=False)) == [tag]
    assert tok.convert_ids_to_tokens(tok.encode("é", add_special_tokens=False)) == ["<|unk|>"]
    assert build_tokenizer().get_vocab() == tok.get_vocab()


def test_chat_template_renders_every_role(tok, tmp_path: Path) -> None:  # noqa: ANN001
    messages = [Message("system", "S"), Message("user", "U"), Message("assistant", "A"), Message("tool", "T")]
    expected = "<|system|>S<|end|><|user|>U<|end|><|assistant|>A<|end|><|tool|>T<|end|>"
    assert render(tok, messages) == expected
    assert render(tok, messages, add_generation_prompt=True) == expected + "<|assistant|>"
    with pytest.raises(Exception, match="unknown role"):
        tok.apply_chat_template([{"role": "robot", "content": "x"}], tokenize=False)
    tok.save_pretrained(tmp_path)
    from transformers import AutoTokenizer

    again = AutoTokenizer.from_pretrained(tmp_path)
    assert render(again, messages, add_generation_prompt=True) == expected + "<|assistant|>"
    assert again.eos_token == "<|end|>" and again.pad_token == "<|pad|>"


def test_warm_up_data_is_the_environment_rendering_with_model_tokens_masked(tok) -> None:  # noqa: ANN001
    skill = get_skill("calc")
    task = next(t for t in skill.tasks.train_tasks(20, seed=0) if t.data["tail"])
    ep = skill.demonstration(task)
    ids, mask = episode_tokens(tok, ep.messages)
    assert tok.decode(ids) == render(tok, ep.messages)
    model_part = tok.decode([i for i, m in zip(ids, mask) if m])
    assert model_part == "".join(m.content + "<|end|>" for m in ep.messages if m.role == "assistant")
    assert "<result>" in tok.decode([i for i, m in zip(ids, mask) if not m])  # tool turns are there, masked


def test_build_is_deterministic_from_the_seed_and_cached_by_recipe_hash(isolated_home: Path, tmp_path: Path) -> None:
    path = build_base(recipe=TINY)
    assert path == cached_path(TINY) and path.is_relative_to(isolated_home) and TINY.hash()[:16] in path.name
    stamp = (path / "model.safetensors").stat().st_mtime_ns
    assert build_base(recipe=TINY) == path and (path / "model.safetensors").stat().st_mtime_ns == stamp
    copy = build_base(tmp_path / "copy", recipe=TINY)
    assert weights_hash(copy) == weights_hash(path) and (path / "model.safetensors").stat().st_mtime_ns == stamp
    # built again from scratch (not from the cache): the same weights; another seed, others
    again = build_base(tmp_path / "again", recipe=TINY, cache=False)
    other = build_base(tmp_path / "other", recipe=TINY, seed=1, cache=False)
    assert weights_hash(again) == weights_hash(path) != weights_hash(other)
    info = build_info(again)
    assert info["recipe_hash"] == TINY.hash() and info["weights_hash"] == weights_hash(again)
    assert TINY.hash() != TINY.with_(seed=1).hash() != DEFAULT_RECIPE.hash()
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "notes.txt").write_text("mine")
    with pytest.raises(ModelError, match="not a nano model build"):
        build_base(tmp_path / "taken", recipe=TINY)


def test_a_shipped_build_fills_the_cache_only_when_every_file_matches_its_hash(
        isolated_home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    # A build made elsewhere (another CPU trains other weights from one recipe) is shipped, and the cache is filled
    # from it, not trained: same files, and the install says so. A damaged file is refused with a clear error.
    made = build_base(tmp_path / "made", recipe=TINY, cache=False)
    shipped = pin_build(made, tmp_path / "pinned")
    manifest = json.loads((shipped / PINNED_MANIFEST).read_text())
    assert manifest["recipe_hash"] == TINY.hash() and "model.safetensors" in manifest["files"]
    monkeypatch.setattr(nano_build, "PINNED_DIR", shipped)
    assert pinned_build(TINY) == shipped and pinned_build(TINY.with_(seed=1)) is None
    with caplog.at_level("INFO", logger=nano_build.__name__):
        path = build_base(recipe=TINY)
    assert path == cached_path(TINY) and "installed the shipped nano model" in caplog.text
    assert sorted(p.name for p in path.iterdir()) == sorted(manifest["files"])
    assert all((path / n).read_bytes() == (shipped / n).read_bytes() for n in manifest["files"])
    assert build_info(path)["weights_hash"] == weights_hash(path) == weights_hash(made)
    # damaged: one byte of the shipped weights flipped; nothing lands in the (emptied) cache
    shutil.rmtree(path)
    raw = bytearray((shipped / "model.safetensors").read_bytes())
    raw[-1] ^= 1
    (shipped / "model.safetensors").write_bytes(bytes(raw))
    with pytest.raises(ModelError, match="damaged .*model.safetensors"):
        build_base(recipe=TINY)
    assert not is_built(path) and not [p for p in path.parent.iterdir() if p.name.startswith(".")]
    # --force trains it here instead, whatever is shipped
    assert weights_hash(build_base(recipe=TINY, force=True)) == weights_hash(made)


def test_the_package_ships_the_default_recipes_build() -> None:
    # Changing the default recipe without shipping its build would send every machine back to its own
    # CPU's weights: re-pin with `skillswarm base build --force --pin`.
    shipped = pinned_build(DEFAULT_RECIPE)
    assert shipped is not None, "no shipped build of the default recipe: run `skillswarm base build --force --pin`"
    manifest = json.loads((shipped / PINNED_MANIFEST).read_text())
    from skillswarm.protocol.hashing import sha256_file

    assert all(sha256_file(shipped / n) == d for n, d in manifest["files"].items())
    info = build_info(shipped)
    assert info["recipe_hash"] == DEFAULT_RECIPE.hash() and info["weights_hash"] == weights_hash(shipped)


@pytest.mark.slow
def test_nano_model_loads_with_auto_classes(nano_model: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(nano_model)
    tok = AutoTokenizer.from_pretrained(nano_model)
    assert model.config.model_type == "llama" and model.config.eos_token_id == tok.eos_token_id
    assert 100_000 < sum(p.numel() for p in model.parameters()) < 10_000_000
    prompt = tok.apply_chat_template([{"role": "user", "content": "12+7"}], tokenize=False, add_generation_prompt=True)
    ids = torch.tensor([tok.encode(prompt, add_special_tokens=False)])
    out = model.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=tok.pad_token_id)
    assert out.shape[1] > ids.shape[1]
    assert json.loads((nano_model / "nano_recipe.json").read_text())["parameters"] == model.num_parameters()


@pytest.mark.slow
def test_base_build_cli(tmp_path: Path) -> None:
    out = tmp_path / "nano"
    first = json.loads(run_cli("base", "build", "--out", str(out), "--steps", "2", "--json", timeout=300).stdout)
    assert first["cached"] is False and Path(first["path"]) == out and first["weights_hash"] == weights_hash(out)
    assert first["kernels"] == build_info(out)["kernels"]  # what the weights were trained on is on record
    again = json.loads(run_cli("base", "build", "--steps", "2", "--json").stdout)
    assert again["cached"] is True and again["weights_hash"] == first["weights_hash"]
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "x").write_text("x")
    proc = run_cli("base", "build", "--out", str(taken), "--steps", "2", check=False)
    assert proc.returncode == 1 and "not a nano model build" in proc.stderr


def test_warm_up_pauses_a_skill_only_when_every_kind_of_task_is_solved_at_the_floor() -> None:
    r = DEFAULT_RECIPE.with_(target_accuracy=0.3, floor_accuracy=0.15)
    assert not keeps_training(True, 0.35, {"": 0.35}, r)  # one kind: the target alone decides
    # calc at 30% by solving its a*b tasks only: it trains on (RL could never learn the tails)
    assert keeps_training(True, 0.31, {"a*b": 0.95, "a*b+c": 0.0, "a*b-c": 0.05}, r)
    assert not keeps_training(True, 0.4, {"a*b": 0.9, "a*b+c": 0.15, "a*b-c": 0.2}, r)
    assert not keeps_training(False, 0.2, {"a*b": 0.5, "a*b+c": 0.05, "a*b-c": 0.1}, r)  # paused: within the band
    assert keeps_training(False, 0.2, {"a*b": 0.6, "a*b+c": 0.0, "a*b-c": 0.1}, r)  # forgot a kind entirely
    assert keeps_training(False, 0.1, {"": 0.1}, r)


def test_a_paused_skill_keeps_a_replay_share_of_its_rows() -> None:
    r = DEFAULT_RECIPE
    assert replay_rows(16, r.with_(replay_share=0.25)) == 4
    assert replay_rows(2, r.with_(replay_share=0.25)) == 1  # never rounded away to nothing
    assert replay_rows(16, r.with_(replay_share=0.0)) == 0  # 0: paused outright, as before recipe 10
    assert replay_rows(16, r.with_(replay_share=1.0)) == 16
    with pytest.raises(ModelError, match="replay_share"):
        r.with_(replay_share=1.5)
    # weights 2, 2, 1, 1: the rows the paused skills free go to those still training, by weight
    r, rows = r.with_(replay_share=0.25), [16, 16, 8, 8]
    assert step_rows(rows, [True] * 4, r) == rows
    assert step_rows(rows, [True, True, False, False], r) == [22, 22, 2, 2]
    assert step_rows(rows, [True, False, False, False], r) == [40, 4, 2, 2]
    assert step_rows(rows, [False] * 4, r) == [4, 4, 2, 2]  # the warm-up is over then; nothing to hand on


def test_by_stratum_and_calc_kinds() -> None:
    import torch

    calc = get_skill("calc")
    tasks = calc.tasks.train_tasks(200, seed=0)
    kinds = [calc.tasks.stratum(t) for t in tasks]
    assert set(kinds) == {"a*b", "a*b+c", "a*b-c"}
    assert all((k == "a*b") == (not t.data["tail"]) and (k[-2:-1] in "+-" or k == "a*b") for k, t in zip(kinds, tasks))
    assert get_skill("arith").tasks.stratum(tasks[0]) == ""  # the default: one kind
    rows = torch.tensor([True, False, True, True])
    assert by_stratum(rows, ["x", "x", "y", "y"]) == {"x": 0.5, "y": 1.0}
