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
Two rules a network file may turn on (`net init` and the demo do; docs/screening-and-merge-guard.md, "Saturated skills and deltas on credit"):
- saturation: a skill the parent solves at `saturated_at` or better on the first look takes no delta this round,
  unless the merge leaves that skill worse than the parent: its deltas are held in reserve for the merge guard;
  with `repair_layers` N, its deltas are instead judged as repairs of the model's first N decoder layers (the rest
  of each delta set aside, no floor on the tasks changed) and those that pass are merged there only;
- credit: a delta that stays inconclusive (not significantly better, not significantly worse, no other skill
  hurt beyond `max_other_drop`) and changes at least `CREDIT_MIN_CHANGE` of its skill's tasks, from a key with a
  record, is merged on credit, earning its key nothing
  (`reputation.py`), and only for a skill no delta of the round showed a gain for (averaged with one that did,
  it would only dilute it). Fresh keys still have to show significance; the merge guard still tests the merge.
Dilution: a delta that passed, but gained under half what the best delta of its skill did this round and loses to it
task by task (significantly), is left out (`no_dilution`), since averaged with it, it would pull the skill back.
Evaluation figures are this coordinator's measurement on its hardware; they decide inclusion and are
published, but only the merge of what was included is bit-reproducible by others.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from msgspec import UNSET

from skillswarm.merge.recipe_params import in_first_layers
from skillswarm.node.rounds.context import Candidate, RoundContext
from skillswarm.node.rounds.paired import Paired, Scores, pocock_level, scores
from skillswarm.node.rounds.reputation import reputation_of, reputations
from skillswarm.protocol.records import LAYERS_FIGURE

log = logging.getLogger(__name__)

# Credit pays for a gain too small for the test's tasks to show, 2 points or more (a late round's honest 2-4). A delta
# that changes fewer than this share of its skill's tasks cannot gain that much, yet moves the merge as much as any:
# a demo's last calc delta changed 9 of 600 calc tasks and cost arith 2.7 points of the merge (85% of arith's gain
# kept instead of 97%; docs/screening-and-merge-guard.md, "Saturated skills' deltas in reserve, and a floor for credit"). It gets no credit.
CREDIT_MIN_CHANGE = 0.02
# A delta whose shown gain is under this share of the best delta of its skill, and which that delta beats task by task,
# is left out (`no_dilution`): averaged with the best (a mean), it would cost the skill more than a quarter of the gain.
DILUTION = 0.5


@dataclass
class Usefulness:
    """Paired held-out evaluation of each candidate (see the module docstring)."""

    name: str = "usefulness"
    # True: judging a saturated skill's deltas held in reserve (the merge guard, when the merge left that skill
    # worse): saturation and the credit floor are set aside, since repairing the skill is then the gain to show
    reserve: bool = False

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
        # the parent on the first look's tasks, measured once a round (the guard's look at a reserve comes later)
        before = {s: ctx.parent_scores.get(s) or scores(engine, s, policy.eval_n, ctx.eval_seed) for s in skills}
        ctx.parent_scores.update(before)  # the merge guard pairs the merged model with the parent on these tasks
        second: dict[str, Scores] = {}  # the parent on the second look's tasks, when needed
        second_ok: list[bool] = []  # whether every skill's split has them (asked once a round, when first needed)

        def second_look_possible() -> bool:
            if not second_ok:
                second_ok.append(_has_second_look(ctx, policy.eval_n))
            return second_ok[0]

        own_scores: dict[int, Scores] = {}  # id(candidate) -> its own skill's scores, both looks' tasks in order

        def measure(look: int, changed: dict[str, torch.Tensor]) -> dict[str, Paired]:
            """The candidate (its tensors `changed`, loaded in the engine) against the parent on look `look`."""
            if look == 1 and not second:
                engine.load_state_dict({n: parent[n] for n in changed}, 0)
                second.update({s: scores(engine, s, policy.eval_n, ctx.eval_seed, 1) for s in skills})
                engine.load_state_dict(changed, 0)
            base = before if look == 0 else second
            got = {s: scores(engine, s, policy.eval_n, ctx.eval_seed, look) for s in skills}
            own_scores[id(c)] = (own_scores.get(id(c), []) if look else []) + got[c.skill]
            return {s: Paired.compare(base[s], got[s]) for s in skills}

        table = reputations(ctx.history, ctx.spec.trust.reputation_rounds) if policy.on_credit is True else {}
        out = []
        for c in candidates:
            parent_accuracy = sum(ok for _, ok in before[c.skill]) / len(before[c.skill])
            saturated = not self.reserve and policy.saturated(parent_accuracy)
            layers = policy.repair_layers if saturated and policy.repair_layers is not UNSET else None
            if saturated and layers is None:
                ctx.reject(c, self.name, f"the parent already solves {c.skill} ({parent_accuracy:.1%} of "
                                         f"{policy.eval_n} tasks, saturated at {policy.saturated_at:.0%}): there is "
                                         f"no gain left to show, so the round takes no delta for it",
                           {"parent_accuracy": parent_accuracy}, harmful=False)
                ctx.reserve.setdefault(c.skill, []).append(c)
                continue
            t0 = time.monotonic()
            with DeltaFile(c.path) as f, torch.no_grad():
                changed = {n: parent[n] + f.get(n).to(parent[n].dtype) for n in f.names()
                           if n in parent and (layers is None or in_first_layers(n, layers))}
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
            significant = own.wins > own.losses and own.p_better <= level
            floor = 0.0 if self.reserve or layers else CREDIT_MIN_CHANGE  # a repair's gain is the few tasks it fixes
            credit = not significant and not hurt and bool(table) and _creditable(own, alpha, floor) \
                and reputation_of(table, c.author).say > 0
            if layers and not hurt and (significant or credit):
                c.figures.pop("eval_s", None)
                c.figures = {LAYERS_FIGURE: float(layers), **c.figures}  # the merge reads it: first in the manifest
                log.info("round v%d: %s (%s), of a saturated skill (%.1f%% on the parent), passes as a repair of its "
                         "first %d layer(s): %d tasks better, %d worse of %d", ctx.parent.version, c.manifest.blob[:12],
                         c.skill, 100 * parent_accuracy, layers, own.wins, own.losses, own.n)
            if credit:
                c.figures.pop("eval_s", None)  # a manifest carries 8 figures: this one says why it is in
                c.figures["on_credit"] = 1.0
                log.info("round v%d: %s (%s) merged on credit: %d tasks better, %d worse of %d", ctx.parent.version,
                         c.manifest.blob[:12], c.skill, own.wins, own.losses, own.n)
                out.append(c)
            elif not significant:
                what = f"its first {layers} layer(s), judged as a repair, do" if layers else "it does"
                ctx.reject(c, self.name, f"{what} not improve {c.skill} with {policy.confidence:.0%} confidence: "
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
        return self._credit_only_where_nothing_was_shown(ctx, no_dilution(ctx, self.name, out, own_scores, alpha))

    def _credit_only_where_nothing_was_shown(self, ctx: RoundContext, passed: list[Candidate]) -> list[Candidate]:
        """Drop the deltas on credit of a skill that has a delta with a shown gain this round: averaged into that
        skill they would only dilute it (a random direction from a key with a record cost the drill's merge 9.3
        points that way; bench/poison.py --reputed)."""
        shown = {c.skill for c in passed if "on_credit" not in c.figures}
        out = []
        for c in passed:
            if "on_credit" in c.figures and c.skill in shown:
                ctx.reject(c, self.name, f"another delta of {c.skill} showed a gain this round; one that showed "
                                         f"none would only dilute it in the skill's average", harmful=False)
            else:
                out.append(c)
        return out


def no_dilution(ctx: RoundContext, step: str, passed: list[Candidate], own_scores: dict[int, Scores],
                alpha: float) -> list[Candidate]:
    """`passed` less the deltas that would dilute their skill: a shown gain under `DILUTION` x the best of its skill
    this round, and significantly worse than that delta task by task (at `alpha`, on the tasks both were played on).
    The test against the parent lets a delta with no effect through 1 - confidence of the time; averaged with the
    skill's best, such a delta only pulls the skill back, and the guard, which compares the merge with the parent,
    cannot see it (a random direction that passed by chance cost the poisoning drill's merge 7.7 points). Not held
    against its key: an honest delta may just be the weaker of two."""
    best: dict[str, Candidate] = {}
    for c in passed:
        if "on_credit" not in c.figures and id(c) in own_scores and \
                (c.skill not in best or c.figures["gain"] > best[c.skill].figures["gain"]):
            best[c.skill] = c
    out = []
    for c in passed:
        b = best.get(c.skill)
        if b is None or b is c or "on_credit" in c.figures or id(c) not in own_scores:
            out.append(c)
            continue
        n = min(len(own_scores[id(b)]), len(own_scores[id(c)]))
        vs = Paired.compare(own_scores[id(b)][:n], own_scores[id(c)][:n])
        if c.figures["gain"] < DILUTION * b.figures["gain"] and vs.losses > vs.wins and vs.p_worse <= alpha:
            ctx.reject(c, step, f"its gain on {c.skill} ({c.figures['gain']:+.1%}) is under {DILUTION:.0%} of "
                                f"{b.manifest.blob[:12]}'s ({b.figures['gain']:+.1%}), which beats it on {vs.losses} "
                                f"tasks to {vs.wins} of {vs.n} (p={vs.p_worse:.3g}): averaged with it, it would only "
                                "dilute the skill", {**c.figures, "p_diluted": vs.p_worse}, harmful=False)
        else:
            out.append(c)
    return out


def _creditable(own: Paired, alpha: float, min_change: float) -> bool:
    """Whether a delta that did not show a gain may go in on credit: it changed at least `min_change` of its skill's
    tasks, and at least one (a delta that changes nothing is a free ride), and its skill is not significantly worse
    (at `alpha`). What it costs the other skills is judged as for any delta: `max_other_drop` alone, then the guard."""
    return own.wins + own.losses >= max(1.0, min_change * own.n) and own.p_worse > alpha


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
