"""`code`: multi-turn; write a one-line Python function from a short spec, graded by hidden unit tests
that run in the sandbox.

A task is a spec such as `list: keep above 12` (the argument `a` is an int, a list of ints or a string);
the answer defines `f`, e.g. `<answer>f=lambda a:[x for x in a if x>12]</answer>`. The model may first
run code with the `python` tool and read what it prints; the perfect player defines f and prints f on an
example, then answers. Grading runs the answer in the sandbox on five hidden inputs and compares what f
returned (as JSON, so types count: 3.0 is not 3) with what the reference solution returns on the host;
the expected values never enter the sandbox, so a program cannot print its way to a pass. Reward: the
fraction of hidden tests passed, plus 0.1 per turn whose calls all ran (worth nothing on a timeout).
"""

from __future__ import annotations

import hashlib
import json
import random
import string
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from skillswarm.skills.builtin.calc import good_call, tool_calls_made
from skillswarm.skills.environment import Environment
from skillswarm.skills.episode import Message
from skillswarm.skills.rubric import RewardFunc, Rubric
from skillswarm.skills.sandbox import PythonSandbox, SandboxLimits, run_python
from skillswarm.skills.skill import Skill
from skillswarm.skills.taskbank import Task, TaskBank
from skillswarm.skills.toolcall import format_answer, format_call

SYSTEM = f"Run {format_call('python', 'code')}. Reply {format_answer('f=lambda a:...')}."
N_TESTS = 5
# Sandbox runs of a rollout batch that overlap (the rubric and the tool are thread-safe). A run is mostly
# process start-up (bubblewrap, the interpreter): CPU-bound, so a few at once fill the cores that
# generation leaves idle between turns, and more only queue.
SANDBOX_CONCURRENCY = 4
GRADE_RETRIES = 1  # extra runs of an answer whose grading was killed by the wall clock (an overloaded machine)
PROBES = {"int": "7", "list": "[3,12]", "str": "'abc'"}  # the example the perfect player prints f on (source text)
LETTERS = string.ascii_lowercase
K99, K999 = range(1, 100), range(1, 1000)


@dataclass(frozen=True)
class Template:
    """A family of tasks: `spec` and `body` (the solution's lambda body) with {k}, {j}, {c}, {d} filled in."""

    kind: str
    spec: str
    body: str
    k: range | None = None
    j: range | None = None
    letters: int = 0

    @property
    def size(self) -> int:
        """How many distinct tasks the template makes (its parameter combinations)."""
        n = (len(self.k) if self.k else 1) * (len(self.j) if self.j else 1)
        for i in range(self.letters):
            n *= len(LETTERS) - i
        return n


TEMPLATES: tuple[Template, ...] = (
    Template("int", "add {k}", "a+{k}", K999), Template("int", "sub {k}", "a-{k}", K999),
    Template("int", "mul {k}", "a*{k}", range(2, 20)), Template("int", "mod {k}", "a%{k}", range(2, 20)),
    Template("int", "div {k}", "a//{k}", range(2, 20)), Template("int", "mul {k} add {j}", "a*{k}+{j}", range(2, 10), K99),
    Template("int", "square add {k}", "a*a+{k}", K999), Template("int", "max {k}", "max(a,{k})", K999),
    Template("int", "min {k}", "min(a,{k})", K999),
    Template("list", "sum", "sum(a)"), Template("list", "max", "max(a)"), Template("list", "min", "min(a)"),
    Template("list", "len", "len(a)"), Template("list", "sort", "sorted(a)"), Template("list", "reverse", "a[::-1]"),
    Template("list", "add {k} each", "[x+{k} for x in a]", K999), Template("list", "mul {k} each", "[x*{k} for x in a]", range(2, 20)),
    Template("list", "keep above {k}", "[x for x in a if x>{k}]", K999),
    Template("list", "keep below {k}", "[x for x in a if x<{k}]", K999),
    Template("list", "count {k}", "a.count({k})", range(0, 10)), Template("list", "first {k}", "a[:{k}]", range(1, 10)),
    Template("list", "drop {k}", "a[{k}:]", range(1, 10)), Template("list", "evens", "[x for x in a if x%2<1]"),
    Template("list", "odds", "[x for x in a if x%2>0]"),
    Template("str", "upper", "a.upper()"), Template("str", "reverse", "a[::-1]"), Template("str", "len", "len(a)"),
    Template("str", "sort", "''.join(sorted(a))"), Template("str", "count {c}", "a.count('{c}')", letters=1),
    Template("str", "first {k}", "a[:{k}]", range(1, 10)), Template("str", "drop {k}", "a[{k}:]", range(1, 10)),
    Template("str", "repeat {k}", "a*{k}", range(2, 6)), Template("str", "starts {c}", "a.startswith('{c}')", letters=1),
    Template("str", "replace {c} {d}", "a.replace('{c}','{d}')", letters=2),
)


def _inputs(kind: str, rng: random.Random, letters: str, k: int) -> list[Any]:
    """Hidden test inputs: ints up to max(99, 2k) (so thresholds like `max 700` are straddled), lists of 1-6
    of them (a fifth of the values 0..9, so `count 3` finds some), strings of 1-8 letters (the task's among them)."""
    top = max(99, 2 * k)
    if kind == "int":
        return [rng.randint(0, top) for _ in range(N_TESTS)]
    if kind == "list":
        return [[rng.randint(0, top if rng.random() < 0.8 else 9) for _ in range(rng.randint(1, 6))] for _ in range(N_TESTS)]
    pool = letters + "".join(rng.sample(LETTERS, 4))
    return ["".join(rng.choice(pool) for _ in range(rng.randint(1, 8))) for _ in range(N_TESTS)]


# Draw weights: a template's share of the task space. The held-out split is a list of distinct tasks, so it is as
# good as uniform over the task space. Drawn uniformly over templates instead (v1), training spent 70% of its
# tasks on the 24 templates of at most 26 tasks each, which made 1.4% of the split (no string task but `replace`),
# and its prompts averaged 12.4 characters against the split's 16.0 (now 15.6 and 15.6).
WEIGHTS = tuple(t.size for t in TEMPLATES)


class CodeTasks(TaskBank):
    """A template (weighted by its number of tasks, so that every task is as likely), then its parameters; the
    hidden tests' inputs come from the task id, their expected outputs from the reference solution. Grading
    results are memoised per (task, answer)."""

    eval_every = 5  # its space is ~9,600 tasks: a fifth held out leaves ~1,900, enough for two looks of 300 and n=1000

    def __init__(self, limits: SandboxLimits = SandboxLimits(output_bytes=16000), memo: int = 8192) -> None:
        self.limits, self.memo = limits, memo
        self._results: OrderedDict[tuple[str, str], list[bool]] = OrderedDict()
        self._lock = threading.Lock()

    def draw(self, rng: random.Random) -> Task:
        index = rng.choices(range(len(TEMPLATES)), weights=WEIGHTS)[0]
        t = TEMPLATES[index]
        chosen = rng.sample(LETTERS, t.letters)
        return self.make(index, k=rng.choice(t.k) if t.k else 0, j=rng.choice(t.j) if t.j else 0,
                         c=chosen[0] if chosen else "", d=chosen[1] if len(chosen) > 1 else "")

    @staticmethod
    def make(index: int, k: int = 0, j: int = 0, c: str = "", d: str = "") -> Task:
        """The task of template `TEMPLATES[index]` with these parameters (its hidden tests: `tests`)."""
        t = TEMPLATES[index]
        spec, body = t.spec.format(k=k, j=j, c=c, d=d), t.body.format(k=k, j=j, c=c, d=d)
        return Task(id=f"code:{t.kind}: {spec}", prompt=f"{t.kind}: {spec}", answer=f"f=lambda a:{body}",
                    data={"kind": t.kind, "template": index, "k": k, "letters": c + d, "probe": PROBES[t.kind]})

    @staticmethod
    def tests(task: Task) -> list[list[Any]]:
        """The hidden tests, [input, expected output] x5: inputs seeded by the task id, outputs from the
        reference solution (computed on first use and kept in the task)."""
        if "tests" not in task.data:
            reference = eval(task.answer.replace("f=lambda", "lambda", 1))  # our own template, never model text
            rng = random.Random(int.from_bytes(hashlib.sha256(task.id.encode()).digest()[:8], "big"))
            inputs = _inputs(task.data["kind"], rng, task.data["letters"], task.data["k"])
            task.data["tests"] = [[x, json.loads(json.dumps(reference(x)))] for x in inputs]
        return task.data["tests"]

    def results(self, task: Task, answer: str | None) -> list[bool]:
        """Which hidden tests `answer` passes, run in the sandbox (memoised: a group often repeats an answer)."""
        tests = self.tests(task)
        if answer is None:
            return [False] * len(tests)
        key = (task.id, answer)
        with self._lock:
            if key in self._results:
                self._results.move_to_end(key)
                return self._results[key]
        inputs = [x for x, _ in tests]
        harness = (f"{answer}\n\nimport json as _json\n_out = []\nfor _x in {inputs!r}:\n    try:\n"
                   "        _out.append(_json.dumps(f(_x)))\n    except BaseException:\n        _out.append(None)\n"
                   "print()\nprint(_json.dumps(_out))\n")
        run = run_python(harness, self.limits)
        for _ in range(GRADE_RETRIES):  # a wall-clock kill may be the machine's load, not the answer: try again
            if run.killed != "wall_clock":
                break
            run = run_python(harness, self.limits)
        passed = [False] * len(inputs)
        try:
            got = json.loads(run.stdout.strip().splitlines()[-1]) if run.ok else []
            for i, ((_, expected), value) in enumerate(zip(tests, got)):
                passed[i] = isinstance(value, str) and json.dumps(json.loads(value)) == json.dumps(expected)
        except (ValueError, IndexError, TypeError):
            pass  # no well-formed report: nothing passed
        if run.killed != "wall_clock":  # a wall-clock kill may be the machine's load: run it again next time
            with self._lock:
                self._results[key] = passed
                while len(self._results) > self.memo:
                    self._results.popitem(last=False)
        return passed

    def check(self, task: Task, answer: str | None) -> bool:
        """Every hidden test passes."""
        return all(self.results(task, answer))


def reference(task: Task, messages: list[Message]) -> str:
    """Run the solution on an example first, then answer with it."""
    if not any(m.role == "tool" for m in messages):
        return format_call("python", f"{task.answer}\nprint(f({task.data['probe']}))")
    return format_answer(task.answer)


def make_skill() -> Skill:
    """The `code` skill."""
    tasks = CodeTasks()

    def tests_passed(answer: str | None, task: Task) -> float:
        """The fraction of hidden tests the answer's f passes."""
        passed = tasks.results(task, answer)
        return sum(passed) / len(passed)

    return Skill(
        name="code", version="2", description="write a one-line Python function, graded by hidden tests in the sandbox (multi-turn, python tool)",
        tasks=tasks, env=Environment(system_prompt=SYSTEM, tools=[PythonSandbox(memo=4096)], max_turns=3,
                        concurrency=SANDBOX_CONCURRENCY),
        rubric=Rubric([RewardFunc(tests_passed, 1.0), RewardFunc(good_call, 0.1, per_turn=True),
                       RewardFunc(tool_calls_made, 0.0)]),
        reference=reference,
    )
