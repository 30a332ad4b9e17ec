"""A saturated skill's delta as a repair of the model's first layers (`ScreenPolicy.repair_layers`), on the real nano
model with a really trained delta: the usefulness test judges only those layers, the merge changes only them, and the
manifest's `layers` figure lets anyone recompute the merge bit for bit."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from skillswarm.merge import merge_checkpoint
from skillswarm.merge.deltas import DeltaInfo, encode_delta, read_delta
from skillswarm.merge.recipe_params import in_first_layers
from skillswarm.node.rounds import RoundStrategy
from skillswarm.node.rounds.context import clean_figures, first_layers
from skillswarm.node.rounds.usefulness import Usefulness
from skillswarm.protocol.errors import MergeError, RecordError
from skillswarm.protocol.hashing import weights_hash
from skillswarm.protocol.records import LAYERS_FIGURE, DeltaRef, MergePolicy, ScreenPolicy
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
    accepted = strategy.screen(ctx, [cand])
    # the measurement is that of the first layer's delta, judged by a network without saturation
    plain = _ctx(nano_model, tmp_path, _spec(nano_model, screen=screen))
    ref = _candidate(first.path, "reverse", base_hash)
    Usefulness()(plain, [ref])
    got, want = ctx.measured[cand.manifest.blob], plain.measured[ref.manifest.blob]
    assert {s: (p.wins, p.losses) for s, p in got.items()} == {s: (p.wins, p.losses) for s, p in want.items()}
    own = got["reverse"]
    assert own.wins > own.losses, "the first layer of a reverse delta trained 60 steps should help reverse"
    assert accepted == [cand], [r.reason for _, r in ctx.rejected]
    assert cand.figures[LAYERS_FIGURE] == 1.0 and next(iter(clean_figures(cand.figures))) == LAYERS_FIGURE

    result, kept = strategy.merge_guarded(ctx, accepted, tmp_path / "merged", tmp_path / "merged.safetensors")
    assert kept == [cand]
    merged, parent = _load(tmp_path / "merged"), _load(nano_model)
    for k in parent:  # task arithmetic at lambda 1: the first layer gets the delta, the rest stays the parent's
        if in_first_layers(k, 1):
            assert torch.allclose(merged[k], parent[k] + values[k], atol=1e-6), k
        else:
            assert torch.equal(merged[k], parent[k]), k
    # what a manifest records recomputes the merge: the `layers` figure, kept first among more than 8 figures, and
    # a repair merged on credit keeps saying so (reputation reads it)
    figures = clean_figures({**{f"f{i}": float(i) for i in range(12)}, **cand.figures, "on_credit": 1.0})
    assert list(figures)[:2] == [LAYERS_FIGURE, "on_credit"] and len(figures) == 8
    ref_ = DeltaRef(blob=cand.manifest.blob, author=cand.author, skill="reverse", figures=figures)
    assert first_layers([(ref_.skill, ref_.figures)]) == {"reverse": 1}
    again = merge_checkpoint(nano_model, {"reverse": [(wrecked.path, 1.0)]}, spec.merge, tmp_path / "again",
                             seed=0, progress=False, first_layers=first_layers([(ref_.skill, ref_.figures)]))
    assert again.weights_hash == result.weights_hash


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
    assert Usefulness()(ctx, [cand]) == []
    [(_, r)] = ctx.rejected
    assert "judged as a repair" in r.reason and "not improve reverse" in r.reason, r.reason
    assert not ctx.reserve
    assert msgspec.structs.replace(screen, repair_layers=msgspec.UNSET).repair_layers is msgspec.UNSET


def test_a_manifests_layers_figure_must_be_a_layer_count_the_same_for_a_skills_deltas() -> None:
    # a hostile or broken manifest gets a clear error at --verify, not a traceback or a silent other merge
    assert first_layers([("reverse", {LAYERS_FIGURE: 2.0}), ("reverse", {LAYERS_FIGURE: 2.0}), ("sort", {})]) \
        == {"reverse": 2}
    for bad in (0.0, 1.5, -1.0, float("nan"), 1e6):
        with pytest.raises(RecordError, match="not a layer count"):
            first_layers([("reverse", {LAYERS_FIGURE: bad})])
    with pytest.raises(RecordError, match="disagree"):
        first_layers([("reverse", {LAYERS_FIGURE: 1.0}), ("reverse", {})])

