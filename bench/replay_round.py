"""Replay a finished demo run's last round through the coordinator's round strategy with another screening policy,
and judge the merge it makes by the demo's own measure: retention on the re-measure's held-out tasks.

Every delta the round received (included or rejected) is screened again on the round's parent, with the round's
eval seed, by the network's usefulness test and merge (lambda search and guard) under `--screen-eval-n` and
`--confidence`, or merged without any screening (`--accept-all`); `--leave-out SKILL` drops a skill's delta first;
`--new-rules` screens with a new network's saturation and credit rules (`--no-credit`: without credit), `--density`
merges at another density; `--repair-layers N` judges and merges a saturated skill's deltas as repairs of the first
N layers; `--version V` replays the round that made vV instead of the last.
The merged model is evaluated on the first `--n` held-out tasks per skill, and retention = (merged - base) /
(specialist - base) uses the base and last-round specialist the demo re-measured on those same tasks (report.json).
With the run's own settings it reproduces the run's final checkpoint, so a coordinator-side change can be judged on
saved runs without training anything.

    .venv/bin/python bench/replay_round.py --run runs/demo1 --run runs/demo2 --screen-eval-n 1000 --json
    .venv/bin/python bench/replay_round.py --run runs/demo1 --accept-all
    .venv/bin/python bench/replay_round.py --run runs/demo1 --new-rules --density 0.5
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

@dataclass(frozen=True)
class Published:
    """What the round's steps read of a delta's manifest (the checkpoint manifest lists these for every delta)."""

    blob: str
    skill: str
    author: str


def replay(run: Path, eval_n: int | None, confidence: float | None, accept_all: bool, n: int | None,
           leave_out: frozenset[str] = frozenset(), new_rules: bool = False,
           density: float | None = None, no_credit: bool = False, version: int | None = None,
           repair_layers: int | None = None) -> dict[str, Any]:
    """The round of `run` that made `version` (default: the last) screened and merged again; per skill the merged
    accuracy on the first `n` held-out tasks (default: as many as the demo re-measured) and its retention (against
    the last round's specialist, so meaningful for the last round only)."""
    import msgspec

    from skillswarm.node.rl.engines.hf import HFEngine
    from skillswarm.node.rl.evaluation import evaluate
    from skillswarm.node.roles.rounds.state import Candidate, RoundInputs
    from skillswarm.node.roles.rounds.strategy import RoundStrategy, Weigh
    from skillswarm.node.roles.rounds.usefulness import Usefulness
    from skillswarm.protocol.netspec import load_spec
    from skillswarm.protocol.records import CheckpointManifest, ScreenPolicy
    from skillswarm.protocol.transport.blobs import BlobStore

    from remerge import delta_file, demo_run

    report, cks = demo_run(run)
    last, n = version or report["final_version"], n or report["retention_n"]
    if not 1 <= last <= report["final_version"]:
        raise SystemExit(f"--version {last}: {run} merged v1 to v{report['final_version']}")
    spec = load_spec(run / "network.toml")
    if unknown := sorted(leave_out - set(spec.skills)):
        raise SystemExit(f"--leave-out {', '.join(unknown)}: not a skill of {run}'s network ({', '.join(spec.skills)})")
    screen = msgspec.structs.replace(spec.screen, **{k: v for k, v in (("eval_n", eval_n), ("confidence", confidence))
                                                     if v is not None})
    if new_rules:  # what a network written today screens with: saturation and credit on
        fresh = ScreenPolicy.for_new_network()
        screen = msgspec.structs.replace(screen, saturated_at=fresh.saturated_at, on_credit=fresh.on_credit,
                                         repair_layers=fresh.repair_layers)
    if repair_layers is not None:  # a saturated skill's deltas judged and merged as repairs of their first layers
        screen = msgspec.structs.replace(screen, repair_layers=repair_layers)
    if no_credit:  # an inconclusive delta is rejected whatever its key's record
        screen = msgspec.structs.replace(screen, on_credit=msgspec.UNSET)
    spec = msgspec.structs.replace(spec, screen=screen, merge=msgspec.structs.replace(
        spec.merge, **({} if density is None else {"density": density})))
    history = [msgspec.msgpack.decode((cks / f"v{v}" / "manifest.msgpack").read_bytes(), type=CheckpointManifest)
               for v in range(last + 1)]
    final = history.pop()
    candidates = []
    for d in [*final.included, *final.rejected]:
        if d.skill in leave_out:
            continue
        candidates.append(Candidate(manifest=Published(d.blob, d.skill, d.author),  # type: ignore[arg-type]
                                    path=delta_file(run, d.blob, last)))
    parent = cks / f"v{last - 1}"
    with tempfile.TemporaryDirectory(prefix="replay-") as tmp:
        inputs = RoundInputs(spec=spec, parent=history[-1], base_dir=parent, blobs=BlobStore(Path(tmp) / "blobs"),
                             history=history, eval_seed=final.eval_seed or 0)
        # unscreened: no steps, no lambda search, no guard; else the network's usefulness test, weights, search, guard
        strategy = RoundStrategy(steps=[], guard=None, search=None) if accept_all else \
            RoundStrategy(steps=[Usefulness(), Weigh()])
        t0 = time.monotonic()
        _, state = strategy.merge_guarded(inputs, strategy.screen(inputs, candidates), Path(tmp) / "merged",
                                          Path(tmp) / "delta.safetensors")
        kept = state.candidates
        seconds = time.monotonic() - t0
        engine = HFEngine.load(Path(tmp) / "merged" if kept else parent)
        skills = {}
        for skill, row in report["skills"].items():
            measured = row["remeasured"]  # base and specialist on the same first tasks
            if measured is None or measured["n"] != n:
                raise SystemExit(f"{run}: the demo re-measured {skill} on {measured and measured['n']} tasks; give --n with that")
            merged = evaluate(engine, skill, n=n).accuracy
            gain = measured["specialist"] - measured["base"]
            skills[skill] = {"merged": merged, "retention": (merged - measured["base"]) / gain if gain > 0 else None}
    return {"run": str(run), "version": last, "kept": sorted(c.skill for c in kept),
            "lambda": state.merge_policy.scale if kept and state.merge_policy else None, "seconds": round(seconds, 1),
            "skills": skills, "min_retention": min((s["retention"] for s in skills.values() if s["retention"] is not None),
                                                   default=None)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", type=Path, action="append", required=True, help="a demo's --out (repeatable)")
    parser.add_argument("--screen-eval-n", type=int, default=None, help="the usefulness test's tasks (default: the run's)")
    parser.add_argument("--confidence", type=float, default=None, help="the network's confidence (default: the run's)")
    parser.add_argument("--accept-all", action="store_true", help="merge every delta of the round, unscreened")
    parser.add_argument("--new-rules", action="store_true",
                        help="screen with a new network's saturation and credit rules (a run's file may predate them)")
    parser.add_argument("--density", type=float, default=None, help="the merge's density (default: the run's)")
    parser.add_argument("--no-credit", action="store_true", help="screen without the credit rule")
    parser.add_argument("--repair-layers", type=int, default=None,
                        help="judge and merge a saturated skill's deltas as repairs of their first N layers")
    parser.add_argument("--leave-out", action="append", default=[], help="a skill whose delta is not replayed (repeatable)")
    parser.add_argument("--version", type=int, default=None,
                        help="replay the round that made this version (default: the last; retention is then against "
                             "the last round's specialist all the same)")
    parser.add_argument("--n", type=int, default=None, help="held-out tasks per skill (default: the run's re-measure)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    import torch

    sys.path.insert(0, str(Path(__file__).parent))  # remerge.py: how a demo run is read
    torch.set_num_threads(1)
    logging.basicConfig(level=logging.WARNING)
    rows = []
    for run in args.run:
        rows.append(replay(run, args.screen_eval_n, args.confidence, args.accept_all, args.n, frozenset(args.leave_out),
                           args.new_rules, args.density, args.no_credit, args.version, args.repair_layers))
        print(f"{run.name} done", file=sys.stderr)
    passed = sum(1 for r in rows if r["min_retention"] is not None and r["min_retention"] >= 0.9)
    out = {"screen_eval_n": args.screen_eval_n, "confidence": args.confidence, "accept_all": args.accept_all,
           "new_rules": args.new_rules, "no_credit": args.no_credit, "density": args.density,
           "repair_layers": args.repair_layers,
           "leave_out": sorted(args.leave_out),
           "rows": rows, "runs_keeping_90pct_of_every_gain": passed}
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    from rich.console import Console
    from rich.table import Table

    skills = sorted({s for r in rows for s in r["skills"]})
    table = Table(title=f"last round replayed: retention per skill ({passed} of {len(rows)} runs keep >= 90% of every gain)")
    for col in ("run", "merged", *skills, "seconds"):
        table.add_column(col)
    for r in rows:
        table.add_row(Path(r["run"]).name, ", ".join(r["kept"]) or "(none)",
                      *(f"{r['skills'][s]['retention']:.0%}" if r["skills"][s]["retention"] is not None else "-"
                        for s in skills), f"{r['seconds']:.0f}")
    Console().print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
