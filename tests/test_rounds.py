"""The coordinator's round steps, each on its own: manifest admission, caps, file inspection, consensus,
reputation and the sign test; real delta files and real signed records, no network."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from skillswarm.merge.deltas import encode_delta
from skillswarm.merge.rounds import round_merge
from skillswarm.node.roles.rounds import Candidate, GuardVerdict, RoundInputs, RoundState, RoundStrategy, Verdict
from skillswarm.node.roles.rounds.admission import Admission, Caps
from skillswarm.node.roles.rounds.inspection import Consensus, Inspect
from skillswarm.node.roles.rounds.reputation import Reputation, reputations
from skillswarm.node.roles.rounds.strategy import Weigh
from skillswarm.node.roles.rounds.paired import Paired, pocock_level, sign_test_p
from skillswarm.node.roles.rounds.state import reject
from skillswarm.node.roles.rounds.usefulness import _creditable, _undecided
from skillswarm.protocol.transport.blobs import BlobStore
from skillswarm.protocol.hashing import weights_hash
from skillswarm.protocol.identity import Identity
from skillswarm.protocol.records import (
    CheckpointManifest, DeltaManifest, DeltaRef, FileEntry, NetworkSpec, Rejection, ScreenPolicy, TrustPolicy,
)
from tests.tiny import SHAPES, write_base

NET = "rounds"


@pytest.fixture
def base(tmp_path: Path) -> Path:
    return write_base(tmp_path)


def _spec(base: Path, **changes) -> NetworkSpec:
    return NetworkSpec(network=NET, base_model=str(base), base_hash=weights_hash(base), skills=["arith", "sort"],
                       codec="dense_fp32", screen=ScreenPolicy(eval_n=0), **changes)


def _parent(base: Path, version: int = 0, included=(), rejected=()) -> CheckpointManifest:
    parent = {} if version == 0 else {"parent_version": version - 1, "parent_hash": "0" * 64}
    return CheckpointManifest(network=NET, version=version, weights_hash=weights_hash(base),
                              files=[FileEntry(path="config.json", sha256="1" * 64, size=2)], included=list(included),
                              rejected=list(rejected), **parent)


def _delta(tmp: Path, name: str, base: Path, values: dict[str, torch.Tensor], author: Identity, skill: str = "sort",
           **manifest) -> Candidate:
    info = encode_delta(values, tmp / f"{name}.safetensors", "dense_fp32", base_hash=weights_hash(base), skill=skill)
    fields = dict(network=NET, skill=skill, base_version=0, base_hash=weights_hash(base), blob=info.sha256,
                  size=info.size, codec="dense_fp32", norm=info.norm, num_tensors=info.num_tensors)
    fields.update(manifest)
    return Candidate(author.sign_record(DeltaManifest(**fields)), path=info.path)


def _values(seed: int, scale: float = 0.01) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(s, generator=g) * scale for k, s in SHAPES.items()}


def _inputs(base: Path, tmp: Path, spec: NetworkSpec, history=(), online=None) -> RoundInputs:
    parent = _parent(base)
    return RoundInputs(spec=spec, parent=parent, base_dir=base, blobs=BlobStore(tmp / "blobs"),
                       history=[*history, parent], online=online)


def _blobs(cands) -> list[str]:
    return [c.manifest.blob for c in cands]


def _reasons(verdict: Verdict) -> dict[str, str]:
    """blob -> why the step rejected it."""
    return {r.candidate.manifest.blob: r.rejection.reason for r in verdict.rejected}


def test_sign_test_and_paired_comparison_match_hand_computed_values() -> None:
    assert sign_test_p(0, 0) == 1.0
    assert sign_test_p(3, 0) == 1 / 8  # three wins of three fair flips
    assert math.isclose(sign_test_p(12, 4), sum(math.comb(16, k) for k in range(12, 17)) / 2**16)
    before = [(0.0, False), (1.0, True), (0.5, False), (0.0, False)]
    after = [(1.0, True), (1.0, True), (0.0, False), (1.0, True)]
    p = Paired.compare(before, after)
    assert (p.wins, p.losses, p.n, p.accuracy_before, p.accuracy_after) == (2, 1, 4, 0.25, 0.75)
    assert p.gain == 0.5 and p.p_better == 0.5 and p.p_worse == 0.875


def test_two_looks_test_at_pococks_nominal_level_and_pool_their_tasks() -> None:
    from statistics import NormalDist

    # Pocock's boundaries for two looks (Jennison & Turnbull, table 2.1): c = 2.178 at two-sided 0.05, 1.875 at 0.10
    assert math.isclose(pocock_level(0.025), 1 - NormalDist().cdf(2.178), rel_tol=0.01)
    assert math.isclose(pocock_level(0.05), 1 - NormalDist().cdf(1.875), rel_tol=0.01)
    assert 0.06 < pocock_level(0.1) < 0.065 and pocock_level(0.1, looks=1) == 0.1
    first, second = Paired(20, 10, 100, 0.40, 0.50), Paired(30, 10, 200, 0.30, 0.40)
    both = first + second
    assert (both.wins, both.losses, both.n) == (50, 20, 300)
    assert math.isclose(both.accuracy_before, 1 / 3) and math.isclose(both.accuracy_after, 130 / 300)
    level = pocock_level(0.1)
    weak = {"sort": Paired(12, 8, 300, 0.5, 0.513), "arith": Paired(5, 5, 300, 0.4, 0.4)}
    assert _undecided(weak, "sort", level, 0.1, 0.15)  # ahead, not significantly: look again
    assert not _undecided({**weak, "sort": Paired(8, 12, 300, 0.5, 0.487)}, "sort", level, 0.1, 0.15)  # behind: no
    assert not _undecided({**weak, "sort": Paired(40, 10, 300, 0.5, 0.6)}, "sort", level, 0.1, 0.15)  # decided
    harmful = {**weak, "arith": Paired(0, 60, 300, 0.4, 0.2)}
    assert not _undecided(harmful, "sort", level, 0.1, 0.15)  # already costs arith 20 points, significantly
    # on credit: an inconclusive delta that changed some task of its skill and is not significantly worse at it
    assert _creditable(weak["sort"], 0.1, 0.02) and _creditable(Paired(8, 12, 300, 0.5, 0.487), 0.1, 0.02)
    assert not _creditable(Paired(4, 14, 300, 0.5, 0.467), 0.1, 0.02)  # its own skill worse, p = 0.015
    assert not _creditable(Paired(0, 0, 300, 0.5, 0.5), 0.1, 0.0)  # changes nothing: a free ride, floor or not
    # the floor: 2% of 600 tasks is 12; a delta changing 9 cannot gain the 2 points credit pays for (12 can); the
    # reserve's look (floor 0) takes any change
    assert not _creditable(Paired(6, 3, 600, 0.88, 0.885), 0.1, 0.02)
    assert _creditable(Paired(8, 4, 600, 0.88, 0.887), 0.1, 0.02)
    assert _creditable(Paired(6, 3, 600, 0.88, 0.885), 0.1, 0.0)
    assert _creditable(Paired(1, 0, 300, 0.98, 0.983), 0.1, 0.0)


def test_credit_fills_in_only_for_a_skill_where_no_delta_showed_a_gain(base: Path, tmp_path: Path) -> None:
    """Averaged with a delta that showed a gain, one on credit would only dilute it: it is dropped there (not held
    against its key); a skill with no shown gain keeps its delta on credit."""
    from skillswarm.node.roles.rounds.usefulness import _credit_only_where_nothing_was_shown

    inputs = _inputs(base, tmp_path, _spec(base))
    shown, diluting, alone = (_delta(tmp_path, name, base, _values(seed), Identity.generate(), skill=skill)
                              for name, seed, skill in [("shown", 1, "sort"), ("dilute", 2, "sort"), ("alone", 3, "arith")])
    diluting, alone = (c.with_figures(on_credit=1.0) for c in (diluting, alone))
    kept, rejected = _credit_only_where_nothing_was_shown(inputs, "usefulness", [shown, diluting, alone])
    assert kept == [shown, alone]
    [(cand, r)] = rejected
    assert cand is diluting and "another delta of sort showed a gain" in r.reason and r.figures["harmful"] == 0.0
    assert r.step == "usefulness" and r.figures["on_credit"] == 1.0


def test_reputation_counts_inclusions_and_rejections_in_the_window(base: Path) -> None:
    a, b = "a" * 64, "b" * 64
    ref = lambda who, i: DeltaRef(blob=f"{i:064x}", author=who, skill="sort")  # noqa: E731
    rej = lambda who, i: Rejection(blob=f"{i:064x}", author=who, skill="sort", reason="no")  # noqa: E731
    weak = Rejection(blob="9" * 64, author=a, skill="sort", reason="no significant gain", figures={"harmful": 0.0})
    history = [_parent(base, 1, included=[ref(a, 1)], rejected=[rej(b, 2)]),
               _parent(base, 2, included=[ref(a, 3), ref(b, 4)], rejected=[rej(b, 5), weak]),
               _parent(base, 3, rejected=[rej(b, 6)])]
    table = reputations(history, rounds=2)  # versions 2 and 3 only; a harmless rejection does not count
    assert table[a] == Reputation(1, 0) and table[b] == Reputation(1, 2)
    assert table[a].score == 2 / 3 and table[b].score == 2 / 5 and Reputation().score == 0.5
    assert Reputation().say == 0.0 and math.isclose(table[a].say, 1 / 3) and table[b].say == 0.0
    # a delta merged on credit (its gain not significant) earns its key nothing: no record from it alone
    credit = DeltaRef(blob="8" * 64, author="c" * 64, skill="sort", figures={"on_credit": 1.0})
    table = reputations([*history, _parent(base, 4, included=[credit, ref(a, 7)])], rounds=2)
    assert "c" * 64 not in table and table[a] == Reputation(1, 0)


def test_admission_rejects_each_bad_manifest_with_its_reason(base: Path, tmp_path: Path) -> None:
    honest, stranger, offline, bad = (Identity.generate() for _ in range(4))
    spec = _spec(base, trust=TrustPolicy(admission="allowlist", workers=[honest.public_key_hex, offline.public_key_hex,
                                                                         bad.public_key_hex], min_reputation=0.3))
    history = [_parent(base, 0, rejected=[Rejection(blob=f"{i:064x}", author=bad.public_key_hex, skill="sort",
                                                    reason="no") for i in range(3)])]  # bad: 1/5 = 0.2 < 0.3
    inputs = _inputs(base, tmp_path, spec, history=history, online={honest.public_key_hex, stranger.public_key_hex,
                                                                     bad.public_key_hex})
    good = _delta(tmp_path, "good", base, _values(1), honest)
    cases = {
        "not one of the network's": _delta(tmp_path, "skill", base, _values(2), honest, skill="chess"),
        "not on the round's": _delta(tmp_path, "version", base, _values(3), honest, base_version=4),
        "not on the network's allowlist": _delta(tmp_path, "stranger", base, _values(4), stranger),
        "not online": _delta(tmp_path, "offline", base, _values(5), offline),
        "below the network's floor": _delta(tmp_path, "bad", base, _values(6), bad),
        "no encoding of this model": _delta(tmp_path, "size", base, _values(7), honest, size=10**9),
    }
    verdict = Admission()(inputs, RoundState([good, *cases.values()]))
    assert _blobs(verdict.passed) == [good.manifest.blob] and verdict.passed[0].figures == {"reputation": 0.5}
    assert good.figures == {}  # the step's finding is in the candidate it returns; what it was given is unchanged
    reasons = _reasons(verdict)
    for why, cand in cases.items():
        assert why in reasons[cand.manifest.blob], (why, reasons[cand.manifest.blob])
    assert all(r.step == "admission" for _, r in verdict.rejected)


def test_admission_bounds_a_claimed_norm_by_the_skills_history(base: Path, tmp_path: Path) -> None:
    spec, key = _spec(base), Identity.generate()
    history = [_parent(base, 0, included=[DeltaRef(blob=f"{i:064x}", author="c" * 64, skill="sort", norm=0.1)
                                          for i in range(3)])]
    inputs = _inputs(base, tmp_path, spec, history=history)
    fine = _delta(tmp_path, "fine", base, _values(1, 0.01), key)  # norm ~0.18: 1.8x the history median
    huge = _delta(tmp_path, "huge", base, _values(2, 1.0), key)  # ~18x > the 5x limit
    tiny = _delta(tmp_path, "tiny", base, _values(3, 1e-5), key)  # < 0.02x the median
    verdict = Admission()(inputs, RoundState([fine, huge, tiny]))
    assert _blobs(verdict.passed) == [fine.manifest.blob]
    reasons = _reasons(verdict)
    assert "median 0.1 of its skill's history (limit 5x)" in reasons[huge.manifest.blob]
    assert "(floor 0.02x)" in reasons[tiny.manifest.blob]


def test_caps_keep_a_keys_first_deltas_and_the_best_reputed_and_count_the_rest(base: Path, tmp_path: Path) -> None:
    flooder, good = Identity.generate(), Identity.generate()
    spec = _spec(base, trust=TrustPolicy(max_deltas_per_author=2, max_deltas_per_round=3))
    inputs = _inputs(base, tmp_path, spec, history=[_parent(base, 0, included=[DeltaRef(blob="f" * 64,
                                                                                        author=good.public_key_hex,
                                                                                        skill="sort")])])
    flood = [_delta(tmp_path, f"f{i}", base, _values(10 + i), flooder, created=float(i)) for i in range(6)]
    mine = [_delta(tmp_path, f"g{i}", base, _values(20 + i), good, created=100.0 + i) for i in range(2)]
    verdict = Caps()(inputs, RoundState(flood + mine))
    kept = verdict.passed
    assert {c.manifest.blob for c in kept} == {mine[0].manifest.blob, mine[1].manifest.blob, flood[0].manifest.blob}
    assert verdict.omitted == 5 and not verdict.rejected
    # the driver adds what each step omits to the round's count (the flood alone: 4 over its key's 2)
    state = RoundState(flood + mine).after("caps", verdict)
    assert state.omitted == 5 and state.after("caps", Caps()(inputs, RoundState(flood))).omitted == 9


def test_inspect_rejects_a_lying_claim_a_wrong_codec_and_an_outsized_norm(base: Path, tmp_path: Path) -> None:
    spec, key = _spec(base), Identity.generate()
    honest = [_delta(tmp_path, f"h{i}", base, _values(i), key) for i in range(3)]
    history = [_parent(base, 0, included=[DeltaRef(blob=f"{i:064x}", author="c" * 64, skill="sort",
                                                   norm=honest[i].manifest.norm) for i in range(3)])]
    inputs = _inputs(base, tmp_path, spec, history=history)
    liar = _delta(tmp_path, "liar", base, _values(7), key, norm=0.001)
    scaled = _delta(tmp_path, "x100", base, {k: v * 100 for k, v in _values(8).items()}, key)
    wrong = encode_delta(_values(9), tmp_path / "bf16.safetensors", "dense_bf16", base_hash=weights_hash(base))
    codec = Candidate(key.sign_record(DeltaManifest(network=NET, skill="sort", base_version=0,
                                                    base_hash=weights_hash(base), blob=wrong.sha256, size=wrong.size,
                                                    codec="dense_bf16", norm=wrong.norm, num_tensors=3)), path=wrong.path)
    verdict = Inspect()(inputs, RoundState([*honest, liar, scaled, codec]))
    out = verdict.passed
    assert sorted(c.manifest.blob for c in out) == sorted(c.manifest.blob for c in honest)
    reasons = _reasons(verdict)
    assert "claims norm 0.001" in reasons[liar.manifest.blob]
    assert "the network's codec is dense_fp32" in reasons[codec.manifest.blob]
    assert "median" in reasons[scaled.manifest.blob] and "limit 5x" in reasons[scaled.manifest.blob]
    assert all(c.norm and c.figures["norm"] == c.norm for c in out)
    assert all(c.norm is None and not c.figures for c in honest)  # the candidates it was given are unchanged

    # No history yet: this round's own deltas are no reference (an x100 delta would make the honest one look
    # tiny, two tiny sybils would make it look huge), so both pass on to the usefulness test.
    young = _inputs(base, tmp_path, spec)
    tiny = [_delta(tmp_path, f"t{i}", base, _values(20 + i, 1e-6), Identity.generate()) for i in range(2)]
    verdict = Inspect()(young, RoundState([honest[0], scaled, *tiny]))
    assert len(verdict.passed) == 4 and not verdict.rejected


def test_consensus_listens_to_reputable_keys_only(base: Path, tmp_path: Path) -> None:
    """Two reputable honest keys and a fresh sign-flipper: the flipper is out. Two fresh sybils agreeing on a
    flipped delta cannot vote an honest reputable key out, since fresh keys have no say; nor can one reputable key."""
    honest = [Identity.generate() for _ in range(2)]
    sybils = [Identity.generate() for _ in range(2)]
    spec = _spec(base)
    record = [DeltaRef(blob=f"{i:064x}", author=h.public_key_hex, skill="sort") for i, h in enumerate(honest)]
    direction = _values(1)
    noisy = lambda seed: {k: v + 0.3 * w for (k, v), w in zip(direction.items(), _values(seed).values())}  # noqa: E731
    flipped = {k: -v for k, v in direction.items()}

    inputs = _inputs(base, tmp_path, spec, history=[_parent(base, 0, included=record)])
    good = [_delta(tmp_path, f"h{i}", base, noisy(10 + i), h) for i, h in enumerate(honest)]
    flipper = _delta(tmp_path, "flip", base, flipped, sybils[0])
    verdict = Consensus()(inputs, RoundState([*good, flipper]))
    assert sorted(_blobs(verdict.passed)) == sorted(_blobs(good))
    assert all(c.figures["cosine"] > 0.5 for c in verdict.passed)
    assert verdict.rejected[0].rejection.step == "consensus" and verdict.rejected[0].rejection.figures["cosine"] < -0.5

    inputs = _inputs(base, tmp_path, spec, history=[_parent(base, 0, included=record[:1])])
    lone = _delta(tmp_path, "lone", base, noisy(12), honest[0])
    pair = [_delta(tmp_path, f"s{i}", base, flipped, s) for i, s in enumerate(sybils)]
    out = _blobs(Consensus()(inputs, RoundState([lone, *pair])).passed)
    assert out == [lone.manifest.blob]  # the sybils face the reputable key's direction

    # One key with a record turned hostile cannot vote out an honest key of equal standing: a disagreement between
    # two equal says is the usefulness test's to judge.
    inputs = _inputs(base, tmp_path, spec, history=[_parent(base, 0, included=record)])
    turned = _delta(tmp_path, "turned", base, flipped, honest[1])
    verdict = Consensus()(inputs, RoundState([lone, turned]))
    assert len(verdict.passed) == 2 and not verdict.rejected


def test_weights_follow_reputation_and_a_strategy_runs_its_steps_in_order(base: Path, tmp_path: Path) -> None:
    proven, fresh = Identity.generate(), Identity.generate()
    spec = _spec(base)
    inputs = _inputs(base, tmp_path, spec, history=[_parent(base, 0, included=[
        DeltaRef(blob="e" * 64, author=proven.public_key_hex, skill="sort")])])
    cands = [_delta(tmp_path, "p", base, _values(1), proven), _delta(tmp_path, "f", base, _values(2), fresh)]
    seen: list[tuple[str, tuple]] = []

    class Spy:
        """Records what it is given: the state the previous step's verdict made."""

        def __init__(self, name: str) -> None:
            self.name = name

        def __call__(self, inputs: RoundInputs, state: RoundState) -> Verdict:
            seen.append((self.name, tuple(c.norm for c in state.candidates)))
            return Verdict(state.candidates)

    strategy = RoundStrategy(steps=[Spy("one"), Inspect(), Spy("two"), Weigh()])
    state = strategy.screen(inputs, cands)
    # the second spy reads the norms Inspect returned; the first saw none
    assert [name for name, _ in seen] == ["one", "two"] and seen[0][1] == (None, None) and all(seen[1][1])
    assert set(state.seconds) == {"one", "inspect", "two", "weigh"}
    out = state.candidates
    weights = {c.author: c.weight for c in out}
    assert weights == {proven.public_key_hex: round(2 / 3, 6), fresh.public_key_hex: 0.5}  # as the manifest holds it
    merged = [c.to_merge() for c in out]
    assert {d.skill for d in merged} == {"sort"} and sorted(d.weight for d in merged) == [0.5, round(2 / 3, 6)]
    assert [r.weight for r in (c.to_ref() for c in out)] == [c.weight for c in out]


def test_the_guard_finds_the_worst_significant_regression_and_the_delta_that_cost_it_most(base: Path,
                                                                                        tmp_path: Path) -> None:
    from skillswarm.node.roles.rounds.guard import costliest, worst_regression

    level = 0.1 / 2
    merged = {"arith": Paired(10, 30, 300, 0.50, 0.4333),  # 20 more lost than won: p ~ 0.001
              "sort": Paired(5, 12, 300, 0.50, 0.4767),  # behind, not significantly (p ~ 0.07 > 0.05)
              "calc": Paired(40, 5, 300, 0.30, 0.4167)}  # better
    assert worst_regression(merged, level) == ("arith", merged["arith"])
    assert worst_regression({**merged, "arith": Paired(10, 9, 300, 0.5, 0.4967)}, level) is None
    assert worst_regression({**merged, "sort": Paired(0, 40, 300, 0.5, 0.3667)}, level)[0] == "sort"  # the larger drop
    a = Identity.generate()
    own = _delta(tmp_path, "own", base, _values(1), a, skill="arith")
    mild = _delta(tmp_path, "mild", base, _values(2), a, skill="sort")
    costly = _delta(tmp_path, "costly", base, _values(3), a, skill="calc")
    unmeasured = _delta(tmp_path, "unmeasured", base, _values(4), a, skill="sort")
    measured = {own.manifest.blob: {"arith": Paired(30, 0, 300, 0.5, 0.6)},
                mild.manifest.blob: {"arith": Paired(3, 6, 300, 0.5, 0.49)},
                costly.manifest.blob: {"arith": Paired(2, 20, 300, 0.5, 0.44)}}
    assert costliest([own, mild, costly, unmeasured], measured, "arith") is costly
    assert costliest([own, mild, unmeasured], measured, "arith") is mild  # unmeasured counts as no change
    assert costliest([own], measured, "arith") is own  # only the skill's own deltas: the least helpful of them


def test_merge_guarded_merges_again_without_each_delta_the_guard_takes_out(base: Path, tmp_path: Path) -> None:
    a = Identity.generate()
    cands = [_delta(tmp_path, str(i), base, _values(i), a) for i in range(3)]
    inputs = _inputs(base, tmp_path, _spec(base))
    merged: list[list[str]] = []

    class Script:  # takes out the first delta twice (with a rejection), then is satisfied
        name = "guard"

        def __call__(self, inputs: RoundInputs, state: RoundState, merged_dir: Path) -> GuardVerdict:
            assert (merged_dir / "model.safetensors").is_file()
            accepted = state.candidates
            if len(merged) >= 3:
                return GuardVerdict(accepted, seconds=0.5)
            out = reject(inputs, accepted[0], self.name, "taken out")
            return GuardVerdict(accepted[1:], (out,), seconds=0.5)

    class Recording(RoundStrategy):
        def merge(self, inputs, deltas, policy, out_dir, delta_out, **options):
            merged.append([c.path.name for c in deltas])
            return super().merge(inputs, deltas, policy, out_dir, delta_out, **options)

    result, state = Recording(steps=[], guard=Script()).merge_guarded(inputs, RoundState(cands), tmp_path / "out",
                                                                        tmp_path / "merged.safetensors")
    assert [sorted(m) for m in merged] == [["0.safetensors", "1.safetensors", "2.safetensors"],
                                           ["1.safetensors", "2.safetensors"], ["2.safetensors"]]
    assert state.candidates == (cands[2],) and result.weights_hash == weights_hash(tmp_path / "out")
    assert [r.candidate for r in state.rejected] == cands[:2] and state.seconds["guard"] == 1.5
    assert state.merge_policy == inputs.spec.merge  # no search: the network's lambda
    assert (tmp_path / "merged.safetensors").is_file()
    # the merge is the round's recipe: what `round_merge` makes of the kept delta, bit for bit
    again = round_merge(base, [cands[2].to_merge()], inputs.spec.merge, tmp_path / "again", seed=0)
    assert again.weights_hash == result.weights_hash
    # a guard that takes out every delta leaves no merge behind
    out, state = RoundStrategy(steps=[], guard=lambda inputs, state, d: GuardVerdict(())).merge_guarded(
        inputs, RoundState(cands[:1]), tmp_path / "o2", tmp_path / "m2.safetensors")
    assert out is None and state.candidates == ()
    assert not (tmp_path / "o2").exists() and not (tmp_path / "m2.safetensors").exists()


def test_the_lambda_search_keeps_an_alternative_only_on_significant_evidence() -> None:
    from skillswarm.node.roles.rounds.scale_search import choose

    reference = [(0.0, False)] * 100
    slightly = [(1.0, True)] * 6 + [(0.0, False)] * 94  # 6 tasks better, none worse: p = 1/64 > 0.01
    clearly = [(1.0, True)] * 30 + [(0.0, False)] * 70  # 30 better
    more = [(1.0, True)] * 40 + [(0.0, False)] * 60  # 40 better, the highest total
    assert choose(reference, [slightly], alpha=0.01)[0] == 0
    assert choose(reference, [slightly], alpha=0.05)[0] == 1
    best, tests = choose(reference, [slightly, clearly, more], alpha=0.01)
    assert best == 3 and [(t.wins, t.losses) for t in tests] == [(6, 0), (30, 0), (40, 0)]
    worse = [(0.0, False)] * 100
    assert choose(clearly, [reference, worse], alpha=0.5)[0] == 0  # fewer wins than losses is never kept


def test_the_round_state_changes_only_by_the_verdicts_the_driver_folds_in(base: Path, tmp_path: Path) -> None:
    """A step's verdict becomes the next state (rejections appended, the reserve grown, seconds summed); the guard's
    takes a reserve's rejections back and releases it; and nothing a step is handed can be written to."""
    import dataclasses

    from skillswarm.node.roles.rounds import Evidence
    from skillswarm.node.roles.rounds.paired import Paired

    inputs = _inputs(base, tmp_path, _spec(base))
    key = Identity.generate()
    a, b = _delta(tmp_path, "a", base, _values(1), key), _delta(tmp_path, "b", base, _values(2), key, skill="arith")
    start = RoundState([a, b])
    saturated = reject(inputs, b, "usefulness", "the parent already solves arith", {"parent_accuracy": 0.99},
                       harmful=False)
    judged = Paired(3, 1, 8, 0.5, 0.75)
    state = start.after("usefulness", Verdict([a.with_figures(gain=0.1)], [saturated],
                                              evidence=Evidence(parent_scores={"sort": [(1.0, True)]},
                                                                measured={a.manifest.blob: {"sort": judged}},
                                                                reserve={"arith": [b]})), 2.0)
    assert start.candidates == (a, b) and not start.rejected and not start.reserve  # the state it came from stands
    assert [c.key for c in state.candidates] == [a.key] and state.candidates[0].figures == {"gain": 0.1}
    assert state.rejected == (saturated,) and state.reserve == {"arith": (b,)}
    assert state.measured[a.manifest.blob]["sort"] == judged and state.seconds == {"usefulness": 2.0}
    state = state.after("usefulness", Verdict(state.candidates), 0.5)
    assert state.seconds == {"usefulness": 2.5} and state.reserve == {"arith": (b,)}

    # the guard brings the reserve in: its saturation rejection is taken back and the reserve is released
    back = b.but(weight=0.5)
    guarded = state.after_guard(GuardVerdict((*state.candidates, back), restored=(back,), released="arith",
                                             seconds=1.0))
    assert guarded.candidates[-1] is back and guarded.rejected == () and guarded.reserve == {}
    assert guarded.seconds == {"usefulness": 2.5, "guard": 1.0}
    # ... or takes a delta out, which is rejected after what was rejected before
    out = reject(inputs, state.candidates[0], "guard", "the merge with it leaves sort worse")
    guarded = state.after_guard(GuardVerdict((), (out,)))
    assert guarded.candidates == () and guarded.rejected == (saturated, out) and guarded.reserve == {"arith": (b,)}

    for write in (lambda: state.seconds.update(x=1.0), lambda: state.measured.pop(a.manifest.blob),
                  lambda: state.reserve.clear(), lambda: state.candidates[0].figures.update(gain=1.0),
                  lambda: inputs.first_seen.update({("k", "b"): 0.0})):
        with pytest.raises((TypeError, AttributeError)):
            write()
    with pytest.raises(dataclasses.FrozenInstanceError):
        state.omitted = 3  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.weight = 2.0  # type: ignore[misc]
