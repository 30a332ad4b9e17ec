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
from typing import Mapping

from msgspec import UNSET

from skillswarm.merge.recipe_params import in_first_layers
from skillswarm.node.roles.rounds.paired import Paired, Scores, pocock_level, scores
from skillswarm.node.roles.rounds.reputation import reputation_of, reputations
from skillswarm.node.roles.rounds.state import Candidate, Evidence, Rejected, RoundInputs, RoundState, Verdict, reject

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

    def __call__(self, inputs: RoundInputs, state: RoundState) -> Verdict:
        candidates = state.candidates
        policy = inputs.spec.screen
        if policy.eval_n == 0 or not candidates:
            return Verdict(candidates)
        import torch

        from skillswarm.merge.deltas import DeltaFile
        from skillswarm.node.rl.engines.hf import HFEngine

        alpha = 1.0 - policy.confidence
        level = pocock_level(alpha)
        engine = HFEngine.load(inputs.base_dir)
        parent = {k: v.detach().clone() for k, v in engine.model.state_dict().items()}
        skills = list(inputs.spec.skills)
        # the parent on the first look's tasks, measured once a round (the guard's look at a reserve comes later); the
        # merge guard pairs the merged model with the parent on these tasks
        before = {s: state.parent_scores.get(s) or scores(engine, s, policy.eval_n, inputs.eval_seed) for s in skills}
        second: dict[str, Scores] = {}  # the parent on the second look's tasks, when needed
        second_ok: list[bool] = []  # whether every skill's split has them (asked once a round, when first needed)

        def second_look_possible() -> bool:
            if not second_ok:
                second_ok.append(_has_second_look(inputs, policy.eval_n))
            return second_ok[0]

        own_scores: dict[tuple[str, str, str], Scores] = {}  # candidate key -> its own skill's scores, every look's

        def measure(c: Candidate, look: int, changed: dict[str, torch.Tensor]) -> dict[str, Paired]:
            """The candidate `c` (its tensors `changed`, loaded in the engine) against the parent on look `look`."""
            if look == 1 and not second:
                engine.load_state_dict({n: parent[n] for n in changed}, 0)
                second.update({s: scores(engine, s, policy.eval_n, inputs.eval_seed, 1) for s in skills})
                engine.load_state_dict(changed, 0)
            base = before if look == 0 else second
            got = {s: scores(engine, s, policy.eval_n, inputs.eval_seed, look) for s in skills}
            own_scores[c.key] = (own_scores.get(c.key, []) if look else []) + got[c.skill]
            return {s: Paired.compare(base[s], got[s]) for s in skills}

        table = reputations(inputs.history, inputs.spec.trust.reputation_rounds) if policy.on_credit is True else {}
        measured: dict[str, dict[str, Paired]] = {}
        reserve: dict[str, list[Candidate]] = {}
        rejected: list[Rejected] = []
        out: list[Candidate] = []
        for c in candidates:
            parent_accuracy = sum(ok for _, ok in before[c.skill]) / len(before[c.skill])
            saturated = not self.reserve and policy.saturated(parent_accuracy)
            layers = policy.repair_layers if saturated and policy.repair_layers is not UNSET else None
            if saturated and layers is None:
                rejected.append(reject(inputs, c, self.name, f"the parent already solves {c.skill} "
                                                             f"({parent_accuracy:.1%} of {policy.eval_n} tasks, "
                                                             f"saturated at {policy.saturated_at:.0%}): there is no "
                                                             "gain left to show, so the round takes no delta for it",
                                       {"parent_accuracy": parent_accuracy}, harmful=False))
                reserve.setdefault(c.skill, []).append(c)
                continue
            t0 = time.monotonic()
            with DeltaFile(c.path) as f, torch.no_grad():
                changed = {n: parent[n] + f.get(n).to(parent[n].dtype) for n in f.names()
                           if n in parent and (layers is None or in_first_layers(n, layers))}
            engine.load_state_dict(changed, 0)
            try:
                after = measure(c, 0, changed)
                looks = 1
                if _undecided(after, c.skill, level, alpha, policy.max_other_drop) and second_look_possible():
                    after = {s: p + q for (s, p), q in zip(after.items(), measure(c, 1, changed).values())}
                    looks = 2
            finally:
                engine.load_state_dict({n: parent[n] for n in changed}, 0)
            measured[c.manifest.blob] = after
            own = after[c.skill]
            figures = {**c.figures, "gain": own.gain, "p_better": own.p_better, "eval_s": time.monotonic() - t0,
                       "looks": float(looks)}
            others = [(s, p) for s, p in after.items() if s != c.skill]
            worst = min(others, key=lambda sp: sp[1].gain, default=None)
            if worst is not None:
                figures.update({"worst_other_gain": worst[1].gain, "p_worse": worst[1].p_worse})
            # harm is tested at the full alpha on every look: erring there costs honest deltas, not the network
            hurt = [(s, p) for s, p in others if -p.gain > policy.max_other_drop and p.p_worse <= alpha]
            significant = own.wins > own.losses and own.p_better <= level
            floor = 0.0 if self.reserve or layers else CREDIT_MIN_CHANGE  # a repair's gain is the few tasks it fixes
            credit = not significant and not hurt and bool(table) and _creditable(own, alpha, floor) \
                and reputation_of(table, c.author).say > 0
            if credit:
                figures.pop("eval_s", None)  # a manifest carries 8 figures: this one says why it is in
                figures["on_credit"] = 1.0
            c = c.but(figures=figures)
            if layers and not hurt and (significant or credit):
                c = c.but(layers=layers)  # what the merge reads: the delta goes in these layers only
                log.info("round v%d: %s (%s), of a saturated skill (%.1f%% on the parent), passes as a repair of its "
                         "first %d layer(s): %d tasks better, %d worse of %d", inputs.parent.version,
                         c.manifest.blob[:12], c.skill, 100 * parent_accuracy, layers, own.wins, own.losses, own.n)
            if credit:
                log.info("round v%d: %s (%s) merged on credit: %d tasks better, %d worse of %d", inputs.parent.version,
                         c.manifest.blob[:12], c.skill, own.wins, own.losses, own.n)
                out.append(c)
            elif not significant:
                what = f"its first {layers} layer(s), judged as a repair, do" if layers else "it does"
                rejected.append(reject(inputs, c, self.name, f"{what} not improve {c.skill} with "
                                                             f"{policy.confidence:.0%} confidence: {own.wins} tasks "
                                                             f"better, {own.losses} worse of {own.n}"
                                                             f"{' (two looks)' if looks == 2 else ''} "
                                                             f"(accuracy {own.accuracy_before:.1%} -> "
                                                             f"{own.accuracy_after:.1%}, p={own.p_better:.3g})",
                                       harmful=own.p_worse <= alpha or bool(hurt)))
            elif hurt:
                s, p = min(hurt, key=lambda sp: sp[1].gain)
                rejected.append(reject(inputs, c, self.name, f"it costs {s} {-p.gain:.1%} of accuracy "
                                                             f"({p.accuracy_before:.1%} -> {p.accuracy_after:.1%}, "
                                                             f"p={p.p_worse:.3g}); the network tolerates "
                                                             f"{policy.max_other_drop:.1%}"))
            else:
                out.append(c)
        out, diluting = no_dilution(inputs, self.name, out, own_scores, alpha)
        out, crowded = _credit_only_where_nothing_was_shown(inputs, self.name, out)
        return Verdict(tuple(out), (*rejected, *diluting, *crowded),
                       evidence=Evidence(parent_scores=before, measured=measured, reserve=reserve))


def _credit_only_where_nothing_was_shown(inputs: RoundInputs, step: str,
                                         passed: list[Candidate]) -> tuple[list[Candidate], list[Rejected]]:
    """`passed` less the deltas on credit of a skill that has a delta with a shown gain this round, and their
    rejections: averaged into that skill they would only dilute it (a random direction from a key with a record cost the
    drill's merge 9.3 points that way; bench/poison.py --reputed)."""
    shown = {c.skill for c in passed if "on_credit" not in c.figures}
    out, rejected = [], []
    for c in passed:
        if "on_credit" in c.figures and c.skill in shown:
            rejected.append(reject(inputs, c, step, f"another delta of {c.skill} showed a gain this round; one that "
                                                    "showed none would only dilute it in the skill's average",
                                   harmful=False))
        else:
            out.append(c)
    return out, rejected


def no_dilution(inputs: RoundInputs, step: str, passed: list[Candidate],
                own_scores: Mapping[tuple[str, str, str], Scores],
                alpha: float) -> tuple[list[Candidate], list[Rejected]]:
    """`passed` less the deltas that would dilute their skill, and their rejections: a shown gain under `DILUTION` x
    the best of its skill this round, and significantly worse than that delta task by task (at `alpha`, on the tasks
    both were played on; `own_scores` by candidate key). The test against the parent lets a delta with no effect
    through 1 - confidence of the time; averaged with the skill's best, such a delta only pulls the skill back, and the
    guard, which compares the merge with the parent, cannot see it (a random direction that passed by chance cost the
    poisoning drill's merge 7.7 points). Not held against its key: an honest delta may just be the weaker of two."""
    best: dict[str, Candidate] = {}
    for c in passed:
        if "on_credit" not in c.figures and c.key in own_scores and \
                (c.skill not in best or c.figures["gain"] > best[c.skill].figures["gain"]):
            best[c.skill] = c
    out, rejected = [], []
    for c in passed:
        b = best.get(c.skill)
        if b is None or b is c or "on_credit" in c.figures or c.key not in own_scores:
            out.append(c)
            continue
        n = min(len(own_scores[b.key]), len(own_scores[c.key]))
        vs = Paired.compare(own_scores[b.key][:n], own_scores[c.key][:n])
        if c.figures["gain"] < DILUTION * b.figures["gain"] and vs.losses > vs.wins and vs.p_worse <= alpha:
            rejected.append(reject(inputs, c, step, f"its gain on {c.skill} ({c.figures['gain']:+.1%}) is under "
                                                    f"{DILUTION:.0%} of {b.manifest.blob[:12]}'s "
                                                    f"({b.figures['gain']:+.1%}), which beats it on {vs.losses} tasks "
                                                    f"to {vs.wins} of {vs.n} (p={vs.p_worse:.3g}): averaged with it, "
                                                    "it would only dilute the skill",
                                   {**c.figures, "p_diluted": vs.p_worse}, harmful=False))
        else:
            out.append(c)
    return out, rejected


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


def _has_second_look(inputs: RoundInputs, n: int) -> bool:
    """Whether every skill's held-out split has 2 x `n` tasks (a small plugin split may not)."""
    from skillswarm.protocol.errors import SkillError
    from skillswarm.skills.registry import get_skill

    try:
        for s in inputs.spec.skills:
            get_skill(s).tasks.eval_tasks(2 * n, inputs.eval_seed)
    except SkillError:
        return False
    return True
