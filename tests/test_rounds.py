"""The coordinator's round steps, each on its own: manifest admission, caps, file inspection, consensus,
reputation and the sign test; real delta files and real signed records, no network."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from skillswarm.merge.deltas import encode_delta
from skillswarm.node.rounds import Candidate, RoundContext, RoundStrategy
from skillswarm.node.rounds.admission import Admission, Caps
from skillswarm.node.rounds.inspection import Consensus, Inspect
from skillswarm.node.rounds.reputation import Reputation, reputations
from skillswarm.node.rounds.strategy import Weigh
from skillswarm.node.rounds.paired import Paired, pocock_level, sign_test_p
from skillswarm.node.rounds.usefulness import _creditable, _undecided
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


def _ctx(base: Path, tmp: Path, spec: NetworkSpec, history=(), online=None) -> RoundContext:
    parent = _parent(base)
    return RoundContext(spec=spec, parent=parent, base_dir=base, blobs=BlobStore(tmp / "blobs"),
                        history=[*history, parent], online=online)


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
    from skillswarm.node.rounds.usefulness import Usefulness

    ctx = _ctx(base, tmp_path, _spec(base))
    shown, diluting, alone = (_delta(tmp_path, name, base, _values(seed), Identity.generate(), skill=skill)
                              for name, seed, skill in [("shown", 1, "sort"), ("dilute", 2, "sort"), ("alone", 3, "arith")])
    for c in (diluting, alone):
        c.figures["on_credit"] = 1.0
    assert Usefulness()._credit_only_where_nothing_was_shown(ctx, [shown, diluting, alone]) == [shown, alone]
    [(cand, r)] = ctx.rejected
    assert cand is diluting and "another delta of sort showed a gain" in r.reason and r.figures["harmful"] == 0.0


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
    ctx = _ctx(base, tmp_path, spec, history=history[:0], online={honest.public_key_hex, stranger.public_key_hex,
                                                                   bad.public_key_hex})
    ctx.history = [*history, ctx.parent]
    good = _delta(tmp_path, "good", base, _values(1), honest)
    cases = {
        "not one of the network's": _delta(tmp_path, "skill", base, _values(2), honest, skill="chess"),
        "not on the round's": _delta(tmp_path, "version", base, _values(3), honest, base_version=4),
        "not on the network's allowlist": _delta(tmp_path, "stranger", base, _values(4), stranger),
        "not online": _delta(tmp_path, "offline", base, _values(5), offline),
        "below the network's floor": _delta(tmp_path, "bad", base, _values(6), bad),
        "no encoding of this model": _delta(tmp_path, "size", base, _values(7), honest, size=10**9),
    }
    out = Admission()(ctx, [good, *cases.values()])
    assert out == [good]
    reasons = {c.manifest.blob: r.reason for c, r in ctx.rejected}
    for why, cand in cases.items():
        assert why in reasons[cand.manifest.blob], (why, reasons[cand.manifest.blob])
    assert all(r.step == "admission" for _, r in ctx.rejected)


def test_admission_bounds_a_claimed_norm_by_the_skills_history(base: Path, tmp_path: Path) -> None:
    spec, key = _spec(base), Identity.generate()
    history = [_parent(base, 0, included=[DeltaRef(blob=f"{i:064x}", author="c" * 64, skill="sort", norm=0.1)
                                          for i in range(3)])]
    ctx = _ctx(base, tmp_path, spec, history=history)
    fine = _delta(tmp_path, "fine", base, _values(1, 0.01), key)  # norm ~0.18: 1.8x the history median
    huge = _delta(tmp_path, "huge", base, _values(2, 1.0), key)  # ~18x > the 5x limit
    tiny = _delta(tmp_path, "tiny", base, _values(3, 1e-5), key)  # < 0.02x the median
    assert Admission()(ctx, [fine, huge, tiny]) == [fine]
    reasons = {c.manifest.blob: r.reason for c, r in ctx.rejected}
    assert "median 0.1 of its skill's history (limit 5x)" in reasons[huge.manifest.blob]
    assert "(floor 0.02x)" in reasons[tiny.manifest.blob]


def test_caps_keep_a_keys_first_deltas_and_the_best_reputed_and_count_the_rest(base: Path, tmp_path: Path) -> None:
    flooder, good = Identity.generate(), Identity.generate()
    spec = _spec(base, trust=TrustPolicy(max_deltas_per_author=2, max_deltas_per_round=3))
    ctx = _ctx(base, tmp_path, spec, history=[_parent(base, 0, included=[DeltaRef(blob="f" * 64,
                                                                                  author=good.public_key_hex,
                                                                                  skill="sort")])])
    flood = [_delta(tmp_path, f"f{i}", base, _values(10 + i), flooder, created=float(i)) for i in range(6)]
    mine = [_delta(tmp_path, f"g{i}", base, _values(20 + i), good, created=100.0 + i) for i in range(2)]
    kept = Caps()(ctx, flood + mine)
    assert {c.manifest.blob for c in kept} == {mine[0].manifest.blob, mine[1].manifest.blob, flood[0].manifest.blob}
    assert ctx.omitted == 5 and not ctx.rejected


def test_inspect_rejects_a_lying_claim_a_wrong_codec_and_an_outsized_norm(base: Path, tmp_path: Path) -> None:
    spec, key = _spec(base), Identity.generate()
    honest = [_delta(tmp_path, f"h{i}", base, _values(i), key) for i in range(3)]
    history = [_parent(base, 0, included=[DeltaRef(blob=f"{i:064x}", author="c" * 64, skill="sort",
                                                   norm=honest[i].manifest.norm) for i in range(3)])]
    ctx = _ctx(base, tmp_path, spec, history=history)
    liar = _delta(tmp_path, "liar", base, _values(7), key, norm=0.001)
    scaled = _delta(tmp_path, "x100", base, {k: v * 100 for k, v in _values(8).items()}, key)
    wrong = encode_delta(_values(9), tmp_path / "bf16.safetensors", "dense_bf16", base_hash=weights_hash(base))
    codec = Candidate(key.sign_record(DeltaManifest(network=NET, skill="sort", base_version=0,
                                                    base_hash=weights_hash(base), blob=wrong.sha256, size=wrong.size,
                                                    codec="dense_bf16", norm=wrong.norm, num_tensors=3)), path=wrong.path)
    out = Inspect()(ctx, [*honest, liar, scaled, codec])
    assert sorted(c.manifest.blob for c in out) == sorted(c.manifest.blob for c in honest)
    reasons = {c.manifest.blob: r.reason for c, r in ctx.rejected}
    assert "claims norm 0.001" in reasons[liar.manifest.blob]
    assert "the network's codec is dense_fp32" in reasons[codec.manifest.blob]
    assert "median" in reasons[scaled.manifest.blob] and "limit 5x" in reasons[scaled.manifest.blob]
    assert all(c.norm and c.figures["norm"] == c.norm for c in out)

    # No history yet: this round's own deltas are no reference (an x100 delta would make the honest one look
    # tiny, two tiny sybils would make it look huge), so both pass on to the usefulness test.
    young = _ctx(base, tmp_path, spec)
    tiny = [_delta(tmp_path, f"t{i}", base, _values(20 + i, 1e-6), Identity.generate()) for i in range(2)]
    assert len(Inspect()(young, [honest[0], scaled, *tiny])) == 4 and not young.rejected


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

    ctx = _ctx(base, tmp_path, spec, history=[_parent(base, 0, included=record)])
    good = [_delta(tmp_path, f"h{i}", base, noisy(10 + i), h) for i, h in enumerate(honest)]
    flipper = _delta(tmp_path, "flip", base, flipped, sybils[0])
    out = Consensus()(ctx, [*good, flipper])
    assert sorted(c.manifest.blob for c in out) == sorted(c.manifest.blob for c in good)
    assert ctx.rejected[0][1].step == "consensus" and ctx.rejected[0][1].figures["cosine"] < -0.5

    ctx = _ctx(base, tmp_path, spec, history=[_parent(base, 0, included=record[:1])])
    lone = _delta(tmp_path, "lone", base, noisy(12), honest[0])
    pair = [_delta(tmp_path, f"s{i}", base, flipped, s) for i, s in enumerate(sybils)]
    out = Consensus()(ctx, [lone, *pair])
    assert lone in out and not any(p in out for p in pair)  # the sybils face the reputable key's direction

    # One key with a record turned hostile cannot vote out an honest key of equal standing: a disagreement between
    # two equal says is the usefulness test's to judge.
    ctx = _ctx(base, tmp_path, spec, history=[_parent(base, 0, included=record)])
    turned = _delta(tmp_path, "turned", base, flipped, honest[1])
    assert len(Consensus()(ctx, [lone, turned])) == 2 and not ctx.rejected


def test_weights_follow_reputation_and_a_strategy_runs_its_steps_in_order(base: Path, tmp_path: Path) -> None:
    proven, fresh = Identity.generate(), Identity.generate()
    spec = _spec(base)
    ctx = _ctx(base, tmp_path, spec, history=[_parent(base, 0, included=[
        DeltaRef(blob="e" * 64, author=proven.public_key_hex, skill="sort")])])
    cands = [_delta(tmp_path, "p", base, _values(1), proven), _delta(tmp_path, "f", base, _values(2), fresh)]
    order: list[str] = []

    class Spy:
        def __init__(self, name: str) -> None:
            self.name = name

        def __call__(self, ctx: RoundContext, candidates: list[Candidate]) -> list[Candidate]:
            order.append(self.name)
            return candidates

    strategy = RoundStrategy(steps=[Spy("one"), Inspect(), Spy("two"), Weigh()])
    out = strategy.screen(ctx, cands)
    assert order == ["one", "two"] and set(ctx.seconds) == {"one", "inspect", "two", "weigh"}
    weights = {c.author: c.weight for c in out}
    assert weights == {proven.public_key_hex: round(2 / 3, 6), fresh.public_key_hex: 0.5}  # as the manifest holds it
    groups = strategy.groups(out)
    assert list(groups) == ["sort"] and sorted(w for _, w in groups["sort"]) == [0.5, round(2 / 3, 6)]


def test_the_guard_finds_the_worst_significant_regression_and_the_delta_that_cost_it_most(base: Path,
                                                                                        tmp_path: Path) -> None:
    from skillswarm.node.rounds.guard import costliest, worst_regression

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
    ctx = _ctx(base, tmp_path, _spec(base))
    merged: list[list[str]] = []

    class Script:  # takes out the first delta twice, then is satisfied
        name = "guard"

        def __call__(self, ctx: RoundContext, accepted: list[Candidate], merged_dir: Path) -> list[Candidate]:
            assert (merged_dir / "model.safetensors").is_file()
            return accepted[1:] if len(merged) < 3 else accepted

    class Recording(RoundStrategy):
        def merge(self, ctx, groups, out_dir, delta_out, **options):
            merged.append([p.name for p, _ in groups["sort"]])
            return super().merge(ctx, groups, out_dir, delta_out, **options)

    result, kept = Recording(steps=[], guard=Script()).merge_guarded(ctx, list(cands), tmp_path / "out",
                                                                       tmp_path / "merged.safetensors")
    assert [sorted(m) for m in merged] == [["0.safetensors", "1.safetensors", "2.safetensors"],
                                           ["1.safetensors", "2.safetensors"], ["2.safetensors"]]
    assert kept == [cands[2]] and result.weights_hash == weights_hash(tmp_path / "out")
    assert (tmp_path / "merged.safetensors").is_file()
    # a guard that takes out every delta leaves no merge behind
    out = RoundStrategy(steps=[], guard=lambda ctx, acc, d: []).merge_guarded(ctx, cands[:1], tmp_path / "o2",
                                                                              tmp_path / "m2.safetensors")
    assert out == (None, []) and not (tmp_path / "o2").exists() and not (tmp_path / "m2.safetensors").exists()


def test_the_lambda_search_keeps_an_alternative_only_on_significant_evidence() -> None:
    from skillswarm.node.rounds.scale_search import choose

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
