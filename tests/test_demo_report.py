"""The demo's report: retention arithmetic, per-method rows, method parsing (the full run is `make demo`)."""

from __future__ import annotations

from pathlib import Path

import pytest

from skillswarm.node.demo import DemoConfig
from skillswarm.node.demo.compare import method_label, parse_method
from skillswarm.node.demo.report import make_report
from skillswarm.node.demo.retention import AT_OR_ABOVE_P, Versus
from skillswarm.node.roles.rounds.paired import sign_test_p
from skillswarm.protocol.errors import SkillswarmError
from skillswarm.protocol.records import CheckpointManifest, DeltaManifest, FileEntry, SkillMetrics, TrainStats

SHA = "ab" * 32


def _delta(skill: str, version: int, before: float, after: float, blob: str) -> DeltaManifest:
    return DeltaManifest(network="demo", skill=skill, base_version=version, base_hash=SHA, blob=blob, size=10,
                         codec="dense_fp32", norm=1.0, num_tensors=3,
                         stats=TrainStats(accuracy_before=before, accuracy_after=after, eval_n=100))


def test_report_computes_retention_per_skill_and_per_method(tmp_path: Path) -> None:
    cfg = DemoConfig(out=tmp_path, skills=["reverse", "sort", "arith"], rounds=2, method="ties", density=0.3, scale=1.0)
    deltas = {
        0: [_delta("reverse", 0, 0.25, 0.9, "01" * 32), _delta("sort", 0, 0.30, 0.6, "02" * 32),
            _delta("arith", 0, 0.20, 0.19, "03" * 32)],
        1: [_delta("reverse", 1, 0.8, 0.95, "04" * 32), _delta("sort", 1, 0.5, 0.70, "05" * 32),
            _delta("arith", 1, 0.18, 0.18, "06" * 32)],
    }
    final = CheckpointManifest(network="demo", version=2, parent_version=1, parent_hash=SHA, weights_hash=SHA,
                               files=[FileEntry(path="model.safetensors", sha256=SHA, size=1)], method="ties",
                               metrics={"reverse": SkillMetrics(accuracy=0.90), "sort": SkillMetrics(accuracy=0.50),
                                        "arith": SkillMetrics(accuracy=0.2)})
    report = make_report(cfg, final, [final], deltas, 12.0,
                         {"task_arithmetic(lambda=1)": {"reverse": 0.60, "sort": 0.70, "arith": 0.1}})
    reverse, sort, arith = (report["skills"][k] for k in ("reverse", "sort", "arith"))
    # base from the first round, specialist from the last round, merged from the final checkpoint
    assert (reverse["base"], reverse["specialist"], reverse["merged"]) == (0.25, 0.95, 0.90)
    assert reverse["retention"] == pytest.approx((0.90 - 0.25) / (0.95 - 0.25), abs=1e-4)
    assert sort["retention"] == pytest.approx((0.50 - 0.30) / (0.70 - 0.30), abs=1e-4)
    assert arith["retention"] is None  # the specialist gained nothing: no retention to speak of
    assert list(report["methods"]) == ["ties(density=0.3, lambda=1)", "task_arithmetic(lambda=1)"]
    other = report["methods"]["task_arithmetic(lambda=1)"]
    assert other["reverse"]["retention"] == pytest.approx((0.60 - 0.25) / 0.70, abs=1e-4)
    assert other["sort"]["retention"] == pytest.approx(1.0)  # merged matches the specialist
    assert report["rounds"] == 2 and report["method"] == "ties"
    # each round's specialist, and the merged accuracy per version (v0: the base the workers measured)
    assert reverse["round_specialists"] == [0.9, 0.95] and reverse["best_round_specialist"] == 0.95
    assert arith["first_round_specialist"] == 0.19 and arith["best_round_specialist"] == 0.19
    v0, v2 = report["per_round"]
    assert v0 == {"version": 0, "accuracy": {"reverse": 0.25, "sort": 0.30, "arith": 0.20}, "included": None,
                  "rejected": None}
    assert v2["version"] == 2 and v2["accuracy"] == {"reverse": 0.90, "sort": 0.50, "arith": 0.2}


def test_method_specs_parse_or_say_how_to_fix(tmp_path: Path) -> None:
    cfg = DemoConfig(out=tmp_path, skills=["arith"], density=0.4, scale=1.0)
    p = parse_method("task_arithmetic@0.6", cfg)
    assert (p.method, p.scale) == ("task_arithmetic", 0.6)
    assert method_label(parse_method("dare_ties", cfg)) == "dare_ties(density=0.4, lambda=1)"
    for bad in ("bogus", "ties@", "ties@x", "ties@0", "ties@101"):
        if bad == "ties@":  # an empty lambda means the default
            assert parse_method(bad, cfg).scale == 1.0
            continue
        with pytest.raises(SkillswarmError, match="METHOD@LAMBDA"):
            parse_method(bad, cfg)


def test_printed_report_shows_each_round_against_the_specialists(tmp_path: Path, capsys) -> None:
    from skillswarm.node.cli.demo_cmd import print_report

    cfg = DemoConfig(out=tmp_path, skills=["sort"], rounds=2)
    deltas = {0: [_delta("sort", 0, 0.30, 0.61, "01" * 32)], 1: [_delta("sort", 1, 0.55, 0.73, "02" * 32)]}
    final = CheckpointManifest(network="demo", version=2, parent_version=1, parent_hash=SHA, weights_hash=SHA,
                               files=[FileEntry(path="model.safetensors", sha256=SHA, size=1)], method="ties",
                               metrics={"sort": SkillMetrics(accuracy=0.69)})
    # v1 lost more tasks to the first-round specialist than it won, significantly; v2 won more
    versus = {"sort": [Versus(1, 0.58, 0.62, 2, 14, sign_test_p(14, 2)), Versus(2, 0.70, 0.62, 30, 6, sign_test_p(6, 30))]}
    report = make_report(cfg, final, [final], deltas, 60.0, versus=versus)
    assert report["skills"]["sort"]["versus_first_specialist"][0] == {
        "version": 1, "merged": 0.58, "specialist": 0.62, "wins": 2, "losses": 14, "p_worse": 0.0021, "at_or_above": False}
    assert report["skills"]["sort"]["versus_first_specialist"][1]["at_or_above"] is True
    print_report(report, tmp_path)
    text = capsys.readouterr().out
    assert "first-round specialist" in text and "61.0%" in text  # round 0's specialist, beside the best (round 1's)
    assert "best single-round specialist" in text and "73.0%" in text and "69.0%" in text
    assert "58.0% -4.0 (2:14, p=0.0021)" in text and "below: sort" in text  # re-measured, task by task
    assert "70.0% +8.0 (30:6)" in text and "every skill" in text
    lost = make_report(cfg, final, [final], deltas, 60.0, versus={"sort": [Versus(1, 0.5, 0.6, 0, 100, sign_test_p(100, 0))]})
    print_report(lost, tmp_path)
    assert "(0:100, p<0.0001)" in capsys.readouterr().out


def test_at_or_above_is_a_one_sided_test_against_the_specialist() -> None:
    assert Versus(3, 0.986, 0.990, 4, 8, sign_test_p(8, 4)).at_or_above  # 4 tasks behind of 1000: not shown worse
    assert not Versus(3, 0.979, 0.991, 0, 12, sign_test_p(12, 0)).at_or_above  # 12 lost, none won
    assert sign_test_p(12, 0) <= AT_OR_ABOVE_P < sign_test_p(8, 4)
