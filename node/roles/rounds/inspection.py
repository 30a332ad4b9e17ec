"""Screening a fetched delta's file: is it what its manifest says, is it sane, does it point the way the
skill's trusted contributors point.

`Inspect` runs the merge package's structural screening (format, base, names, shapes, dtypes, finite
values), checks the measured norm against the manifest's claim, and bounds it against the norms of the
skill's recent included deltas. Never against this round's own deltas: their median is the attacker's to
move (one x100 delta makes an honest one look tiny; two tiny sybils make it look huge), so a skill with
no history yet has no norm bound and the usefulness test decides. `Consensus` rejects a delta
whose direction disagrees with the consensus of the skill's other deltas (cosine below `min_cosine`),
where the consensus counts only keys with a record (reputation above a fresh key's): k fresh sybil keys
that agree with each other have no say in it, so they cannot vote an honest delta out. Nor can one key with a
record: a delta is voted out only by a majority, the others' say summed above its own key's, so a proven key
turned hostile (a sign flip, a random direction) cannot take out an honest delta of equal standing; the
usefulness test judges the two (bench/poison.py --reputed).

Copies. A delta equal or nearly equal to another delta is no work of its author's: re-signed by another key (the same
blob), re-encoded or rescaled (x 0.98), it would be a second weight for the same update, and reputation for nothing,
which later lets that key's inconclusive deltas in on credit. After its other checks `Inspect` rejects, at the step
`copycat`, a delta whose cosine with a delta seen before it is `COPY_COSINE` or more (or that has the same blob), over
every skill: a delta of this round seen earlier that passed the same checks, or one an earlier checkpoint of the history
merged (by its blob, or by its file while this coordinator still holds it). "Before" is the order this coordinator
first saw the manifests (`RoundInputs.first_seen`), never the author's `created`, which it writes as it likes; deltas
seen at the same time go to the key with the better reputation, then to the round's draw (`RoundInputs.lot`). So only
the first publisher is credited, and near-copies among colluding keys count as one: the first seen stays, the others
are out. A copy seen later than its original, or of a merged delta, is harmful (its key could only have copied); one
seen at the same time as its original is not, since which of the two is the copy is then a draw, nor is a copy of its
own key's delta (a resend; still one weight only). Cosines are float64 sums over the decoded files, not hashed: they
differ in the last bits between CPUs, far inside the margin between copies (1.0 to within 1e-6 for a re-signed or
rescaled copy) and honest independent deltas (at most 0.69 in the nano demo, see COPY_COSINE). What a cosine threshold
cannot see: a copy with enough added (about a third of its norm in an orthogonal direction brings 1.0 down to 0.95)
passes as another delta, and must then show a gain of its own in the usefulness test; the merge guard judges what the
added part costs. A copy seen in the same poll as its original wins the tie when its key has the better reputation,
and half the time when the two are equal: how finely the coordinator times what it sees bounds this.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from skillswarm.merge.screening import DeltaCandidate, consensus_cosines, norm_outlier, screen_deltas
from skillswarm.node.roles.rounds.admission import skill_norm_history
from skillswarm.node.roles.rounds.reputation import Reputation, reputation_of, reputations
from skillswarm.node.roles.rounds.state import Candidate, Rejected, RoundInputs, RoundState, Verdict, reject

CLAIM_TOLERANCE = 1e-3  # relative difference allowed between a manifest's norm and the file's
# A delta at this cosine or above with one seen before it is a copy. A re-signed, re-encoded or rescaled copy is at
# 1.0 (to within 1e-6), bench/poison.py's colluders (an honest delta plus a twelfth share of the backdoor's poison) at
# 0.998-0.999. Honest work of bench/poison.py's workers (one demo RL round each on the nano base) is far below: two
# seeds of one skill 0.67-0.69 (sort, arith), two skills -0.03 to 0.18; the drill's backdoor (the honest delta plus a
# trained poison at half its norm) 0.89. 0.95 leaves a margin of 0.26 to two honest workers of one skill, far wider
# than any difference float sums can make between CPUs.
COPY_COSINE = 0.95
# float64 elements of all compared files' row chunks in memory at once (128 MiB): each file's chunk is its share
COPY_CHUNK_BUDGET = 1 << 24


@dataclass(frozen=True)
class Copy:
    """What a copy copied: the original's blob and key, where it was seen, their cosine, whether it counts against
    the copy's key."""

    blob: str
    author: str
    where: str
    cosine: float
    harmful: bool


def delta_dots(base_dir: Path, paths: Sequence[Path], rows: int,
               budget: int = COPY_CHUNK_BUDGET) -> tuple[list[list[float]], list[float]]:
    """The dot products of the decoded deltas at `paths[:rows]` with every delta at `paths` (a rows x n table), and
    every delta's square norm: float64 sums, one row chunk of every file in memory at a time (`budget` elements in
    all). Not hashed, so plain floats, for the copy test's cosines. A file past `rows` (a merged delta held from an
    earlier round) that cannot be read, or whose tensor does not fit the base, counts as zero there."""
    import torch

    from skillswarm.merge.checkpoint import Checkpoint
    from skillswarm.merge.deltas import DeltaFile
    from skillswarm.merge.pipeline import is_float
    from skillswarm.merge.tensorfile import row_chunks
    from skillswarm.protocol.errors import MergeError

    n = len(paths)
    dots = torch.zeros(rows, n, dtype=torch.float64)
    squares = torch.zeros(n, dtype=torch.float64)
    base = Checkpoint(base_dir)
    files: list = []
    try:
        for i, p in enumerate(paths):
            try:
                files.append(DeltaFile(p))
            except (MergeError, OSError):
                if i < rows:  # this round's candidates passed the file checks: a failure now is the caller's
                    raise
                files.append(None)
        chunk = max(1 << 12, budget // max(1, n))
        for name in base.names():
            entry = base.entry(name)
            if not is_float(entry.dtype):
                continue
            have = [i for i, f in enumerate(files) if f is not None and name in f and f.shape(name) == entry.shape]
            if not have:
                continue
            own = [k for k, i in enumerate(have) if i < rows]
            index, mine = torch.tensor(have), torch.tensor([have[k] for k in own], dtype=torch.long)
            for r0, r1 in row_chunks(entry.shape, chunk):
                x = torch.stack([files[i].rows(name, r0, r1).reshape(-1).double() for i in have])
                squares[index] += (x * x).sum(dim=1)
                if own:
                    dots[mine[:, None], index[None, :]] += x[own] @ x.T
    finally:
        for f in files:
            if f is not None:
                f.close()
        base.close()
    return dots.tolist(), squares.tolist()


@dataclass
class Copycat:
    """Rejects a delta equal or nearly equal to one seen before it (see the module docstring). `Inspect` runs it on
    the deltas that pass its other checks; as a step of its own it rejects the copies among `candidates`."""

    name: str = "copycat"
    threshold: float = COPY_COSINE

    def __call__(self, inputs: RoundInputs, state: RoundState) -> Verdict:
        return self.judge(inputs, state.candidates)

    def judge(self, inputs: RoundInputs, candidates: Sequence[Candidate]) -> Verdict:
        """`candidates` less the copies among them, each rejected at this step (in `candidates`' order)."""
        copies = self.find(inputs, candidates)
        return Verdict(tuple(c for i, c in enumerate(candidates) if i not in copies),
                       tuple(self.reject(inputs, c, copies[i]) for i, c in enumerate(candidates) if i in copies))

    def reject(self, inputs: RoundInputs, cand: Candidate, copy: Copy) -> Rejected:
        """`cand` out as a copy, at this step."""
        return reject(inputs, cand, self.name, f"a copy (cosine {copy.cosine:.4f} >= {self.threshold:g}) of "
                                               f"{copy.blob[:12]} by key {copy.author[:12]}, {copy.where}: no work of "
                                               "its own, so no weight and no credit",
                      {**cand.figures, "copy_cosine": copy.cosine}, harmful=copy.harmful)

    def order(self, inputs: RoundInputs, candidates: Sequence[Candidate]) -> list[Candidate]:
        """`candidates` in the order this coordinator first saw them; at the same time, the better reputation first,
        then the round's draw."""
        table = reputations(inputs.history, inputs.spec.trust.reputation_rounds)
        return sorted(candidates, key=lambda c: _seen_rank(inputs, table, c))

    def find(self, inputs: RoundInputs, candidates: Sequence[Candidate]) -> dict[int, Copy]:
        """Position in `candidates` -> what it copied, for each copy among `candidates` (each has its file)."""
        if not candidates:
            return {}
        merged: dict[str, tuple[int, str]] = {}  # blob -> (version, author) of the history's included deltas
        for m in sorted(inputs.history, key=lambda m: m.version):
            for d in m.included:
                merged.setdefault(d.blob, (m.version, d.author))
        table = reputations(inputs.history, inputs.spec.trust.reputation_rounds)
        order = sorted(range(len(candidates)), key=lambda i: _seen_rank(inputs, table, candidates[i]))
        paths: dict[str, Path] = {}  # blob -> file: this round's, then the merged ones still held here
        for i in order:
            c = candidates[i]
            assert c.path is not None
            paths.setdefault(c.manifest.blob, c.path)
        rows = len(paths)
        held = [b for b in merged if b in paths or inputs.blobs.has(b)]  # merged deltas whose files are here
        for b in held:
            paths.setdefault(b, inputs.blobs.path(b))
        at = {b: i for i, b in enumerate(paths)}
        dots, squares = delta_dots(inputs.base_dir, list(paths.values()), rows) if len(paths) > 1 else \
            ([[0.0]], [0.0])

        def cosine(a: str, b: str) -> float:  # `a` one of this round's blobs
            if a == b:
                return 1.0
            i, j = at[a], at[b]
            nn = squares[i] * squares[j]
            return dots[i][j] / math.sqrt(nn) if nn > 0 else 0.0

        out: dict[int, Copy] = {}
        seen: list[Candidate] = []
        for i in order:
            c = candidates[i]
            blob = c.manifest.blob
            if blob in merged:
                version, author = merged[blob]
                out[i] = Copy(blob, author, f"merged in v{version}", 1.0, author != c.author)
            elif (match := next(((b, cos) for b in held if (cos := cosine(blob, b)) >= self.threshold), None)):
                version, author = merged[match[0]]
                out[i] = Copy(match[0], author, f"merged in v{version}", match[1], author != c.author)
            elif (first := next(((e, cos) for e in seen if (cos := cosine(blob, e.manifest.blob)) >= self.threshold),
                                None)):
                e, cos = first
                mine, theirs = inputs.seen_at(c), inputs.seen_at(e)
                later = mine > theirs
                where = (f"seen {mine - theirs:.3g} s before it" if later and math.isfinite(mine) else
                         "seen before it" if later else
                         "seen with it (the better reputation, then the round's draw, decided which came first)")
                # a copy of its own key's delta is no theft (a resend), and at the same time which is the copy is a draw
                out[i] = Copy(e.manifest.blob, e.author, where, cos, later and e.author != c.author)
            seen.append(c)
        return out


def _seen_rank(inputs: RoundInputs, table: dict[str, Reputation], c: Candidate) -> tuple:
    """Where `c` stands in the order this coordinator saw the round's deltas (`Copycat.order`)."""
    return (inputs.seen_at(c), -reputation_of(table, c.author).score, inputs.lot(c.author, c.manifest.blob))


@dataclass
class Inspect:
    """Structure, finiteness, the norm claim, norm bounds, then copies (`copycat`; see the module docstring)."""

    name: str = "inspect"
    copycat: Copycat | None = field(default_factory=Copycat)  # None: copies are not looked for

    def __call__(self, inputs: RoundInputs, state: RoundState) -> Verdict:
        spec, parent, candidates = inputs.spec, inputs.parent, state.candidates
        rejected: list[Rejected] = []
        # keyed by position: two manifests may name one blob (a re-signed copy), and each is judged
        screened = screen_deltas(inputs.base_dir, [DeltaCandidate(c.path, key=str(i), skill=c.skill,
                                                                  base_hash=c.manifest.base_hash)
                                                   for i, c in enumerate(candidates)],
                                 base_hash=parent.weights_hash, max_norm_ratio=None)
        for r in screened.rejected:
            rejected.append(reject(inputs, candidates[int(r.candidate.key)], self.name, r.reason))
        passed = []
        for a in screened.accepted:
            c = candidates[int(a.candidate.key)]
            c = c.but(norm=a.norm, figures={**c.figures, "norm": a.norm})
            claimed = c.manifest.norm
            if abs(claimed - a.norm) > CLAIM_TOLERANCE * max(a.norm, 1e-12):
                rejected.append(reject(inputs, c, self.name,
                                       f"its manifest claims norm {claimed:.6g}, the file's is {a.norm:.6g}"))
            elif c.manifest.codec not in (spec.codec, "lora"):  # a LoRA worker's adapter is its exact delta
                rejected.append(reject(inputs, c, self.name,
                                       f"encoded with {c.manifest.codec}; the network's codec is {spec.codec}"))
            else:
                passed.append(c)
        out = []
        for c in passed:
            history = skill_norm_history(inputs.history, c.skill, spec.screen.history_rounds)
            why = norm_outlier(c.norm or 0.0, history, spec.screen.min_norm_ratio, spec.merge.max_norm_ratio)
            if why is None:
                out.append(c)
            else:
                rejected.append(reject(inputs, c, self.name, why,
                                       {**c.figures, "history_median": statistics.median(history)}))
        # copies last: only a delta that passed every other check may stand as the original a later copy is judged by
        # (a broken copy seen first would otherwise take its original out with it)
        if self.copycat is None:
            return Verdict(tuple(out), tuple(rejected))
        copies = self.copycat.judge(inputs, out)
        return Verdict(copies.passed, (*rejected, *copies.rejected))


@dataclass
class Consensus:
    """Direction against the skill's reputable consensus (see the module docstring)."""

    name: str = "consensus"

    def __call__(self, inputs: RoundInputs, state: RoundState) -> Verdict:
        candidates = state.candidates
        table = reputations(inputs.history, inputs.spec.trust.reputation_rounds)
        out: list[Candidate] = []
        rejected: list[Rejected] = []
        for skill in sorted({c.skill for c in candidates}):
            group = [c for c in candidates if c.skill == skill]
            say = [reputation_of(table, c.author).say for c in group]
            cosines = consensus_cosines(inputs.base_dir, [c.path for c in group], say) if len(group) > 1 else [None]
            for c, cos, own in zip(group, cosines, say):
                if cos is not None:
                    c = c.with_figures(cosine=cos)
                outvoted = sum(say) - own > own  # the others carry more say than its own key
                if cos is not None and cos < inputs.spec.screen.min_cosine and outvoted:
                    rejected.append(reject(inputs, c, self.name, f"its direction disagrees with the skill's consensus "
                                                                 f"of reputable keys (cosine {cos:.3f} < "
                                                                 f"{inputs.spec.screen.min_cosine:g})"))
                else:
                    out.append(c)
        return Verdict(tuple(sorted(out, key=lambda c: c.manifest.blob)), tuple(rejected))
