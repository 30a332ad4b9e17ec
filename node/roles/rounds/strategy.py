"""A round strategy: the ordered screening steps, the merge of what they accept (at the lambda the search picks,
checked by the merge guard), and the evaluation of the result. The strategy drives the round: it hands each step the
round's inputs and state, and makes the next state from the step's verdict. The coordinator runs one; a network that
wants a stricter policy builds its own (other steps, other order, another weighting) without touching `coordinator.py`.
"""

from __future__ import annotations

import logging
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

from skillswarm.merge.rounds import round_merge
from skillswarm.node.roles.rounds.admission import Admission, Caps
from skillswarm.node.roles.rounds.fetching import Fetch
from skillswarm.node.roles.rounds.guard import MergeGuard
from skillswarm.node.roles.rounds.inspection import Consensus, Inspect
from skillswarm.node.roles.rounds.reputation import Weigh
from skillswarm.node.roles.rounds.scale_search import Merge, ScaleSearch
from skillswarm.node.roles.rounds.state import Candidate, GuardVerdict, Merged, RoundInputs, RoundState, Step
from skillswarm.node.roles.rounds.usefulness import Usefulness
from skillswarm.protocol.records import MergePolicy, SkillMetrics

log = logging.getLogger(__name__)

# the merge guard's call: the merge in a directory of the state's candidates, judged
Guard = Callable[[RoundInputs, RoundState, Path], GuardVerdict]
# the lambda search's call: merges by a policy it picks, to the checkpoint directory and merged-delta file given
Search = Callable[[RoundInputs, Merge, Path, Path], Merged]


def default_steps() -> list[Step]:
    """The network's default screening: manifest checks, caps, fetch, file checks, consensus, usefulness, weights."""
    return [Admission(), Caps(), Fetch(), Inspect(), Consensus(), Usefulness(), Weigh()]


def evaluate_all(model_dir: Path, skills: list[str], n: int) -> dict[str, SkillMetrics]:
    """Held-out accuracy and mean reward of every skill on one checkpoint (greedy, the fixed eval split)."""
    from skillswarm.node.rl.engines.hf import HFEngine
    from skillswarm.node.rl.evaluation import evaluate

    engine = HFEngine.load(model_dir)
    out = {}
    for skill in skills:
        r = evaluate(engine, skill, n=n)
        out[skill] = SkillMetrics(accuracy=r.accuracy, mean_reward=r.mean_reward, n=r.n)
    return out


@dataclass
class RoundStrategy:
    """screen (the steps, in order) -> merge at the searched lambda, checked by the guard -> evaluate. It drives the
    round: each step's verdict becomes the next state (`RoundState.after`), which the next step reads."""

    steps: list[Step] = field(default_factory=default_steps)
    # judges a merge and takes out what it should not hold (MergeGuard); None: the merge of what screening accepted
    # stands
    guard: Guard | None = field(default_factory=MergeGuard)
    evaluate: Callable[[Path, list[str], int], dict[str, SkillMetrics]] = evaluate_all
    # picks the merge's lambda among the network's (ScaleSearch); None: the network's lambda
    search: Search | None = field(default_factory=ScaleSearch)

    def screen(self, inputs: RoundInputs, candidates: Sequence[Candidate],
               state: RoundState | None = None) -> RoundState:
        """Run every step on what the previous one let through, from `state` (default: a new round's) with
        `candidates` to judge; each step's seconds go to the state's `seconds`."""
        state = (state or RoundState()).but(candidates=tuple(candidates))
        for step in self.steps:
            if not state.candidates:
                break
            t0 = time.monotonic()
            verdict = step(inputs, state)
            state = state.after(step.name, verdict, time.monotonic() - t0)
            log.debug("round v%d: %d candidate(s) after %s", inputs.parent.version, len(state.candidates), step.name)
        return state

    def merge(self, inputs: RoundInputs, deltas: Sequence[Candidate], policy: MergePolicy, out_dir: Path,
              delta_out: Path, **options: Any) -> Any:
        """The merge of `deltas` onto the parent by `policy` (a `merge.MergeResult`): the round's recipe,
        `merge.round_merge`, which `--verify` recomputes from the manifest."""
        return round_merge(inputs.base_dir, [c.to_merge() for c in deltas], policy, out_dir, seed=inputs.parent.version,
                           delta_out=delta_out, base_hash=inputs.parent.weights_hash, progress=inputs.progress,
                           **options)

    def merge_searched(self, inputs: RoundInputs, state: RoundState, out_dir: Path, delta_out: Path,
                       **options: Any) -> tuple[Any, RoundState]:
        """Merge `state.candidates` at the lambda the search picks, or the network's; the result, and the state with
        the policy it used (`merge_policy`) and its first-look scores when the search measured them."""
        accepted = state.candidates
        if self.search is None:
            policy = inputs.spec.merge
            merged = Merged(self.merge(inputs, accepted, policy, out_dir, delta_out, **options), policy)
        else:
            merged = self.search(inputs, lambda policy, d, f: self.merge(inputs, accepted, policy, d, f, **options),
                                 out_dir, delta_out)
        return merged.result, state.after_merge(merged, getattr(self.search, "name", "lambda"))

    def merge_guarded(self, inputs: RoundInputs, state: RoundState, out_dir: Path, delta_out: Path,
                      **options: Any) -> tuple[Any, RoundState]:
        """Merge `state.candidates` (at the searched lambda); while the guard changes what is merged (takes a delta
        out, brings a reserve in), merge again. Returns the last merge's result (None when the guard took out every
        delta) and the state, whose candidates are what that merge holds."""
        while state.candidates:
            result, state = self.merge_searched(inputs, state, out_dir, delta_out, **options)
            if self.guard is None:
                return result, state
            before = [c.key for c in state.candidates]
            state = state.after_guard(self.guard(inputs, state, out_dir), getattr(self.guard, "name", "guard"))
            if [c.key for c in state.candidates] == before:
                return result, state
            shutil.rmtree(out_dir, ignore_errors=True)
            delta_out.unlink(missing_ok=True)
        return None, state
