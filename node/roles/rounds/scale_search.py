"""The merge's lambda, chosen on evidence: a round is merged at the network's `lambda` and at each of its
`lambda_search` alternatives, and each merge is played on the usefulness test's first-look tasks (the seeded list
drawn after the deltas were published). An alternative replaces `lambda` only where it scores higher on those tasks
with significance: a one-sided sign test over every skill's tasks pooled, paired with the merge at `lambda`, at the
network's confidence shared among the alternatives (Bonferroni). TIES (Yadav et al. 2023) picks lambda on validation
data the same way. In the demo a round's first deltas, large and trained from one model, lost 10-21 points (summed
over four skills) to their specialists when merged at 1 and 6-11 at 1.25-1.5, while later rounds were best at 1;
the significance keeps 300 noisy tasks per skill from moving lambda where it does not help (docs/merging.md, "Choosing
lambda on evidence").
The chosen lambda goes into the checkpoint manifest, so `coordinator run --verify` recomputes the merge bit for bit.
"""

from __future__ import annotations

import logging
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import msgspec

from skillswarm.node.roles.rounds.paired import Paired, Scores
from skillswarm.node.roles.rounds.state import Merged, RoundInputs
from skillswarm.protocol.records import MergePolicy

log = logging.getLogger(__name__)

# merge(policy, out_dir, delta_out) -> a merge.MergeResult
Merge = Callable[[MergePolicy, Path, Path], Any]


def pooled(scores: dict[str, Scores]) -> Scores:
    """Every skill's per-task (reward, correct) in one list (skills in name order)."""
    return [x for s in sorted(scores) for x in scores[s]]


def wins_over(reference: Scores, alternative: Scores, alpha: float) -> tuple[bool, Paired]:
    """Whether `alternative` beats `reference` with significance (more tasks won than lost, p <= `alpha`), and the
    pairing."""
    t = Paired.compare(reference, alternative)
    return t.wins > t.losses and t.p_better <= alpha, t


def choose(reference: Scores, alternatives: list[Scores], alpha: float) -> tuple[int, list[Paired]]:
    """Which merge to keep (0: the reference, i: the i-th alternative), and each alternative paired with the
    reference: an alternative is kept only if it wins more tasks than it loses with p <= `alpha`, the highest total
    reward of those."""
    best, best_total, tests = 0, sum(r for r, _ in reference), []
    for i, alt in enumerate(alternatives, 1):
        ok, t = wins_over(reference, alt, alpha)
        tests.append(t)
        if ok and (total := sum(r for r, _ in alt)) > best_total:
            best, best_total = i, total
    return best, tests


@dataclass
class ScaleSearch:
    """Merges at each lambda the network lists and keeps the one the evidence favours (see the module docstring)."""

    name: str = "lambda"

    def __call__(self, inputs: RoundInputs, merge: Merge, out_dir: Path, delta_out: Path) -> Merged:
        """The merge written to `out_dir` / `delta_out`, with the policy it used (the lambda kept) and, when the
        search ran, its first-look scores and seconds."""
        policy, scales = inputs.spec.merge, inputs.spec.merge.scales()
        if len(scales) == 1 or inputs.spec.screen.eval_n == 0:
            return Merged(merge(policy, out_dir, delta_out), policy)
        t0 = time.monotonic()
        alpha = (1.0 - inputs.spec.screen.confidence) / (len(scales) - 1)
        # the merges are made one at a time and a losing one is deleted at once: at most two are on disk (the one
        # held and the one being tried), a checkpoint and a dense delta each, whatever the number of alternatives
        reference = held = (policy.scale, out_dir, delta_out, merge(policy, out_dir, delta_out),
                            inputs.first_look(out_dir))
        best_total = sum(r for r, _ in pooled(reference[4]))
        try:
            for i, scale in enumerate(scales[1:], 1):
                d, f = _beside(out_dir, i), _beside(delta_out, i)
                tried = (scale, d, f, merge(msgspec.structs.replace(policy, scale=scale), d, f), inputs.first_look(d))
                ok, t = wins_over(pooled(reference[4]), pooled(tried[4]), alpha)
                log.info("round v%d: lambda %g against %g: %d tasks better, %d worse of %d (p=%.3g)",
                         inputs.parent.version, scale, policy.scale, t.wins, t.losses, t.n, t.p_better)
                if ok and (total := sum(r for r, _ in pooled(tried[4]))) > best_total:
                    held, tried, best_total = tried, held, total
                _drop(tried[1], tried[2])  # the loser: the merge just tried, or the one it replaced
            scale, d, f, result, got = held
            if held is not reference:
                d.rename(out_dir)
                f.replace(delta_out)
            return Merged(result, msgspec.structs.replace(policy, scale=scale), got, time.monotonic() - t0)
        except BaseException:
            for i in range(1, len(scales)):
                _drop(_beside(out_dir, i), _beside(delta_out, i))
            raise


def _drop(model_dir: Path, delta_file: Path) -> None:
    """Delete one merge's files (a checkpoint directory and its delta)."""
    shutil.rmtree(model_dir, ignore_errors=True)
    delta_file.unlink(missing_ok=True)


def _beside(path: Path, i: int) -> Path:
    """A sibling of `path` for the i-th alternative's merge."""
    return path.with_name(f"{path.name}.lambda{i}")
