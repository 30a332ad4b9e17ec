"""The nano model's supervised warm-up: demonstrations of every skill of the recipe (built-ins and any
plugin), played by each skill's reference player through the real environment (tool turns included),
rendered by the chat template, trained on the model's tokens only.

Deliberately partial: the model should be partly competent on every skill, so that RL has room to
improve it. Tiny models learn these skills in sudden jumps, at different times, so a fixed step count
would leave one skill at 0% and another at 95%. Instead a controller watches each skill's accuracy on a
validation set drawn from the *train* split (held out from the warm-up data; the eval split is never
seen) and pauses a skill once it reaches `target_accuracy` with every kind of its tasks
(`TaskBank.stratum`) at `floor_accuracy` or above, resuming it if it falls below `floor_accuracy` or
stops solving some kind at all; the warm-up ends when every skill is paused, or after `steps`. (Without
the per-kind check, calc paused at 30% by solving 90% of its a*b tasks and none with a third number: RL
cannot learn a kind the model never solves, so calc stalled there.) Accuracy is measured teacher-forced:
a demonstration counts as solved when the model's argmax is right at every one of its tokens, which is
exactly when greedy decoding would replay it (the environments are deterministic).

A paused skill still trains on `replay_share` of its rows, and the rest of its rows go to the skills
still training. Paused outright, a skill lost what it had within 25 steps (the others train the shared
first tokens their own way), so the warm-up's end caught each skill at a random point of a 0%-90% flip.
Handing its rows on gives the slowest skill (arith) most of the batch once the others are paused, so
they overshoot less while they wait for it.

Each task is played once (its messages are kept). Skills named in `recipe.pooled` (those whose
environment starts a sandbox per tool call, like `code`) draw their warm-up tasks from a fixed pool of
`recipe.pool_size` train tasks, played up front: every demonstration still runs through the real
environment and sandbox, and the build pays for a bounded number of sandbox runs.
"""

from __future__ import annotations

import logging
import math
import random
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

import torch

from skillswarm.protocol.errors import SkillError
from skillswarm.skills.chat import episode_tokens
from skillswarm.skills.episode import Message
from skillswarm.skills.nano.recipe import NanoRecipe
from skillswarm.skills.skill import Skill
from skillswarm.skills.taskbank import Task

log = logging.getLogger(__name__)

# step, max steps, {"loss": ..., "<skill>": validation accuracy, ...}
Progress = Callable[[int, int, dict[str, float]], None]


def make_model(recipe: NanoRecipe, tokenizer: Any) -> torch.nn.Module:
    """A freshly initialised small LlamaForCausalLM (weights from torch's global seed)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=recipe.hidden_size, num_hidden_layers=recipe.layers,
        num_attention_heads=recipe.heads, num_key_value_heads=recipe.heads, intermediate_size=recipe.intermediate_size,
        max_position_embeddings=recipe.max_positions, tie_word_embeddings=True, rope_theta=10000.0,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, bos_token_id=None,
    )
    return LlamaForCausalLM(config)


def demo_messages(skill: Skill, task: Task, seed: int = 0) -> list[Message]:
    """The reference player's episode of `task` through the skill's real environment (tools run), ungraded:
    the warm-up needs only its text."""
    if skill.reference is None:
        raise SkillError(f"skill {skill.name} has no reference player to warm up on")
    state = skill.reset(task, seed)
    while not state.done:
        skill.env.step(state, skill.reference(task, list(state.messages)))
    if state.outcome == "env_error":
        raise SkillError(f"the {skill.name} environment failed on its own reference player ({task.id}): {state.error}")
    return state.messages


def collate(skill: Skill, tokenizer: Any, tasks: list[Task], rng: random.Random,
            played: dict[str, list[Message]] | None = None) -> dict[str, torch.Tensor]:
    """Demonstrations of `tasks`, right-padded; labels are -100 off the model's tokens. `played` keeps
    each task's messages (the environments are deterministic, so a task is played once)."""
    played = {} if played is None else played
    for t in tasks:
        seed = rng.randrange(2**31)
        if t.id not in played:
            played[t.id] = demo_messages(skill, t, seed)
    seqs = [episode_tokens(tokenizer, played[t.id]) for t in tasks]
    unk = getattr(tokenizer, "unk_token_id", None)
    for t, (ids, _) in zip(tasks, seqs):
        if unk is not None and unk in ids:
            raise SkillError(f"the {skill.name} skill writes text the model's tokenizer cannot represent ({t.id}: "
                             f"{_unknown_chars(tokenizer, played[t.id])}); the nano tokenizer knows printable ASCII "
                             "and newline only, so keep prompts, tool output and answers to those")
    width = max(len(ids) for ids, _ in seqs)
    input_ids = torch.full((len(seqs), width), tokenizer.pad_token_id, dtype=torch.long)
    labels = torch.full((len(seqs), width), -100, dtype=torch.long)
    attention = torch.zeros((len(seqs), width), dtype=torch.long)
    for row, (ids, mask) in enumerate(seqs):
        t = torch.tensor(ids)
        input_ids[row, : len(ids)] = t
        attention[row, : len(ids)] = 1
        labels[row, : len(ids)] = torch.where(torch.tensor(mask, dtype=torch.bool), t, torch.tensor(-100))
    return {"input_ids": input_ids, "attention_mask": attention, "labels": labels}


def _unknown_chars(tokenizer: Any, messages: list[Message]) -> str:
    """The characters of `messages` that `tokenizer` maps to its unknown token, for error messages."""
    chars = sorted({c for m in messages for c in m.content})
    return " ".join(repr(c) for c in chars if tokenizer.convert_tokens_to_ids(c) == tokenizer.unk_token_id) or "?"


def solved_rows(model: torch.nn.Module, data: dict[str, torch.Tensor]) -> torch.Tensor:
    """Per demonstration, whether its every model token is the model's argmax (= greedy replays it)."""
    with torch.no_grad():
        pred = model(input_ids=data["input_ids"], attention_mask=data["attention_mask"]).logits[:, :-1].argmax(-1)
    labels = data["labels"][:, 1:]
    return ((pred == labels) | (labels == -100)).all(-1)


def by_stratum(rows: torch.Tensor, strata: list[str]) -> dict[str, float]:
    """The solved share of each kind of task, from per-demonstration results and each one's kind."""
    kinds = sorted(set(strata))
    return {k: rows[[i for i, s in enumerate(strata) if s == k]].float().mean().item() for k in kinds}


def lr_at(step: int, recipe: NanoRecipe) -> float:
    """Linear warm-up, then cosine decay to `min_lr_ratio` of the peak at `recipe.steps`."""
    if step < recipe.warmup_steps:
        return recipe.lr * (step + 1) / recipe.warmup_steps
    progress = (step - recipe.warmup_steps) / max(1, recipe.steps - recipe.warmup_steps)
    return recipe.lr * (recipe.min_lr_ratio + (1 - recipe.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def rows_per_skill(recipe: NanoRecipe) -> list[int]:
    """Rows per skill in each step's batch: `batch_size` split by `weights` (at least one each)."""
    total = sum(recipe.weights)
    return [max(1, round(recipe.batch_size * w / total)) for w in recipe.weights]


def replay_rows(rows: int, recipe: NanoRecipe) -> int:
    """Rows a paused skill still trains on each step: `replay_share` of its `rows`, at least one unless the
    share is 0."""
    return 0 if recipe.replay_share == 0 else max(1, round(rows * recipe.replay_share))


def step_rows(rows: list[int], active: list[bool], recipe: NanoRecipe) -> list[int]:
    """Each skill's rows in one step: a paused skill gets its replay rows, and the rows it frees go to the
    skills still training, by weight, so every step trains on about `batch_size` rows and the skills still
    short of their target get there sooner (the others overshoot less while they wait)."""
    out = [n if a else replay_rows(n, recipe) for n, a in zip(rows, active)]
    freed = sum(rows) - sum(out)
    live = sum(w for w, a in zip(recipe.weights, active) if a)
    if freed and live:
        out = [k + (round(freed * w / live) if a else 0) for k, w, a in zip(out, recipe.weights, active)]
    return out


def keeps_training(active: bool, accuracy: float, strata: dict[str, float], recipe: NanoRecipe) -> bool:
    """Whether a skill trains on: an active one until it reaches the target with every kind of task at the
    floor or above; a paused one again once it falls below the floor or solves none of some kind."""
    weakest = min(strata.values(), default=accuracy)
    if active:
        return not (accuracy >= recipe.target_accuracy and weakest >= recipe.floor_accuracy)
    return accuracy < recipe.floor_accuracy or weakest == 0.0


class _SkillData:
    """One skill's validation set (train split, fixed) and its training stream (never the validation tasks):
    drawn from the task bank, or, for skills in `recipe.pooled`, epoch by epoch from a fixed pool played up
    front (two threads: each play mostly waits on a sandbox process)."""

    def __init__(self, skill: Skill, tokenizer: Any, recipe: NanoRecipe, rng: random.Random, rows: int) -> None:
        self.skill, self.tokenizer, self.rng = skill, tokenizer, rng
        self.played: dict[str, list[Message]] = {}
        val_tasks = skill.tasks.train_tasks(recipe.val_tasks, seed=rng.randrange(2**31))
        self.val_ids = {t.id for t in val_tasks}
        self.val_strata = [skill.tasks.stratum(t) for t in val_tasks]
        self.pool: list[Task] = []
        self.cursor = 0
        if skill.name in recipe.pooled:
            # never more than the warm-up can use: `rows` tasks a step, `steps` steps
            pool = skill.tasks.train_tasks(min(recipe.pool_size, recipe.steps * rows), seed=rng.randrange(2**31))
            self.pool = list({t.id: t for t in pool if t.id not in self.val_ids}.values())
            rng.shuffle(self.pool)
            todo = list({t.id: t for t in [*val_tasks, *self.pool]}.values())
            with ThreadPoolExecutor(max_workers=2) as ex:
                self.played = dict(zip([t.id for t in todo], ex.map(lambda t: demo_messages(skill, t), todo)))
        self.val = collate(skill, tokenizer, val_tasks, rng, self.played)
        if self.val["input_ids"].shape[1] > recipe.max_positions:
            raise SkillError(f"a {skill.name} episode takes {self.val['input_ids'].shape[1]} tokens, over the nano "
                             f"model's {recipe.max_positions} positions: shorten its system prompt, tasks or turns")
        self.active = True
        self.strata: dict[str, float] = {}

    def check(self, model: torch.nn.Module, recipe: NanoRecipe) -> float:
        """Measure validation accuracy (overall and per kind) and pause or resume the skill by it."""
        rows = solved_rows(model, self.val)
        accuracy = rows.float().mean().item()
        self.strata = by_stratum(rows, self.val_strata)
        self.active = keeps_training(self.active, accuracy, self.strata, recipe)
        return accuracy

    def sample(self, n: int) -> dict[str, torch.Tensor]:
        tasks: list[Task] = []
        while len(tasks) < n:
            if self.pool:
                if self.cursor == len(self.pool):  # a new epoch, in a new order
                    self.cursor = 0
                    self.rng.shuffle(self.pool)
                task = self.pool[self.cursor]
                self.cursor += 1
            else:
                task = self.skill.tasks.sample(self.rng)
            if task.id not in self.val_ids:
                tasks.append(task)
        return collate(self.skill, self.tokenizer, tasks, self.rng, self.played)


def warm_up(model: torch.nn.Module, tokenizer: Any, skills: list[Skill], recipe: NanoRecipe,
            progress: Progress | None = None) -> dict[str, Any]:
    """Train `model` in place (see the module docstring); returns the steps taken, the last loss and
    the validation accuracy of each skill.

    A step covers every skill: one micro-batch per skill (their lengths differ a lot, so no padding across
    skills) of its `step_rows`, each row's loss at the same weight (gradients accumulated), one optimizer
    step."""
    rng = random.Random(recipe.seed)
    rows = rows_per_skill(recipe)
    total_rows = sum(rows)
    data = [_SkillData(s, tokenizer, recipe, random.Random(rng.randrange(2**31)), n) for s, n in zip(skills, rows)]
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": recipe.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=recipe.lr, betas=(0.9, 0.98))
    accuracy = {s.name: 0.0 for s in skills}
    loss_value, step = float("nan"), 0
    model.train()
    while step < recipe.steps and any(d.active for d in data):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, recipe)
        opt.zero_grad(set_to_none=True)
        loss_value = 0.0
        for d, k in zip(data, step_rows(rows, [d.active for d in data], recipe)):
            if k:
                loss = model(**d.sample(k)).loss * (k / total_rows)
                loss.backward()
                loss_value += loss.detach().item()
        torch.nn.utils.clip_grad_norm_(model.parameters(), recipe.grad_clip)
        opt.step()
        step += 1
        if step % recipe.check_every == 0 or step == recipe.steps:
            model.eval()
            for d in data:
                accuracy[d.skill.name] = d.check(model, recipe)
            model.train()
            log.debug("warm-up step %d: loss %.4f, accuracy %s", step, loss_value, accuracy)
        if progress is not None:
            progress(step, recipe.steps, {"loss": loss_value, **accuracy})
    model.eval()
    if progress is not None:
        progress(recipe.steps, recipe.steps, {"loss": loss_value, **accuracy})
    strata = {d.skill.name: {k: round(v, 4) for k, v in d.strata.items()} for d in data if len(d.strata) > 1}
    return {"steps": step, "final_loss": round(loss_value, 5), "validation_accuracy": accuracy,
            "validation_by_kind": strata}
