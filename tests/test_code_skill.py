"""The `code` skill: its tasks, hidden tests graded in the real sandbox (and not fooled by a program that
prints or compares its way to a pass), the multi-turn episode and its rewards, memoised runs, and the
nano warm-up's sandboxed pool."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from skillswarm.skills.builtin.code import TEMPLATES, CodeTasks, make_skill
from skillswarm.skills.episode import Message
from skillswarm.skills.registry import get_skill
from skillswarm.skills.sandbox import PythonSandbox
from skillswarm.skills.taskbank import Task
from skillswarm.skills.toolcall import format_answer, format_call
from tests.conftest import run_cli


@pytest.fixture(scope="module")
def skill():  # noqa: ANN201
    return get_skill("code")


def _task(kind: str, spec: str, **params: object) -> Task:
    """The task of the template `kind: spec` (e.g. "list", "keep above {k}") with these parameters."""
    index = next(i for i, t in enumerate(TEMPLATES) if (t.kind, t.spec) == (kind, spec))
    return CodeTasks.make(index, **params)


def _play(skill, task: Task, turns: list[str]):  # noqa: ANN001, ANN202
    it = iter(turns)
    return skill.run_episode(task, 0, lambda messages: next(it))


def test_tasks_are_specs_with_hidden_tests_from_the_task_id(skill) -> None:  # noqa: ANN001
    tasks = skill.tasks.train_tasks(300, seed=1)
    assert {t.data["kind"] for t in tasks} == {"int", "list", "str"}
    for t in tasks[:50]:
        assert t.prompt.split(":")[0] == t.data["kind"] and t.answer.startswith("f=lambda a:")
        assert len(CodeTasks.tests(t)) == 5 and t.id == f"code:{t.prompt}"
    again = CodeTasks().train_tasks(300, seed=1)
    assert [(t.id, CodeTasks.tests(t)) for t in tasks] == [(t.id, CodeTasks.tests(t)) for t in again]
    # every turn the perfect player writes fits the engine's default 64-token turn (one token per character,
    # tags as one token each, plus the end of turn)
    longest = max(len(t.answer) + len("\nprint(f([3,12]))") for t in tasks)
    assert longest + 1 + len("python") + 1 + 1 + 1 <= 64


def test_code_trains_on_the_distribution_it_is_evaluated_on(skill) -> None:  # noqa: ANN001
    """The held-out split is a list of distinct tasks, as good as uniform over the task space, so training must
    draw every task as likely (v1 drew templates uniformly: 70% of its training tasks came from templates that
    made 1.4% of the split, and its prompts were 12.4 characters long against the split's 16.0)."""
    from collections import Counter

    train, held_out = skill.tasks.train_tasks(4000, seed=0), skill.tasks.eval_tasks(1000)
    share = lambda tasks: Counter(t.data["template"] for t in tasks)  # noqa: E731
    a, b = share(train), share(held_out)
    assert max(abs(a[i] / 4000 - b[i] / 1000) for i in range(len(TEMPLATES))) < 0.03, (a, b)
    length = lambda tasks: sum(len(t.prompt) for t in tasks) / len(tasks)  # noqa: E731
    assert abs(length(train) - length(held_out)) < 0.3


def test_every_template_s_reference_solution_passes_in_the_sandbox(skill) -> None:  # noqa: ANN001
    rng = random.Random(3)
    seen = [CodeTasks.make(i, k=rng.choice(t.k) if t.k else 0, j=rng.choice(t.j) if t.j else 0,
                           c="q" if t.letters else "", d="z" if t.letters > 1 else "") for i, t in enumerate(TEMPLATES)]
    for t in seen:
        assert skill.tasks.results(t, t.answer) == [True] * 5, t


def test_grading_counts_passed_tests_with_types(skill) -> None:  # noqa: ANN001
    above = _task("list", "keep above {k}", k=50)
    passed = skill.tasks.results(above, "f=lambda a:[x for x in a if x>=50]")
    expected = [[x for x in xs if x >= 50] == [x for x in xs if x > 50] for xs, _ in CodeTasks.tests(above)]
    assert passed == expected  # right exactly where 50 is absent
    div = _task("int", "div {k}", k=3)
    assert skill.tasks.results(div, "f=lambda a:a/3") == [False] * 5  # floats: 3.0 is not 3
    assert skill.tasks.results(div, "def f(a):\n    return a // 3") == [True] * 5  # any way of defining f
    assert skill.tasks.results(div, "g=lambda a:a//3") == [False] * 5 and skill.tasks.results(div, None) == [False] * 5
    assert not skill.tasks.check(div, "f=lambda a:a//2") and skill.tasks.check(div, div.answer)


@pytest.mark.parametrize("cheat", [
    "print('\\n[\"1\", \"1\", \"1\", \"1\", \"1\"]')\nraise SystemExit(0)",  # print a report and leave before the harness
    "class A:\n    def __eq__(self, o): return True\nf=lambda a:A()",  # an object equal to everything
    "import json\njson.dumps = lambda o: '0'\nf=lambda a:0",  # rewrite the harness's serializer
    "f=lambda a:open('/etc/passwd').read()",  # read the host
    "while True: pass",  # hang the grader
])
def test_grading_cannot_be_fooled(skill, cheat: str) -> None:  # noqa: ANN001
    task = _task("int", "add {k}", k=5)
    assert not any(skill.tasks.results(task, cheat))


def test_reference_episode_runs_code_then_answers(skill) -> None:  # noqa: ANN001
    task = _task("str", "replace {c} {d}", c="a", d="b")
    ep = skill.demonstration(task)
    assert [m.role for m in ep.messages] == ["system", "user", "assistant", "tool", "assistant"]
    assert ep.messages[2].content == format_call("python", "f=lambda a:a.replace('a','b')\nprint(f('abc'))")
    assert ep.messages[3].content == "<result>bbc</result>"
    assert ep.outcome == "ok" and ep.correct and ep.reward == pytest.approx(1.1) and ep.turn_rewards == [pytest.approx(0.1), 0.0]
    assert ep.rewards["tests_passed"] == 1.0 and ep.rewards["tool_calls_made"] == 1.0


def test_rewards_for_partial_answers_failed_calls_and_no_answer(skill) -> None:  # noqa: ANN001
    task = _task("list", "keep above {k}", k=50)
    direct = _play(skill, task, [format_answer(task.answer)])
    assert direct.correct and direct.reward == pytest.approx(1.0)
    partial = _play(skill, task, [format_call("python", "print(1/0)"), format_answer("f=lambda a:[x for x in a if x>=50]")])
    assert partial.messages[3].content == "<error>ZeroDivisionError: division by zero</error>"
    assert partial.turn_rewards == [0.0, 0.0] and 0 <= partial.reward <= 1.0
    assert partial.reward == pytest.approx(sum(skill.tasks.results(task, "f=lambda a:[x for x in a if x>=50]")) / 5)
    stalled = _play(skill, task, [format_call("python", "print(1)")] * 3)
    assert stalled.outcome == "timeout" and stalled.reward == 0.0  # ran out of turns: graded 0, kept
    attack = _play(skill, task, [format_call("python", "import os\nos.fork()")] * 3)
    assert attack.outcome == "tool_error" and attack.reward == 0.0


def test_memoised_tool_and_grader_return_what_a_run_returned() -> None:
    program = "import random\nprint(random.random())"
    fresh = PythonSandbox()
    assert fresh(program) != fresh(program)  # two real runs
    memo = PythonSandbox(memo=8)
    assert memo(program) == memo(program)  # the second is the first run's output
    tasks = CodeTasks()
    task = tasks.draw(random.Random(5))
    flaky = "import random\nf=lambda a:a if random.random() < 0.5 else None"
    assert tasks.results(task, flaky) == tasks.results(task, flaky)


def test_skills_show_code(skill) -> None:  # noqa: ANN001
    info = json.loads(run_cli("skills", "show", "code", "--samples", "3", "--json").stdout)
    assert info["tools"][0]["name"] == "python" and info["max_turns"] == 3 and info["multi_turn"]
    assert {f["name"]: f["per_turn"] for f in info["rubric"]} == {"tests_passed": False, "good_call": True, "tool_calls_made": False}
    assert [m["role"] for m in info["reference_episode"]] == ["system", "user", "assistant", "tool", "assistant"]


@pytest.mark.slow
def test_nano_warm_up_plays_the_code_pool_through_the_sandbox(tmp_path: Path) -> None:
    from skillswarm.skills.nano.build import build_base, build_info
    from skillswarm.skills.nano.recipe import NanoRecipe
    from skillswarm.skills.nano.warmup import _SkillData
    from skillswarm.skills.nano.tokenizer import build_tokenizer

    recipe = NanoRecipe(steps=3, batch_size=4, hidden_size=32, layers=1, heads=2, intermediate_size=64, max_positions=256,
                        skills=("code",), weights=(1.0,), pool_size=16, val_tasks=8)
    data = _SkillData(make_skill(), build_tokenizer(), recipe, random.Random(0), rows=4)
    assert 0 < len(data.pool) <= 12 and not {t.id for t in data.pool} & data.val_ids
    assert set(data.played) == data.val_ids | {t.id for t in data.pool}  # all played up front, each once
    assert data.sample(6)["input_ids"].shape[0] == 6 and data.cursor == 6  # the pool, in its shuffled order
    played = data.played[data.pool[0].id]
    assert [m.role for m in played] == ["system", "user", "assistant", "tool", "assistant"]
    assert isinstance(played[3], Message) and played[3].content.startswith("<result>")
    info = build_info(build_base(tmp_path / "m", recipe=recipe, cache=False))
    assert set(info["validation_accuracy"]) == {"code"}
