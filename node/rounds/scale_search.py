"""The merge's lambda, chosen on evidence: a round is merged at the network's `lambda` and at each of its
`lambda_search` alternatives, and each merge is played on the usefulness test's first-look tasks (the seeded list
drawn after the deltas were published). An alternative replaces `lambda` only where it scores higher on those tasks
with significance: a one-sided sign test over every skill's tasks pooled, paired with the merge at `lambda`, at the
network's confidence shared among the alternatives (Bonferroni). TIES (Yadav et al. 2023) picks lambda on validation
data the same way. In the demo a round's first deltas, large and trained from one model, lost 10-21 points (summed
over four skills) to their specialists when merged at 1 and 6-11 at 1.25-1.5, while later rounds were best at 1;
the significance keeps 300 noisy tasks per skill from moving lambda where it does not help (README, "Choosing
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

from skillswarm.node.rounds.context import RoundContext
from skillswarm.node.rounds.paired import Paired, Scores
from skillswarm.protocol.records import MergePolicy

log = logging.getLogger(__name__)

# merge(policy, out_dir, delta_out) -> a merge.MergeResult
Merge = Callable[[MergePolicy, Path, Path], Any]


def pooled(scores: dict[str, Scores]) -> Scores:
    """Every skill's per-task (reward, correct) in one list (skills in name order)."""
    return [x for s in sorted(scores) for x in scores[s]]


def choose(reference: Scores, alternatives: list[Scores], alpha: float) -> tuple[int, list[Paired]]:
    """Which merge to keep (0: the reference, i: the i-th alternative), and each alternative paired with the
    reference: an alternative is kept only if it wins more tasks than it loses with p <= `alpha`, the highest total
    reward of those."""
    best, best_total = 0, sum(r for r, _ in reference)
    tests = [Paired.compare(reference, alt) for alt in alternatives]
    for i, (alt, t) in enumerate(zip(alternatives, tests), 1):
        total = sum(r for r, _ in alt)
        if t.wins > t.losses and t.p_better <= alpha and total > best_total:
            best, best_total = i, total
    return best, tests


@dataclass
class ScaleSearch:
    """Merges at each lambda the network lists and keeps the one the evidence favours (see the module docstring)."""

    name: str = "lambda"

    def __call__(self, ctx: RoundContext, merge: Merge, out_dir: Path, delta_out: Path) -> Any:
        """The merge written to `out_dir` / `delta_out`; `ctx.merge_policy` says the lambda it used and
        `ctx.merged_scores` holds its first-look scores when they were measured."""
        policy, scales = ctx.spec.merge, ctx.spec.merge.scales()
        ctx.merge_policy, ctx.merged_scores = policy, {}
        if len(scales) == 1 or ctx.spec.screen.eval_n == 0:
            return merge(policy, out_dir, delta_out)
        t0 = time.monotonic()
        alpha = (1.0 - ctx.spec.screen.confidence) / (len(scales) - 1)
        tried: list[tuple[float, Path, Path, Any, dict[str, Scores]]] = []
        try:
            for i, scale in enumerate(scales):
                d, f = (out_dir, delta_out) if i == 0 else (_beside(out_dir, i), _beside(delta_out, i))
                result = merge(msgspec.structs.replace(policy, scale=scale), d, f)
                tried.append((scale, d, f, result, ctx.first_look(d)))
            best, tests = choose(pooled(tried[0][4]), [pooled(t[4]) for t in tried[1:]], alpha)
            for (scale, *_), t in zip(tried[1:], tests):
                log.info("round v%d: lambda %g against %g: %d tasks better, %d worse of %d (p=%.3g)", ctx.parent.version,
                         scale, policy.scale, t.wins, t.losses, t.n, t.p_better)
            scale, d, f, result, got = tried[best]
            if best:
                shutil.rmtree(out_dir)
                d.rename(out_dir)
                f.replace(delta_out)
            ctx.merge_policy = msgspec.structs.replace(policy, scale=scale)
            ctx.merged_scores = got
            return result
        finally:
            for _, d, f, *_ in tried[1:]:
                shutil.rmtree(d, ignore_errors=True)
                f.unlink(missing_ok=True)
            ctx.seconds[self.name] = ctx.seconds.get(self.name, 0.0) + time.monotonic() - t0


def _beside(path: Path, i: int) -> Path:
    """A sibling of `path` for the i-th alternative's merge."""
    return path.with_name(f"{path.name}.lambda{i}")
