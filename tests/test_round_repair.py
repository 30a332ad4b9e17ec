"""A saturated skill's delta as a repair of the model's first layers (`ScreenPolicy.repair_layers`), on the real nano
model with a really trained delta: the usefulness test judges only those layers, the merge changes only them, and the
manifest's `layers` field (in a manifest of protocol 1, its `layers` figure) lets anyone recompute the merge bit for
bit."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest
import torch
from safetensors.torch import load_file

from skillswarm.merge import merge_checkpoint
from skillswarm.merge.deltas import DeltaInfo, encode_delta, read_delta
from skillswarm.merge.recipe_params import in_first_layers
from skillswarm.merge.rounds import RoundDelta, first_layers, included_deltas, round_merge
from skillswarm.node.roles.rounds import RoundState, RoundStrategy
from skillswarm.node.roles.rounds.state import clean_figures
from skillswarm.node.roles.rounds.usefulness import Usefulness
from skillswarm.protocol.codec import decode_record, encode_record
from skillswarm.protocol.errors import MergeError, RecordError
from skillswarm.protocol.hashing import weights_hash
from skillswarm.protocol.records import (LEGACY_LAYERS_FIGURE, CheckpointManifest, DeltaRef, FileEntry, MergePolicy,
                                         ScreenPolicy, delta_layers)
from tests.sft import sft_delta
from tests.test_round_usefulness import _candidate, _ctx, _spec

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def deltas(nano_model: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[DeltaInfo, DeltaInfo]:
    """A reverse delta (60 supervised steps) and a random one of the same size for sort (the merge's arithmetic
    needs no training), both changing every layer."""
    torch.set_num_threads(1)
    d = tmp_path_factory.mktemp("repair")
    rev = sft_delta(nano_model, "reverse", d / "reverse.safetensors", steps=60, lr=3e-4)
    g = torch.Generator().manual_seed(1)
    values = {k: torch.randn(v.shape, generator=g) * 1e-3 for k, v in read_delta(rev.path).items()}
    return rev, encode_delta(values, d / "sort.safetensors", "dense_fp32")


def _load(model_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(model_dir / "model.safetensors"))


def test_a_skills_deltas_merged_in_their_first_layers_change_only_those(nano_model: Path, deltas, tmp_path: Path) -> None:
    # TIES: outside reverse's first layer the merge is exactly sort's alone (reverse's rows neither vote nor dilute);
    # inside it, exactly the merge of both.
    rev, srt = deltas
    policy = MergePolicy(method="ties", density=0.5, scale=1.0)
    both = {"reverse": [(rev.path, 1.0)], "sort": [(srt.path, 1.0)]}
    merge_checkpoint(nano_model, both, policy, tmp_path / "both", seed=3, progress=False)
    merge_checkpoint(nano_model, {"sort": [(srt.path, 1.0)]}, policy, tmp_path / "sort", seed=3, progress=False)
    merge_checkpoint(nano_model, both, policy, tmp_path / "repair", seed=3, progress=False, first_layers={"reverse": 1})
    full, alone, repair = (_load(tmp_path / d) for d in ("both", "sort", "repair"))
    inside = [k for k in repair if in_first_layers(k, 1)]
    assert inside and len(inside) < len(repair)
    for k in repair:
        assert torch.equal(repair[k], full[k] if in_first_layers(k, 1) else alone[k]), k
    assert any(not torch.equal(full[k], alone[k]) for k in inside)  # reverse's delta did change its first layer
    with pytest.raises(MergeError, match="at least one layer"):
        merge_checkpoint(nano_model, both, policy, tmp_path / "bad", first_layers={"reverse": 0}, progress=False)


def test_a_saturated_skills_delta_is_judged_and_merged_as_a_repair_of_its_first_layers(nano_model: Path, deltas,
                                                                                       tmp_path: Path) -> None:
    # reverse counts as saturated (saturated_at 1%). Its delta's layers past the first are replaced by noise that
    # would wreck the model: judged as a repair they are set aside, so the test measures exactly what a delta of the
    # first layer alone does, and the merge holds that first layer only.
    import msgspec

    torch.set_num_threads(1)
    rev, _ = deltas
    base_hash = weights_hash(nano_model)
    g = torch.Generator().manual_seed(0)
    values = {k: (v if in_first_layers(k, 1) else 50 * torch.randn(v.shape, generator=g)) for k, v in read_delta(rev.path).items()}
    wrecked = encode_delta(values, tmp_path / "wrecked.safetensors", "dense_fp32")
    first = encode_delta({k: v for k, v in values.items() if in_first_layers(k, 1)}, tmp_path / "first.safetensors", "dense_fp32")
    screen = ScreenPolicy(eval_n=128, confidence=0.5, max_other_drop=0.5)
    spec = _spec(nano_model, screen=msgspec.structs.replace(screen, saturated_at=0.01, repair_layers=1),
                 merge=MergePolicy(method="task_arithmetic", scale=1.0))

    ctx = _ctx(nano_model, tmp_path, spec)
    cand = _candidate(wrecked.path, "reverse", base_hash)
    strategy = RoundStrategy(steps=[Usefulness()], search=None)
    state = strategy.screen(ctx, [cand])
    # the measurement is that of the first layer's delta, judged by a network without saturation
    plain = _ctx(nano_model, tmp_path, _spec(nano_model, screen=screen))
    ref = _candidate(first.path, "reverse", base_hash)
    want = Usefulness()(plain, RoundState([ref])).evidence.measured[ref.manifest.blob]
    got = state.measured[cand.manifest.blob]
    assert {s: (p.wins, p.losses) for s, p in got.items()} == {s: (p.wins, p.losses) for s, p in want.items()}
    own = got["reverse"]
    assert own.wins > own.losses, "the first layer of a reverse delta trained 60 steps should help reverse"
    [repair] = state.candidates
    assert repair.key == cand.key, [r.reason for _, r in state.rejected]
    # the merge instruction is the candidate's `layers`, and the manifest entry's field; no figure carries it
    assert repair.layers == 1 and cand.layers is None and LEGACY_LAYERS_FIGURE not in repair.figures
    entry = repair.to_ref()
    assert entry.layers == 1 and LEGACY_LAYERS_FIGURE not in entry.figures and entry.figures == clean_figures(
        repair.figures)

    result, state = strategy.merge_guarded(ctx, state, tmp_path / "merged", tmp_path / "merged.safetensors")
    assert state.candidates == (repair,)
    merged, parent = _load(tmp_path / "merged"), _load(nano_model)
    for k in parent:  # task arithmetic at lambda 1: the first layer gets the delta, the rest stays the parent's
        if in_first_layers(k, 1):
            assert torch.allclose(merged[k], parent[k] + values[k], atol=1e-6), k
        else:
            assert torch.equal(merged[k], parent[k]), k
    # what a manifest records recomputes the merge, however many figures crowd the entry (a repair merged on credit
    # keeps saying so: reputation reads it), through the manifest's bytes
    crowded = repair.with_figures(**{f"f{i}": float(i) for i in range(12)}, on_credit=1.0).to_ref()
    assert len(crowded.figures) == 8 and "on_credit" in crowded.figures and crowded.layers == 1
    manifest = _manifest(nano_model, result.weights_hash, [crowded])
    manifest = decode_record(encode_record(manifest), CheckpointManifest)
    deltas = included_deltas(manifest, lambda r: wrecked.path)
    assert deltas == [RoundDelta(blob=cand.manifest.blob, skill="reverse", path=wrecked.path, weight=1.0, layers=1)]
    again = round_merge(nano_model, deltas, spec.merge, tmp_path / "again", seed=0)
    assert again.weights_hash == result.weights_hash
    # the same merge as a manifest of protocol 1 wrote it (no `layers` field, the figure instead) is recomputed so;
    # read as protocol 2, where the figure means nothing, it names the merge of the whole delta, which is another
    old = _manifest(nano_model, result.weights_hash, [DeltaRef(blob=cand.manifest.blob, author=cand.author,
                                                               skill="reverse", figures={LEGACY_LAYERS_FIGURE: 1.0})],
                    protocol=1)
    old = decode_record(encode_record(old), CheckpointManifest)
    assert old.protocol == 1 and old.included[0].layers is msgspec.UNSET
    deltas = included_deltas(old, lambda r: wrecked.path)
    assert [d.layers for d in deltas] == [1]
    assert round_merge(nano_model, deltas, spec.merge, tmp_path / "old", seed=0).weights_hash == result.weights_hash
    whole = included_deltas(msgspec.structs.replace(old, protocol=2), lambda r: wrecked.path)
    assert [d.layers for d in whole] == [None]
    assert round_merge(nano_model, whole, spec.merge, tmp_path / "whole", seed=0).weights_hash != result.weights_hash


def _manifest(base: Path, weights: str, included: list[DeltaRef], protocol: int | None = None) -> CheckpointManifest:
    """A checkpoint manifest of v1 on `base` that merged `included` (of protocol `protocol`, default this node's)."""
    h = weights_hash(base)
    return CheckpointManifest(network="use", version=1, parent_version=0, parent_hash=h, weights_hash=weights,
                              files=[FileEntry(path="config.json", sha256="1" * 64, size=2)],
                              method="task_arithmetic", aggregator="mean", included=included,
                              **({} if protocol is None else {"protocol": protocol}))


def test_a_repair_that_does_not_help_is_rejected_and_saying_so(nano_model: Path, deltas, tmp_path: Path) -> None:
    # The reverse delta sign-flipped, offered as a repair of reverse, does not improve it: rejected as a repair, with
    # no reserve to fall back on.
    import msgspec

    torch.set_num_threads(1)
    rev, _ = deltas
    flipped = encode_delta({k: -v for k, v in read_delta(rev.path).items()}, tmp_path / "flipped.safetensors", "dense_fp32")
    screen = ScreenPolicy(eval_n=64, confidence=0.9, max_other_drop=0.5, saturated_at=0.01, repair_layers=1)
    ctx = _ctx(nano_model, tmp_path, _spec(nano_model, screen=screen))
    cand = _candidate(flipped.path, "reverse", weights_hash(nano_model))
    verdict = Usefulness()(ctx, RoundState([cand]))
    assert verdict.passed == ()
    [(out, r)] = verdict.rejected
    assert "judged as a repair" in r.reason and "not improve reverse" in r.reason, r.reason
    assert out.layers is None and LEGACY_LAYERS_FIGURE not in r.figures
    assert not verdict.evidence.reserve
    assert msgspec.structs.replace(screen, repair_layers=msgspec.UNSET).repair_layers is msgspec.UNSET


def test_a_manifests_layers_must_be_a_layer_count_the_same_for_a_skills_deltas(tmp_path: Path) -> None:
    # a hostile or broken manifest gets a clear error at --verify, not a traceback or a silent other merge
    def ref(blob: str, **kw) -> DeltaRef:
        return DeltaRef(blob=blob * 64, author="a" * 64, skill="reverse", **kw)

    base = tmp_path / "base"  # never read: the manifests below are only parsed
    old = lambda *refs: CheckpointManifest(  # noqa: E731
        network="use", version=1, parent_version=0, parent_hash="0" * 64, weights_hash="1" * 64, protocol=1,
        files=[FileEntry(path="config.json", sha256="1" * 64, size=2)], included=list(refs))
    assert [delta_layers(old(r), r) for r in (ref("1", figures={LEGACY_LAYERS_FIGURE: 2.0}), ref("2"))] == [2, None]
    for bad in (0.0, 1.5, -1.0, float("nan"), 1e6):
        r = ref("3", figures={LEGACY_LAYERS_FIGURE: bad})
        with pytest.raises(RecordError, match="not a layer count"):
            delta_layers(old(r), r)
        with pytest.raises(RecordError, match="not a layer count"):  # before any file is fetched
            included_deltas(old(r), lambda _: pytest.fail("fetched a delta of a manifest that names no merge"))
    # the field is the word of a manifest of protocol 2 (a figure of that name means nothing there), and its type
    # takes only layer counts
    field = ref("4", layers=3, figures={LEGACY_LAYERS_FIGURE: 1.0})
    assert delta_layers(old(field), field) == 3
    new = msgspec.structs.replace(old(field), protocol=2)
    assert delta_layers(new, ref("5", figures={LEGACY_LAYERS_FIGURE: 1.0})) is None
    for bad in (0, 1025):
        with pytest.raises(RecordError):
            decode_record(encode_record(msgspec.structs.replace(new, included=[ref("6", layers=bad)])),
                          CheckpointManifest)
    # a skill's deltas are merged in the same layers
    same = [RoundDelta("7" * 64, "reverse", base, layers=2), RoundDelta("8" * 64, "reverse", base, layers=2),
            RoundDelta("9" * 64, "sort", base)]
    assert first_layers(same) == {"reverse": 2}
    with pytest.raises(MergeError, match="disagree"):
        first_layers([RoundDelta("7" * 64, "reverse", base, layers=1), RoundDelta("8" * 64, "reverse", base)])
    with pytest.raises(MergeError, match="disagree"):
        round_merge(base, [RoundDelta("7" * 64, "reverse", base, layers=1), RoundDelta("8" * 64, "reverse", base)],
                    MergePolicy(), tmp_path / "out", seed=0)

