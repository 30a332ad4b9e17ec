"""The Skill API without a model: tool-call parsing, the environment's failure semantics, rubrics,
task banks (determinism, train/eval disjointness) and the registry."""

from __future__ import annotations

import random
import time

import pytest

from skillswarm.protocol.errors import SkillError
from skillswarm.skills.environment import Environment
from skillswarm.skills.rubric import RewardFunc, Rubric
from skillswarm.skills.registry import BUILTINS, get_skill, list_skills
from skillswarm.skills.skill import Skill
from skillswarm.skills.taskbank import Task, TaskBank
from skillswarm.skills.toolcall import format_answer, format_call, parse_turn
from skillswarm.skills.tools import Calculator, ToolInputError

# ---------------------------------------------------------------- tool-call protocol


def test_parse_answer_and_calls() -> None:
    assert parse_turn("thinking... <answer> 42 </answer>").answer == "42"
    turn = parse_turn('<tool name="calc">12*7</tool> and <tool name="calc">1+2</tool>', {"calc"})
    assert turn.error is None and [(c.name, c.input) for c in turn.calls] == [("calc", "12*7"), ("calc", "1+2")]
    assert parse_turn("no tags at all") == parse_turn("no tags at all").__class__()


@pytest.mark.parametrize("text, fragment", [
    ("<answer>1", "not closed"),
    ("<answer>1</answer><answer>2</answer>", "exactly one"),
    ('<tool name="calc">1+2</tool><answer>3</answer>', "not both"),
    ('<tool name="calc">1+2', "not closed"),
    ("<tool>1+2</tool>", "write a tool call as"),
    ('<tool name="Calc!">1</tool>', "bad tool name"),
    ('<tool name="python">1</tool>', "unknown tool"),
    ("<result>5</result>", "written by the environment"),
    ("</answer>", "unexpected"),
    ('<answer><tool name="calc">1</tool></answer>', "cannot nest"),
    ('<tool name="calc">1</tool>' * 5, "at most 4"),
])
def test_parse_rejects_malformed_turns(text: str, fragment: str) -> None:
    turn = parse_turn(text, {"calc"})
    assert turn.error is not None and fragment in turn.error and turn.answer is None and not turn.calls
    assert turn.call_error == text.startswith("<tool")


def test_calculator_takes_one_operation() -> None:
    calc = Calculator()
    assert calc("12*7") == "84" and calc(" 100 - 250 ") == "-150"
    for bad in ("1+2+3", "12/4", "import os", ""):
        with pytest.raises(ToolInputError):
            calc(bad)

# ---------------------------------------------------------------- environments and failure semantics


class Fixed(TaskBank):
    def draw(self, rng: random.Random) -> Task:
        n = rng.randint(0, 10**6)
        return Task(id=f"fixed:{n}", prompt=str(n), answer=str(n))


class Crashing:
    name, description = "crash", "a tool with a bug"

    def __call__(self, input: str) -> str:
        raise RuntimeError("bug in the tool")


def _skill(env: Environment, rubric: Rubric | None = None) -> Skill:
    def right(answer: str | None, task: Task) -> float:
        return float(answer == task.answer)

    def good_call(turn) -> float:  # noqa: ANN001
        return float(bool(turn.calls) and all(c.ok for c in turn.calls))

    return Skill("fixture", "1", "test skill", Fixed(), env,
                 rubric or Rubric([RewardFunc(right), RewardFunc(good_call, 0.1, per_turn=True)]))


def _play(skill: Skill, turns: list[str]):  # noqa: ANN202
    script = iter(turns)
    return skill.run_episode(Task("t", "7", "7"), 0, lambda messages: next(script))


def test_answer_after_tool_calls_is_ok_with_per_turn_rewards() -> None:
    skill = _skill(Environment(tools=[Calculator()], max_turns=4))
    ep = _play(skill, [format_call("calc", "3+4"), format_answer("7")])
    assert ep.outcome == "ok" and ep.stop_reason == "answer" and ep.correct
    assert [m.role for m in ep.messages] == ["user", "assistant", "tool", "assistant"]
    assert ep.messages[2].content == "<result>7</result>"
    assert ep.turn_rewards == [pytest.approx(0.1), 0.0] and ep.reward == pytest.approx(1.1)
    assert ep.tool_calls[0].output == "7" and ep.rewards == {"right": 1.0, "good_call": 1.0}


def test_malformed_call_and_bad_tool_input_are_observations() -> None:
    skill = _skill(Environment(tools=[Calculator()], max_turns=4))
    ep = _play(skill, ['<tool name="calc">1+2', format_call("calc", "1+2+3"), format_answer("7")])
    assert ep.outcome == "ok" and ep.correct
    assert ep.messages[2].content.startswith("<error>") and "not closed" in ep.messages[2].content
    assert ep.messages[4].content == "<error>calc takes one operation like 12*7</error>"
    assert ep.turn_rewards == [0.0, 0.0, 0.0]


def test_turn_limit_overflow_is_graded_zero_and_kept() -> None:
    skill = _skill(Environment(tools=[Calculator()], max_turns=2))
    ep = _play(skill, [format_call("calc", "3+4"), format_call("calc", "3+4")])
    assert ep.outcome == "timeout" and ep.stop_reason == "max_turns"
    assert ep.reward == 0.0 and ep.turn_rewards == [0.0, 0.0] and ep.rewards["good_call"] == 2.0
    ep = _play(skill, [format_call("calc", "3+4"), format_call("calc", "oops")])
    assert ep.outcome == "tool_error" and ep.reward == 0.0 and ep.turns[-1].tool_error
    ep = _play(skill, [format_call("calc", "3+4"), '<tool name="calc">1+2'])
    assert ep.outcome == "tool_error" and ep.reward == 0.0
    ep = _play(skill, [format_call("calc", "3+4"), "I give up"])
    assert ep.outcome == "timeout" and not ep.turns[-1].tool_error


def test_wall_clock_timeout_is_graded_zero() -> None:
    skill = _skill(Environment(tools=[Calculator()], max_turns=5, max_seconds=0.05))

    def slow(messages):  # noqa: ANN001, ANN202
        time.sleep(0.06)
        return format_answer("7") if len(messages) > 2 else format_call("calc", "3+4")

    ep = skill.run_episode(Task("t", "7", "7"), 0, slow)
    assert ep.outcome == "timeout" and ep.stop_reason == "wall_clock" and ep.reward == 0.0 and not ep.correct


def test_in_a_batch_only_the_episode_s_own_environment_time_counts() -> None:
    class SlowCalc(Calculator):
        def __call__(self, input: str) -> str:  # noqa: A002
            time.sleep(0.06)
            return super().__call__(input)

    for tools, timed_out in (([Calculator()], False), ([SlowCalc()], True)):
        skill = _skill(Environment(tools=tools, max_turns=5, max_seconds=0.05))
        state = skill.reset(Task("t", "7", "7"), 0)
        state.batched = True
        time.sleep(0.06)  # waiting for the batch's generation: not the episode's own time
        skill.env.step(state, format_call("calc", "3+4"))
        assert state.done == timed_out and (state.stop_reason == "wall_clock") == timed_out
        assert (state.env_seconds >= 0.06) == timed_out and state.seconds >= 0.06


def test_single_turn_without_answer_is_ok_and_zero() -> None:
    ep = _play(_skill(Environment(max_turns=1)), ["seven"])
    assert ep.outcome == "ok" and ep.stop_reason == "no_answer" and ep.reward == 0.0 and len(ep.messages) == 2


def test_broken_tool_environment_and_rubric_are_env_errors() -> None:
    ep = _play(_skill(Environment(tools=[Crashing()], max_turns=3)), [format_call("crash", "x")])
    assert ep.outcome == "env_error" and "bug in the tool" in ep.error and ep.reward == 0.0

    class Broken(Environment):
        def env_response(self, state, turn):  # noqa: ANN001, ANN202
            raise KeyError("env bug")

    ep = _play(_skill(Broken(max_turns=3)), [format_answer("7")])
    assert ep.outcome == "env_error" and "env bug" in ep.error

    def bad(answer: str | None) -> float:
        raise ZeroDivisionError("rubric bug")

    ep = _play(_skill(Environment(), Rubric([RewardFunc(bad)])), [format_answer("7")])
    assert ep.outcome == "env_error" and "rubric bug" in ep.error and ep.reward == 0.0


def test_rubric_checks_argument_names_and_keeps_metrics() -> None:
    with pytest.raises(SkillError, match="asks for"):
        Rubric([RewardFunc(lambda nonsense: 1.0)])
    with pytest.raises(SkillError, match="distinct"):
        Rubric([RewardFunc(lambda answer: 1.0, name="a"), RewardFunc(lambda task: 1.0, name="a")])
    rubric = Rubric([RewardFunc(lambda answer: 1.0, 0.5, name="half"), RewardFunc(lambda messages: len(messages), 0.0, name="n")])
    ep = _play(_skill(Environment(), rubric), [format_answer("x")])
    assert ep.reward == 0.5 and ep.rewards == {"half": 1.0, "n": 2.0}

# ---------------------------------------------------------------- task banks and registry


@pytest.mark.parametrize("name", sorted(BUILTINS))
def test_task_banks_are_deterministic_and_disjoint(name: str) -> None:
    bank = get_skill(name).tasks
    assert bank.train_tasks(50, seed=3) == bank.train_tasks(50, seed=3)
    assert bank.train_tasks(50, seed=3) != bank.train_tasks(50, seed=4)
    held_out = bank.eval_tasks(100)
    assert bank.eval_tasks(40) == held_out[:40] and len({t.id for t in held_out}) == 100
    # a seeded list too is a prefix of any longer one: the usefulness test's second look takes the next tasks
    assert bank.eval_tasks(60, seed=7)[:30] == bank.eval_tasks(30, seed=7) != held_out[:30]
    assert all(bank.is_eval(t) for t in held_out)
    train_ids = {t.id for seed in range(5) for t in bank.train_tasks(400, seed)}
    assert not train_ids & {t.id for t in held_out}


def test_arith_trains_on_the_distribution_it_is_evaluated_on() -> None:
    """The held-out split is a list of distinct tasks, so it is as good as uniform over the task space; training
    must sample that distribution (arith v1 drew digit counts first: 75% of its training tasks had a one-digit
    operand against 29% of the split, and RL gained half as much on the tasks that count)."""
    import re

    bank = get_skill("arith").tasks

    def one_digit_share(tasks: list) -> float:
        return sum(any(len(x) == 1 for x in re.split(r"[+-]", t.prompt)) for t in tasks) / len(tasks)

    train, held_out = one_digit_share(bank.train_tasks(4000, seed=0)), one_digit_share(bank.eval_tasks(1000))
    assert abs(train - 0.19) < 0.03 and abs(held_out - train) < 0.04, (train, held_out)  # 1 - 0.9**2 = 0.19


@pytest.mark.parametrize("name", sorted(BUILTINS))
def test_builtin_reference_players_solve_their_tasks(name: str) -> None:
    skill = get_skill(name)
    for task in skill.tasks.eval_tasks(20):
        ep = skill.demonstration(task)
        assert ep.outcome == "ok" and ep.correct and ep.reward >= 1.0, ep


def test_calc_needs_the_tool_over_turns() -> None:
    skill = get_skill("calc")
    task = next(t for t in skill.tasks.eval_tasks(30) if t.data["tail"])
    ep = skill.demonstration(task)
    assert [m.role for m in ep.messages] == ["system", "user", "assistant", "tool", "assistant", "tool", "assistant"]
    assert ep.reward == pytest.approx(1.2) and ep.turn_rewards == [pytest.approx(0.1), pytest.approx(0.1), 0.0]


def test_registry_lists_builtins_and_rejects_unknown_names() -> None:
    names = [s.name for s in list_skills()]
    assert {"arith", "calc", "reverse", "sort"} <= set(names) and names == sorted(names)
    with pytest.raises(SkillError, match="unknown skill 'nope'.*arith"):
        get_skill("nope")
