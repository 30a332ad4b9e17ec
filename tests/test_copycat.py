"""Copies (`inspection.Copycat`, run by `Inspect`): a delta equal or nearly equal to one seen before it, or to one an
earlier checkpoint merged, is rejected at the step `copycat` and counts against its key; only the first seen stays,
whatever `created` the manifests claim. Real delta files of the nano model's shapes (random directions: the cosine
test needs no training), real signed manifests, real steps."""

from __future__ import annotations

import math
import time
from pathlib import Path

import pytest
import torch

from skillswarm.merge.checkpoint import Checkpoint
from skillswarm.merge.deltas import encode_delta
from skillswarm.merge.pipeline import is_float
from skillswarm.node.roles.rounds import Candidate, RoundInputs, RoundState, RoundStrategy, Verdict, default_steps
from skillswarm.node.roles.rounds.inspection import Inspect
from skillswarm.node.roles.rounds.reputation import reputations
from skillswarm.protocol.hashing import weights_hash
from skillswarm.protocol.identity import Identity
from skillswarm.protocol.records import (CheckpointManifest, DeltaManifest, DeltaRef, FileEntry, NetworkSpec,
                                         ScreenPolicy)
from skillswarm.protocol.transport.blobs import BlobStore

NET = "copycat"
SKILLS = ["arith", "calc", "reverse", "sort"]


@pytest.fixture(scope="module")
def shapes(nano_model: Path) -> dict[str, tuple[int, ...]]:
    """The nano model's floating-point tensors: what a delta of it carries."""
    base = Checkpoint(nano_model)
    try:
        return {n: tuple(base.entry(n).shape) for n in base.names() if is_float(base.entry(n).dtype)}
    finally:
        base.close()


def _direction(shapes: dict[str, tuple[int, ...]], seed: int, scale: float = 1e-3) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=g) * scale for n, s in shapes.items()}


def _mix(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], x: float, y: float) -> dict[str, torch.Tensor]:
    return {n: x * a[n] + y * b[n] for n in a}


def _cos(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    dot = sum(float((a[n].double() * b[n].double()).sum()) for n in a)
    return dot / math.sqrt(_cos_sq(a) * _cos_sq(b))


def _cos_sq(a: dict[str, torch.Tensor]) -> float:
    return sum(float((v.double() ** 2).sum()) for v in a.values())


class Net:
    """The network, its parent checkpoint and a maker of signed deltas, around the nano model."""

    def __init__(self, base: Path, tmp: Path, version: int = 0, history: list[CheckpointManifest] = ()) -> None:
        self.base, self.tmp, self.version, self.hash = base, tmp, version, weights_hash(base)
        self.spec = NetworkSpec(network=NET, base_model=str(base), base_hash=self.hash, skills=SKILLS,
                                codec="dense_fp32", screen=ScreenPolicy(eval_n=0))
        self.history = list(history)
        self.blobs = BlobStore(tmp / "blobs")
        self.n = 0

    def parent(self, included=()) -> CheckpointManifest:
        parent = {} if self.version == 0 else {"parent_version": self.version - 1, "parent_hash": "0" * 64}
        return CheckpointManifest(network=NET, version=self.version, weights_hash=self.hash, included=list(included),
                                  files=[FileEntry(path="config.json", sha256="1" * 64, size=2)], **parent)

    def ctx(self, seen: list[tuple[Candidate, float]] = (), seed: int = 7) -> RoundInputs:
        """The round's inputs; `seen`: when the coordinator first saw each candidate (as `Coordinator` fills it)."""
        parent = self.parent()
        return RoundInputs(spec=self.spec, parent=parent, base_dir=self.base, blobs=self.blobs,
                           history=[*self.history, parent], eval_seed=seed,
                           first_seen={(c.author, c.manifest.blob): t for c, t in seen})

    def delta(self, values: dict[str, torch.Tensor], key: Identity, skill: str = "sort",
              created: float | None = None) -> Candidate:
        self.n += 1
        info = encode_delta(values, self.tmp / f"d{self.n}.safetensors", "dense_fp32", base_hash=self.hash, skill=skill)
        return self.sign(info.path, info.sha256, info.size, info.norm, info.num_tensors, key, skill, created)

    def resign(self, c: Candidate, key: Identity, created: float | None = None) -> Candidate:
        """`c`'s file, claimed by `key`."""
        m = c.manifest
        return self.sign(c.path, m.blob, m.size, m.norm, m.num_tensors, key, m.skill, created)

    def sign(self, path, blob, size, norm, n, key, skill, created) -> Candidate:
        manifest = DeltaManifest(network=NET, skill=skill, base_version=self.version, base_hash=self.hash, blob=blob,
                                 size=size, codec="dense_fp32", norm=norm, num_tensors=n)
        return Candidate(key.sign_record(manifest, created=created), path=path)


def _inspect(inputs: RoundInputs, candidates: list[Candidate]) -> Verdict:
    """The file checks' verdict on `candidates`, copies last."""
    return Inspect()(inputs, RoundState(candidates))


def _rejected(verdict: Verdict) -> dict[str, object]:
    """key -> its rejection."""
    return {c.author: r for c, r in verdict.rejected}


def test_a_resigned_and_a_rescaled_copy_seen_later_are_out_and_the_first_seen_stays(nano_model: Path, shapes,
                                                                                    tmp_path: Path) -> None:
    net = Net(nano_model, tmp_path)
    honest, resigner, rescaler, other = (Identity.generate() for _ in range(4))
    work = _direction(shapes, 1)
    original = net.delta(work, honest, created=time.time())
    # the copies claim to be older than the original: `created` is theirs to write, and buys nothing
    resigned = net.resign(original, resigner, created=0.0)
    rescaled = net.delta({n: v * 0.98 for n, v in work.items()}, rescaler, created=0.0)
    independent = net.delta(_direction(shapes, 2), other, skill="calc")
    assert resigned.manifest.blob == original.manifest.blob and rescaled.manifest.blob != original.manifest.blob
    seen = [(original, 1000.0), (independent, 1000.5), (resigned, 1003.0), (rescaled, 1009.0)]
    verdict = _inspect(net.ctx(seen), [rescaled, resigned, independent, original])
    out = verdict.passed
    assert sorted(c.author for c in out) == sorted([honest.public_key_hex, other.public_key_hex])  # two works pass
    got = _rejected(verdict)
    assert set(got) == {resigner.public_key_hex, rescaler.public_key_hex}
    for key in (resigner, rescaler):
        r = got[key.public_key_hex]
        assert r.step == "copycat" and r.figures["harmful"] == 1.0 and r.figures["copy_cosine"] > 0.999, r
        assert original.manifest.blob[:12] in r.reason and honest.public_key_hex[:12] in r.reason
    # the copiers' rejections count against them: fresh keys fall below a fresh key's score
    table = reputations([CheckpointManifest(network=NET, version=1, parent_version=0, parent_hash="0" * 64,
                                            weights_hash=net.hash, files=net.parent().files,
                                            included=[DeltaRef(blob=c.manifest.blob, author=c.author, skill=c.skill)
                                                      for c in out],
                                            rejected=[r for _, r in verdict.rejected])], 20)
    assert table[honest.public_key_hex].score > 0.5 > table[resigner.public_key_hex].score

    # who was first is what this coordinator saw, not `created`: had the rescaled delta been seen first, it would stay
    verdict = _inspect(net.ctx([*seen[:3], (rescaled, 999.0)]), [rescaled, resigned, independent, original])
    assert sorted(c.author for c in verdict.passed) == sorted([rescaler.public_key_hex, other.public_key_hex])
    assert {r.step for r in _rejected(verdict).values()} == {"copycat"}


def test_a_copy_of_a_delta_an_earlier_checkpoint_merged_is_out(nano_model: Path, shapes, tmp_path: Path) -> None:
    net = Net(nano_model, tmp_path, version=0)
    worker, resigner, rescaler, fresh = (Identity.generate() for _ in range(4))
    merged = net.delta(_direction(shapes, 3), worker, skill="arith")
    net.blobs.add_file(merged.path)  # the coordinator holds the deltas it merged (KEEP_DELTA_ROUNDS)
    ref = DeltaRef(blob=merged.manifest.blob, author=worker.public_key_hex, skill="arith")
    net.history = [net.parent(included=[ref])]
    net.version = 1
    resigned = net.resign(merged, resigner)
    rescaled = net.delta({n: v * 0.98 for n, v in _direction(shapes, 3).items()}, rescaler, skill="sort")
    new = net.delta(_direction(shapes, 4), fresh, skill="arith")
    verdict = _inspect(net.ctx(), [resigned, rescaled, new])
    assert [c.author for c in verdict.passed] == [new.author]
    got = _rejected(verdict)
    for key in (resigner, rescaler):  # claimed for another skill, too: copies are looked for across skills
        r = got[key.public_key_hex]
        assert r.step == "copycat" and r.figures["harmful"] == 1.0 and "merged in v0" in r.reason, r

    # a merged delta no longer held here: its blob still gives a re-signed copy away
    net.blobs.remove(merged.manifest.blob)
    verdict = _inspect(net.ctx(), [net.resign(merged, resigner), new])
    assert [c.author for c in verdict.passed] == [new.author]
    assert [r.step for _, r in verdict.rejected] == ["copycat"]


def test_colluders_near_copies_count_as_one(nano_model: Path, shapes, tmp_path: Path) -> None:
    """Three keys publish one update, each a little changed (cosine about 0.99 with each other): the first seen
    stays, the other two are out, whatever skills they claim."""
    net = Net(nano_model, tmp_path)
    keys = [Identity.generate() for _ in range(3)]
    update = _direction(shapes, 5)
    near = [_mix(update, _direction(shapes, 10 + i), scale, 0.1) for i, scale in enumerate((1.0, 0.97, 1.04))]
    assert all(0.98 < _cos(near[0], x) < 0.999 for x in near[1:])
    colluders = [net.delta(v, k, skill=s, created=0.0) for v, k, s in zip(near, keys, ("sort", "sort", "reverse"))]
    # two honest workers of one skill share much of their direction (two seeds of the demo's sort round: 0.69), and
    # are no copies of each other
    common = _direction(shapes, 6)
    pair = [_mix(common, _direction(shapes, 30 + i), 1.0, 0.65) for i in range(2)]
    assert 0.65 < _cos(*pair) < 0.75
    honest = [net.delta(v, Identity.generate()) for v in pair]
    seen = [(colluders[1], 5.0), (honest[0], 5.5), (colluders[0], 6.0), (colluders[2], 7.0), (honest[1], 8.0)]
    verdict = _inspect(net.ctx(seen), [*colluders, *honest])
    assert sorted(c.author for c in verdict.passed) == sorted([keys[1].public_key_hex, *(h.author for h in honest)])
    got = _rejected(verdict)
    assert set(got) == {keys[0].public_key_hex, keys[2].public_key_hex}
    assert all(r.step == "copycat" and r.figures["harmful"] == 1.0 for r in got.values())

    # seen in the same poll, which is the copy is a draw on the round's seed: one stays, and no key is blamed
    winners = set()
    for seed in range(12):
        verdict = _inspect(net.ctx([(c, 5.0) for c in colluders], seed=seed), list(colluders))
        assert len(verdict.passed) == 1 and len(verdict.rejected) == 2
        assert all(r.step == "copycat" and r.figures["harmful"] == 0.0 for _, r in verdict.rejected)
        winners.add(verdict.passed[0].author)
    assert len(winners) > 1
    # ... unless one key has a record: the better reputation goes first
    record = CheckpointManifest(network=NET, version=0, weights_hash=net.hash, files=net.parent().files,
                                included=[DeltaRef(blob="e" * 64, author=keys[2].public_key_hex, skill="calc")])
    net.history = [record]
    for seed in range(4):
        assert [c.author for c in _inspect(net.ctx(seed=seed), list(colluders)).passed] == [keys[2].public_key_hex]


def test_the_default_round_rejects_copies_at_the_step_copycat(nano_model: Path, shapes, tmp_path: Path) -> None:
    """Through the network's default steps, as the coordinator runs them (files already here, no usefulness test):
    the honest delta and an independent one are accepted, each copy is out at `copycat`."""
    net = Net(nano_model, tmp_path)
    honest, other = Identity.generate(), Identity.generate()
    sybils = [Identity.generate() for _ in range(3)]
    work = _direction(shapes, 7)
    original = net.delta(work, honest)
    independent = net.delta(_direction(shapes, 8), other, skill="arith")
    copies = [net.resign(original, sybils[0], created=0.0),
              net.delta({n: v * 0.98 for n, v in work.items()}, sybils[1], created=0.0),
              net.delta(_mix(work, _direction(shapes, 9), 1.0, 0.05), sybils[2], skill="calc", created=0.0)]
    seen = [(original, 10.0), (independent, 11.0), *((c, 12.0 + i) for i, c in enumerate(copies))]
    when = {c.author: t for c, t in seen}
    state = RoundStrategy().screen(net.ctx(seen), [*copies, independent, original])
    assert sorted(c.author for c in state.candidates) == sorted([honest.public_key_hex, other.public_key_hex])
    rejected = sorted(state.rejected, key=lambda cr: when[cr[0].author])
    assert [(r.author, r.step, r.figures["harmful"]) for _, r in rejected] == [(k.public_key_hex, "copycat", 1.0)
                                                                               for k in sybils]
    assert [s.name for s in default_steps()][:4] == ["admission", "caps", "fetch", "inspect"]


def test_dot_products_do_not_depend_on_the_chunking(nano_model: Path, shapes, tmp_path: Path) -> None:
    from skillswarm.node.roles.rounds.inspection import delta_dots

    net = Net(nano_model, tmp_path)
    values = [_direction(shapes, 20 + i) for i in range(3)]
    paths = [net.delta(v, Identity.generate()).path for v in values]
    dots, squares = delta_dots(nano_model, paths, 2)
    small, squares2 = delta_dots(nano_model, paths, 2, budget=1)
    assert len(dots) == 2 and len(dots[0]) == 3
    for i in range(2):
        for j in range(3):
            assert math.isclose(dots[i][j], small[i][j], rel_tol=1e-9, abs_tol=1e-12)
            assert math.isclose(dots[i][j] / math.sqrt(squares[i] * squares[j]), _cos(values[i], values[j]),
                                rel_tol=1e-6, abs_tol=1e-6)
    assert all(math.isclose(a, b, rel_tol=1e-9) for a, b in zip(squares, squares2))
