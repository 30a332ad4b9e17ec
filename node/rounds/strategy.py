"""A round strategy: the ordered screening steps, how accepted deltas become per-skill groups, the merge (at the
lambda the search picks, checked by the merge guard), and the evaluation of the result. The coordinator runs one; a network that wants a stricter policy builds
its own (other steps, other order, another weighting) without touching `coordinator.py`.
"""

from __future__ import annotations

import logging
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from skillswarm.node.rounds.admission import Admission, Caps
from skillswarm.node.rounds.context import Candidate, RoundContext, Step, first_layers
from skillswarm.node.rounds.fetching import Fetch
from skillswarm.node.rounds.guard import MergeGuard
from skillswarm.node.rounds.inspection import Consensus, Inspect
from skillswarm.node.rounds.reputation import Weigh
from skillswarm.node.rounds.scale_search import Merge, ScaleSearch
from skillswarm.node.rounds.usefulness import Usefulness
from skillswarm.protocol.records import MergePolicy, SkillMetrics

log = logging.getLogger(__name__)


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
    """screen (the steps, in order) -> groups -> merge at the searched lambda, checked by the guard -> evaluate."""

    steps: list[Step] = field(default_factory=default_steps)
    # takes out what the merge should not hold (MergeGuard's call); None: the merge of what screening accepted stands
    guard: Callable[[RoundContext, list[Candidate], Path], list[Candidate]] | None = field(default_factory=MergeGuard)
    evaluate: Callable[[Path, list[str], int], dict[str, SkillMetrics]] = evaluate_all
    # picks the merge's lambda among the network's (ScaleSearch's call); None: the network's lambda
    search: Callable[[RoundContext, Merge, Path, Path], Any] | None = field(default_factory=ScaleSearch)

    def screen(self, ctx: RoundContext, candidates: list[Candidate]) -> list[Candidate]:
        """Run every step on what the previous one let through; each step's seconds go to `ctx.seconds`."""
        for step in self.steps:
            if not candidates:
                break
            t0 = time.monotonic()
            candidates = step(ctx, candidates)
            ctx.seconds[step.name] = ctx.seconds.get(step.name, 0.0) + time.monotonic() - t0
            log.debug("round v%d: %d candidate(s) after %s", ctx.parent.version, len(candidates), step.name)
        return candidates

    def groups(self, accepted: list[Candidate]) -> dict[str, list[tuple[Path, float]]]:
        """Accepted deltas by skill, each with its weight, in blob order (the order the merge sums them)."""
        out: dict[str, list[tuple[Path, float]]] = {}
        for c in sorted(accepted, key=lambda c: c.manifest.blob):
            assert c.path is not None
            out.setdefault(c.skill, []).append((c.path, c.weight))
        return out

    def merge(self, ctx: RoundContext, groups: dict[str, list[tuple[Path, float]]], out_dir: Path, delta_out: Path,
              policy: MergePolicy | None = None, **options: Any) -> Any:
        """The merge of the groups onto the parent (a `merge.MergeResult`) by `policy`, default the network's."""
        from skillswarm.merge import merge_checkpoint
        from skillswarm.merge.deltas import dense_codec_for

        return merge_checkpoint(ctx.base_dir, groups, policy or ctx.spec.merge, out_dir, seed=ctx.parent.version,
                                delta_out=delta_out, delta_codec=dense_codec_for(ctx.base_dir),
                                base_hash=ctx.parent.weights_hash, progress=ctx.progress, **options)

    def merge_searched(self, ctx: RoundContext, accepted: list[Candidate], out_dir: Path, delta_out: Path,
                       **options: Any) -> Any:
        """Merge `accepted` at the lambda the search picks (`ctx.merge_policy` says which), or the network's."""
        groups = self.groups(accepted)
        options = {"first_layers": first_layers((c.skill, c.figures) for c in accepted), **options}
        if self.search is None:
            ctx.merge_policy, ctx.merged_scores = ctx.spec.merge, {}
            return self.merge(ctx, groups, out_dir, delta_out, **options)
        return self.search(ctx, lambda policy, d, f: self.merge(ctx, groups, d, f, policy=policy, **options),
                           out_dir, delta_out)

    def merge_guarded(self, ctx: RoundContext, accepted: list[Candidate], out_dir: Path, delta_out: Path,
                      **options: Any) -> tuple[Any, list[Candidate]]:
        """Merge `accepted` (at the searched lambda); while the guard changes what is merged (takes a delta out,
        brings a reserve in), merge again. Returns the last merge's result and what it merged (None and [] when the
        guard took out every delta)."""
        while accepted:
            result = self.merge_searched(ctx, accepted, out_dir, delta_out, **options)
            kept = accepted if self.guard is None else self.guard(ctx, accepted, out_dir)
            if [id(c) for c in kept] == [id(c) for c in accepted]:
                return result, accepted
            accepted = kept
            shutil.rmtree(out_dir, ignore_errors=True)
            delta_out.unlink(missing_ok=True)
        return None, []
