"""The usefulness test: a delta enters a merge only if it measurably helps its own skill and does not
cost any other skill more than the network tolerates.

The coordinator evaluates the parent and each candidate (parent + delta) greedily on the same `eval_n`
held-out tasks per skill, drawn from the skill's fixed eval split with a seed it picks at screening time,
after every delta was published (recorded in the manifest as `eval_seed`), so no one could tune a delta
to the exact tasks. Comparisons are paired, task by task, with a one-sided sign test on the rewards:
- own skill: the delta must win more tasks than it loses, significantly;
- every other skill: rejected when it loses significantly *and* its accuracy drops by more than
  `max_other_drop`.
A delta that wins more than it loses but not significantly gets a second look: `eval_n` more tasks (the
next ones of the same seeded list) for it and the parent, and the test is repeated on all 2 x `eval_n`.
A late round's honest gain of 3-7 points is often not significant on 300 tasks (the demo lost such deltas
at p = 0.1-0.4), and the second look costs only the candidates that need it. Both looks test at Pocock's
nominal level, which keeps the chance that a delta with no effect passes at 1 - confidence overall.
Evaluation figures are this coordinator's measurement on its hardware; they decide inclusion and are
published, but only the merge of what was included is bit-reproducible by others.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from skillswarm.node.rounds.context import Candidate, RoundContext
from skillswarm.node.rounds.paired import Paired, Scores, pocock_level, scores


@dataclass
class Usefulness:
    """Paired held-out evaluation of each candidate (see the module docstring)."""

    name: str = "usefulness"

    def __call__(self, ctx: RoundContext, candidates: list[Candidate]) -> list[Candidate]:
        policy = ctx.spec.screen
        if policy.eval_n == 0 or not candidates:
            return candidates
        import torch

        from skillswarm.merge.deltas import DeltaFile
        from skillswarm.node.rl.engines.hf import HFEngine

        alpha = 1.0 - policy.confidence
        level = pocock_level(alpha)
        engine = HFEngine.load(ctx.base_dir)
        parent = {k: v.detach().clone() for k, v in engine.model.state_dict().items()}
        skills = list(ctx.spec.skills)
        before = {s: scores(engine, s, policy.eval_n, ctx.eval_seed) for s in skills}
        ctx.parent_scores.update(before)  # the merge guard pairs the merged model with the parent on these tasks
        second: dict[str, Scores] = {}  # the parent on the second look's tasks, when needed
        second_ok: list[bool] = []  # whether every skill's split has them (asked once a round, when first needed)

        def second_look_possible() -> bool:
            if not second_ok:
                second_ok.append(_has_second_look(ctx, policy.eval_n))
            return second_ok[0]

        def measure(look: int, changed: dict[str, torch.Tensor]) -> dict[str, Paired]:
            """The candidate (its tensors `changed`, loaded in the engine) against the parent on look `look`."""
            if look == 1 and not second:
                engine.load_state_dict({n: parent[n] for n in changed}, 0)
                second.update({s: scores(engine, s, policy.eval_n, ctx.eval_seed, 1) for s in skills})
                engine.load_state_dict(changed, 0)
            base = before if look == 0 else second
            return {s: Paired.compare(base[s], scores(engine, s, policy.eval_n, ctx.eval_seed, look)) for s in skills}

        out = []
        for c in candidates:
            t0 = time.monotonic()
            with DeltaFile(c.path) as f, torch.no_grad():
                changed = {n: parent[n] + f.get(n).to(parent[n].dtype) for n in f.names() if n in parent}
            engine.load_state_dict(changed, 0)
            try:
                after = measure(0, changed)
                looks = 1
                if _undecided(after, c.skill, level, alpha, policy.max_other_drop) and second_look_possible():
                    after = {s: p + q for (s, p), q in zip(after.items(), measure(1, changed).values())}
                    looks = 2
            finally:
                engine.load_state_dict({n: parent[n] for n in changed}, 0)
            ctx.measured[c.manifest.blob] = after
            own = after[c.skill]
            c.figures.update({"gain": own.gain, "p_better": own.p_better, "eval_s": time.monotonic() - t0,
                              "looks": float(looks)})
            others = [(s, p) for s, p in after.items() if s != c.skill]
            worst = min(others, key=lambda sp: sp[1].gain, default=None)
            if worst is not None:
                c.figures.update({"worst_other_gain": worst[1].gain, "p_worse": worst[1].p_worse})
            # harm is tested at the full alpha on every look: erring there costs honest deltas, not the network
            hurt = [(s, p) for s, p in others if -p.gain > policy.max_other_drop and p.p_worse <= alpha]
            if not (own.wins > own.losses and own.p_better <= level):
                ctx.reject(c, self.name, f"it does not improve {c.skill} with {policy.confidence:.0%} confidence: "
                                         f"{own.wins} tasks better, {own.losses} worse of {own.n}"
                                         f"{' (two looks)' if looks == 2 else ''} "
                                         f"(accuracy {own.accuracy_before:.1%} -> {own.accuracy_after:.1%}, "
                                         f"p={own.p_better:.3g})", harmful=own.p_worse <= alpha or bool(hurt))
            elif hurt:
                s, p = min(hurt, key=lambda sp: sp[1].gain)
                ctx.reject(c, self.name, f"it costs {s} {-p.gain:.1%} of accuracy ({p.accuracy_before:.1%} -> "
                                         f"{p.accuracy_after:.1%}, p={p.p_worse:.3g}); the network tolerates "
                                         f"{policy.max_other_drop:.1%}")
            else:
                out.append(c)
        return out


def _undecided(after: dict[str, Paired], skill: str, level: float, alpha: float, max_other_drop: float) -> bool:
    """Whether a first look merits a second: the delta wins more than it loses on its skill without significance
    (at `level`), and is not already significantly harmful to another skill (at `alpha`)."""
    own = after[skill]
    harmful = any(-p.gain > max_other_drop and p.p_worse <= alpha for s, p in after.items() if s != skill)
    return own.wins > own.losses and own.p_better > level and not harmful


def _has_second_look(ctx: RoundContext, n: int) -> bool:
    """Whether every skill's held-out split has 2 x `n` tasks (a small plugin split may not)."""
    from skillswarm.protocol.errors import SkillError
    from skillswarm.skills.registry import get_skill

    try:
        for s in ctx.spec.skills:
            get_skill(s).tasks.eval_tasks(2 * n, ctx.eval_seed)
    except SkillError:
        return False
    return True
