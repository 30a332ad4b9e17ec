"""The dilution rule of the usefulness test: a delta that passed against the parent by chance (or barely), whose gain
is under half the best of its skill's and which loses to that delta task by task, is left out of the skill's average;
a weaker delta that is not significantly worse, and deltas of other skills, stay."""

from __future__ import annotations

from pathlib import Path

from skillswarm.node.roles.rounds import Candidate, RoundInputs
from skillswarm.node.roles.rounds.paired import Scores
from skillswarm.node.roles.rounds.usefulness import no_dilution
from skillswarm.protocol.identity import Identity
from skillswarm.protocol.records import CheckpointManifest, DeltaManifest, FileEntry, NetworkSpec
from skillswarm.protocol.transport.blobs import BlobStore

HASH = "ab" * 32


def _inputs(tmp_path: Path) -> RoundInputs:
    spec = NetworkSpec(network="dilute", base_model="nano", base_hash=HASH, skills=["reverse", "sort"])
    parent = CheckpointManifest(network="dilute", version=0, weights_hash=HASH,
                                files=[FileEntry(path="config.json", sha256="1" * 64, size=2)])
    return RoundInputs(spec=spec, parent=parent, base_dir=tmp_path, blobs=BlobStore(tmp_path / "blobs"),
                       history=[parent], eval_seed=7)


def _cand(skill: str, blob: str, gain: float) -> Candidate:
    m = Identity.generate().sign_record(DeltaManifest(network="dilute", skill=skill, base_version=0, base_hash=HASH,
                                                      blob=blob * 64, size=10, codec="dense_fp32", norm=1.0,
                                                      num_tensors=1))
    return Candidate(m, figures={"gain": gain})


def _scores(correct: list[bool]) -> Scores:
    return [(1.0 if ok else 0.0, ok) for ok in correct]


def test_a_delta_that_would_dilute_its_skill_is_left_out_and_a_comparable_one_stays(tmp_path: Path) -> None:
    inputs = _inputs(tmp_path)
    best, chance, close, other = (_cand("reverse", "1", 0.30), _cand("reverse", "2", 0.02),
                                  _cand("reverse", "3", 0.25), _cand("sort", "4", 0.01))
    n = 300
    own = {
        best.key: _scores([i < 150 for i in range(n)]),  # 50% of the tasks
        chance.key: _scores([i < 30 or 150 <= i < 160 for i in range(n)]),  # 13%: loses 120 of best's tasks, wins 10
        close.key: _scores([i < 140 or 150 <= i < 155 for i in range(n)]),  # 48%: loses 10, wins 5 (not significant)
        other.key: _scores([i < 3 for i in range(n)]),  # the only sort delta: its skill's best
    }
    kept, rejected = no_dilution(inputs, "usefulness", [best, chance, close, other], own, alpha=0.1)
    assert kept == [best, close, other]
    [(cand, r)] = rejected
    assert cand is chance and r.step == "usefulness" and "dilute" in r.reason and r.figures["harmful"] == 0.0
    assert r.figures["p_diluted"] < 1e-20


def test_a_weak_delta_that_is_not_significantly_worse_or_on_credit_stays(tmp_path: Path) -> None:
    inputs = _inputs(tmp_path)
    best, weak, credit = _cand("reverse", "1", 0.10), _cand("reverse", "2", 0.02), _cand("reverse", "3", 0.0)
    credit = credit.with_figures(on_credit=1.0)
    n = 40
    own = {best.key: _scores([i < 6 for i in range(n)]), weak.key: _scores([i < 4 for i in range(n)]),
           credit.key: _scores([False] * n)}
    assert no_dilution(inputs, "usefulness", [best, weak, credit], own, alpha=0.1) == ([best, weak, credit], [])
