"""Who gets a round's slots when more deltas arrive than a round considers (`Caps`, `slot_order`): keys with a record
first, then the others in an order drawn on the round's seed (never the `created` time an author writes into its own
manifest), and keys whose deltas never arrived last. Real signed manifests and delta files, real steps, no network."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from skillswarm.merge.deltas import encode_delta
from skillswarm.node.roles.rounds import Candidate, RoundInputs, RoundState
from skillswarm.node.roles.rounds.admission import Caps
from skillswarm.node.roles.rounds.fetching import Fetch
from skillswarm.node.roles.rounds.reputation import Reputation, reputations
from skillswarm.protocol.errors import BlobError
from skillswarm.protocol.hashing import weights_hash
from skillswarm.protocol.identity import Identity
from skillswarm.protocol.records import (CheckpointManifest, DeltaManifest, DeltaRef, FileEntry, NetworkSpec,
                                         Rejection, ScreenPolicy, TrustPolicy)
from skillswarm.protocol.transport.blobs import BlobStore
from tests.tiny import SHAPES, write_base

NET = "slots"
SLOTS = 8
SYBILS = 32


@pytest.fixture
def base(tmp_path: Path) -> Path:
    return write_base(tmp_path)


def _spec(base: Path, slots: int = SLOTS) -> NetworkSpec:
    return NetworkSpec(network=NET, base_model=str(base), base_hash=weights_hash(base), skills=["arith", "sort"],
                       codec="dense_fp32", screen=ScreenPolicy(eval_n=0),
                       trust=TrustPolicy(max_deltas_per_author=1, max_deltas_per_round=slots))


def _checkpoint(base: Path, version: int, included=(), rejected=()) -> CheckpointManifest:
    parent = {} if version == 0 else {"parent_version": version - 1, "parent_hash": "0" * 64}
    return CheckpointManifest(network=NET, version=version, weights_hash=weights_hash(base),
                              files=[FileEntry(path="config.json", sha256="1" * 64, size=2)], included=list(included),
                              rejected=list(rejected), **parent)


def _caps(inputs: RoundInputs, candidates: list[Candidate]) -> tuple[Candidate, ...]:
    """What the caps step lets through of `candidates`."""
    return Caps()(inputs, RoundState(candidates)).passed


def _ctx(base: Path, tmp: Path, spec: NetworkSpec, seed: int, history=(), dht=None) -> RoundInputs:
    parent = _checkpoint(base, len(history))
    return RoundInputs(spec=spec, parent=parent, base_dir=base, blobs=BlobStore(tmp / "blobs"),
                        history=[*history, parent], eval_seed=seed, dht=dht)


def _signed(tmp: Path, base: Path, seed: int, author: Identity, created: float, version: int = 0) -> Candidate:
    """A real delta file and its manifest, signed by `author` with the `created` time it chose."""
    g = torch.Generator().manual_seed(seed)
    info = encode_delta({k: torch.randn(s, generator=g) * 0.01 for k, s in SHAPES.items()},
                        tmp / f"d{seed}.safetensors", "dense_fp32", base_hash=weights_hash(base), skill="sort")
    manifest = DeltaManifest(network=NET, skill="sort", base_version=version, base_hash=weights_hash(base),
                             blob=info.sha256, size=info.size, codec="dense_fp32", norm=info.norm,
                             num_tensors=info.num_tensors)
    return Candidate(author.sign_record(manifest, created=created), path=info.path)


def _resigned(c: Candidate, key: Identity, created: float) -> Candidate:
    """The same delta, its manifest signed again with another `created` time."""
    return Candidate(key.sign_record(c.manifest, created=created), path=c.path)


@pytest.fixture
def flood(base: Path, tmp_path: Path) -> tuple[list[Identity], Identity, list[Candidate], Candidate]:
    """32 fresh sybil keys whose manifests claim `created = 0`, and one honest fresh key with a normal time."""
    sybils = [Identity.generate() for _ in range(SYBILS)]
    honest = Identity.generate()
    deltas = [_signed(tmp_path, base, i, k, created=0.0) for i, k in enumerate(sybils)]
    return sybils, honest, deltas, _signed(tmp_path, base, 100, honest, created=time.time())


def test_a_created_time_buys_no_slot_the_round_draws_the_order_of_fresh_keys(base: Path, tmp_path: Path,
                                                                             flood) -> None:
    sybils, honest, deltas, mine = flood
    assert all(d.manifest.created == 0.0 for d in deltas) and mine.manifest.created > 1e9
    spec = _spec(base)
    late = [_resigned(d, k, created=4e9) for d, k in zip(deltas, sybils)]  # the same deltas, claiming another time
    mine_early = _resigned(mine, honest, created=0.0)
    got = 0
    rounds = 300
    for seed in range(rounds):
        ctx = _ctx(base, tmp_path, spec, seed)
        verdict = Caps()(ctx, RoundState([*deltas, mine]))
        kept = verdict.passed
        assert len(kept) == SLOTS and verdict.omitted == SYBILS + 1 - SLOTS
        # what the sybils (or the honest key) write into `created` moves no key: the same keys take the slots
        if seed < 40:
            for variant in ([*late, mine], [*deltas, mine_early], [*late, mine_early]):
                again = _caps(_ctx(base, tmp_path, spec, seed), variant)
                assert {c.author for c in again} == {c.author for c in kept}, seed
        got += honest.public_key_hex in {c.author for c in kept}
    # the honest fresh key is one of 33 equal keys: about 8/33 of rounds give it a slot (the sybils' created=0 took
    # every slot of every round before)
    assert 0.12 * rounds < got < 0.40 * rounds, got


def test_a_key_with_a_record_always_gets_a_slot_and_equal_records_draw(base: Path, tmp_path: Path, flood) -> None:
    """A key with a record takes a slot before every fresh key, whatever they claim; two keys with equal records
    share the first slot by the round's draw, not by who claims the earlier `created`."""
    sybils, honest, deltas, mine = flood
    rival = Identity.generate()
    theirs = _signed(tmp_path, base, 101, rival, created=0.0)
    history = [_checkpoint(base, 0, included=[DeltaRef(blob=f"{i:064x}", author=k.public_key_hex, skill="sort")
                                              for i, k in enumerate([honest, rival])])]
    first = {honest.public_key_hex: 0, rival.public_key_hex: 0}
    for slots in (1, 2, SLOTS):
        for seed in range(40):
            ctx = _ctx(base, tmp_path, _spec(base, slots), seed, history=history)
            kept = {c.author for c in _caps(ctx, [*deltas, mine, theirs])}
            if slots == 1:
                first[kept.pop()] += 1
                again = _caps(_ctx(base, tmp_path, _spec(base, slots), seed, history=history),
                              [*deltas, mine, _resigned(theirs, rival, created=4e9)])
                assert {c.author for c in again} == {c.author for c in _caps(ctx, [*deltas, mine, theirs])}
            else:
                assert {honest.public_key_hex, rival.public_key_hex} <= kept, (slots, seed)
    assert min(first.values()) >= 8, first  # each of the two takes the single slot in about half the rounds


def test_a_key_whose_blob_never_arrived_takes_the_slots_last(base: Path, tmp_path: Path, flood) -> None:
    """Round 1: the 32 sybils take the slots and never serve their blobs (the fetch step's no-shows, in the
    manifest). Round 2: the same keys again, with fresh keys beside them: every fresh key gets a slot before any of
    them, though their manifests claim created = 0, and their score is untouched (a no-show is not harmful)."""
    sybils, honest, deltas, mine = flood
    spec = _spec(base, slots=SYBILS)

    class NoProvider:  # a DHT on which no one serves the sybils' blobs
        def __init__(self) -> None:
            self.asked: list[list[tuple]] = []

        def fetch_many(self, items, **_):
            self.asked.append(list(items))
            return {sha: BlobError(f"blob {sha[:12]}: no provider answered") for sha, *_ in self.asked[-1]}

    dht = NoProvider()
    first = _ctx(base, tmp_path, spec, 1, dht=dht)
    announced = [Candidate(d.manifest) for d in deltas]  # as the coordinator collects them: no file yet
    fetched = Fetch()(first, RoundState(_caps(first, announced)))
    assert fetched.passed == ()
    assert len(dht.asked[0]) == SYBILS
    rejected = [r.rejection for r in fetched.rejected]
    assert len(rejected) == SYBILS and all(r.step == "fetch" and r.figures["harmful"] == 0.0 for r in rejected)
    history = [_checkpoint(base, 0, rejected=rejected)]

    newcomers = [Identity.generate() for _ in range(4)]
    fresh = [_signed(tmp_path, base, 200 + i, k, created=time.time()) for i, k in enumerate(newcomers)] + [mine]
    expected = {k.public_key_hex for k in [*newcomers, honest]}
    for seed in range(30):
        ctx = _ctx(base, tmp_path, _spec(base, slots=len(fresh)), seed, history=history)
        kept = _caps(ctx, [*deltas, *fresh])
        assert {c.author for c in kept} == expected, seed
        more = _caps(_ctx(base, tmp_path, _spec(base, slots=len(fresh) + 3), seed, history=history), [*deltas, *fresh])
        assert expected < {c.author for c in more}  # the slots the others leave still go to them

    from skillswarm.node.roles.rounds.admission import slot_order
    from skillswarm.node.roles.rounds.reputation import TIER_ABSENT, is_no_show

    assert all(is_no_show(r) for r in rejected)
    table = reputations(history, 20)
    assert {table[k.public_key_hex] for k in sybils} == {Reputation(0, 0, 1)}
    assert Reputation(0, 0, 1).score == 0.5 and Reputation(0, 0, 1).slot_tier == TIER_ABSENT
    order = slot_order(ctx, [*deltas, *fresh], reputations(ctx.history, 20))
    assert {c.author for c in order[len(fresh):]} == {k.public_key_hex for k in sybils}


def test_no_shows_never_lower_a_score_and_a_record_absorbs_a_blip(base: Path) -> None:
    from skillswarm.node.roles.rounds.reputation import TIER_ABSENT, TIER_OTHER, TIER_PROVEN, is_no_show

    a, b = "a" * 64, "b" * 64
    gone = lambda who, i: Rejection(blob=f"{i:064x}", author=who, skill="sort", reason="blob unavailable",  # noqa: E731
                                    step="fetch", figures={"harmful": 0.0, "no_show": 1.0})
    older = Rejection(blob="7" * 64, author=b, skill="sort", reason="blob unavailable", step="fetch",
                      figures={"harmful": 0.0})  # a manifest written before the `no_show` figure
    weak = Rejection(blob="8" * 64, author=b, skill="sort", reason="no significant gain", step="usefulness",
                     figures={"harmful": 0.0})
    assert is_no_show(older) and not is_no_show(weak)
    history = [_checkpoint(base, 0, included=[DeltaRef(blob="9" * 64, author=a, skill="sort")], rejected=[gone(a, 1)]),
               _checkpoint(base, 1, rejected=[gone(b, 2), older, weak])]
    table = reputations(history, 20)
    assert table[a] == Reputation(1, 0, 1) and table[a].slot_tier == TIER_PROVEN  # one no-show per inclusion
    assert table[b] == Reputation(0, 0, 2) and table[b].score == 0.5 and table[b].slot_tier == TIER_ABSENT
    history.append(_checkpoint(base, 2, rejected=[gone(a, 3)]))
    assert reputations(history, 20)[a].slot_tier == TIER_ABSENT  # two no-shows, one inclusion
    assert Reputation().slot_tier == TIER_OTHER and Reputation(0, 1).slot_tier == TIER_OTHER


def test_a_blob_two_manifests_name_is_fetched_once(base: Path, tmp_path: Path) -> None:
    """A copy re-signed by another key names the same blob: one download; a copy whose manifest lies about the size
    cannot fail the original's fetch (the hash decides what arrives), and it is rejected for its lie."""
    honest, copier, liar = Identity.generate(), Identity.generate(), Identity.generate()
    original = _signed(tmp_path, base, 1, honest, created=time.time())
    store = BlobStore(tmp_path / "blobs")
    stored = store.path(store.add_file(original.path))

    class Serving:
        def __init__(self) -> None:
            self.asked: list[tuple] = []

        def fetch_many(self, items, **_):
            self.asked += list(items)
            return {sha: stored if sha == original.manifest.blob else BlobError("missing") for sha, *_ in items}

    import msgspec

    dht = Serving()
    ctx = _ctx(base, tmp_path, _spec(base), 1, dht=dht)
    copy = Candidate(copier.sign_record(original.manifest))
    lying = Candidate(liar.sign_record(msgspec.structs.replace(original.manifest, size=original.manifest.size + 7)))
    verdict = Fetch()(ctx, RoundState([Candidate(original.manifest), copy, lying]))
    out = verdict.passed
    assert len(dht.asked) == 1 and dht.asked[0][0] == original.manifest.blob and dht.asked[0][1] is None
    assert [c.author for c in out] == [honest.public_key_hex, copier.public_key_hex]
    assert all(c.path == stored for c in out) and copy.path is None  # the fetched file is in what the step returns
    [(c, r)] = verdict.rejected
    assert c is lying and r.step == "fetch" and r.figures["harmful"] == 1.0 and "no_show" not in r.figures
