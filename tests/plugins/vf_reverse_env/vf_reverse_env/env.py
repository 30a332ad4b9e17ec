"""The taskset (random short strings, reward 1 for the exact reversal) and a one-call chat harness."""

from __future__ import annotations

import random
import re
import string
from collections.abc import Iterator

import verifiers.v1 as vf
from openai import AsyncOpenAI

SYSTEM_PROMPT = "Reverse. Reply <answer>S</answer>."  # the built-in `reverse` skill's prompt
ANSWER = re.compile(r"<answer>(.*?)</answer>", re.S)


class ReverseData(vf.TaskData):
    answer: str


class ReverseTask(vf.Task[ReverseData]):
    @vf.reward(weight=1.0)
    async def exact(self, trace: vf.Trace) -> float:
        """1 when the reply's <answer> is the reversed string."""
        found = ANSWER.search(trace.last_reply)
        return float(found is not None and found.group(1).strip() == self.data.answer)


class ReverseConfig(vf.TasksetConfig):
    seed: int = 0
    min_len: int = 2
    max_len: int = 4


class ReverseTaskset(vf.Taskset[ReverseTask, ReverseConfig]):
    INFINITE = True

    def load(self) -> Iterator[ReverseTask]:
        rng = random.Random(self.config.seed)
        while True:
            s = "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(self.config.min_len, self.config.max_len)))
            yield ReverseTask(ReverseData(prompt=s, system_prompt=SYSTEM_PROMPT, answer=s[::-1]), self.config.task)


class ChatHarnessConfig(vf.HarnessConfig):
    pass


class ChatHarness(vf.Harness[ChatHarnessConfig]):
    """One chat completion on the task's messages, in this process (through the rollout's interception)."""

    APPENDS_SYSTEM_PROMPT = True
    EXECUTES_CODE = False
    NEEDS_CONTAINER = False

    async def launch(self, ctx: vf.ModelContext, trace: vf.Trace, runtime: vf.Runtime, endpoint: str, secret: str,
                     mcp_urls: dict[str, str], data: vf.TaskData) -> vf.ProgramResult:
        system, prompt = self.resolve_prompt(data)
        messages = [{"role": "system", "content": system}] if system else []
        messages.append({"role": "user", "content": prompt})
        async with AsyncOpenAI(base_url=endpoint, api_key=secret, max_retries=0) as client:
            reply = await client.chat.completions.create(model=ctx.model, messages=messages)
        return vf.ProgramResult(exit_code=0, stdout=reply.choices[0].message.content or "", stderr="")
