"""Did training help? Paired greedy evaluation of models on the same held-out tasks of one skill.

Each model plays the first `--n` held-out tasks (greedy, as `skillswarm eval`). Against the first model
(the baseline) each other model gets its accuracy, its gain, its wins (tasks it solves and the baseline
does not) and losses, and a one-sided exact sign test on them (`p_better`): the same test the
coordinator's screening uses. Pairing removes the tasks both solve or both miss, so a few points of gain
on 1000 tasks is told apart from noise where two unpaired accuracies cannot. Each model's outcomes are
printed too: env_error episodes (a sandbox that could not start) count as unsolved.

    .venv/bin/python bench/paired_eval.py --skill code --n 1000 BASE_DIR TRAINED_DIR [...] [--json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("models", nargs="+", type=Path, help="model directories; the first is the baseline")
    parser.add_argument("--skill", required=True, help="skill to evaluate")
    parser.add_argument("--n", type=int, default=1000, help="held-out tasks (the first N of the fixed split)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()
    if len(args.models) < 2:
        parser.error("give a baseline model and at least one model to compare with it")

    from rich.console import Console
    from rich.table import Table

    from skillswarm.node.rl.evaluation import evaluate
    from skillswarm.node.roles.rounds.paired import sign_test_p
    from skillswarm.protocol.errors import SkillswarmError

    solved: dict[Path, list[bool]] = {}
    outcomes: dict[Path, dict[str, int]] = {}
    try:
        for path in args.models:
            result = evaluate(path, args.skill, args.n)
            solved[path] = [bool(r.episode.correct) for r in result.rollouts]
            outcomes[path] = {k: v for k, v in result.outcomes.items() if v}
    except SkillswarmError as e:
        sys.exit(f"error: {e}")
    base = solved[args.models[0]]
    rows = []
    for path in args.models:
        mine = solved[path]
        wins = sum(a and not b for a, b in zip(mine, base))
        losses = sum(b and not a for a, b in zip(mine, base))
        rows.append({"model": str(path), "accuracy": sum(mine) / len(mine), "gain_points": 100 * (sum(mine) - sum(base)) / len(base),
                     "wins": wins, "losses": losses, "p_better": sign_test_p(wins, losses),
                     "outcomes": outcomes[path]})
    if args.json:
        print(json.dumps({"skill": args.skill, "n": len(base), "baseline": str(args.models[0]), "models": rows}))
        return
    table = Table(title=f"{args.skill}: paired greedy evaluation on {len(base)} held-out tasks")
    for col in ("model", "accuracy", "gain", "wins", "losses", "p (better)", "outcomes"):
        table.add_column(col, justify="left" if col == "model" else "right")
    for i, r in enumerate(rows):
        cells = ["baseline", "", "", ""] if i == 0 else [f"{r['gain_points']:+.1f}", str(r["wins"]), str(r["losses"]), f"{r['p_better']:.2g}"]
        table.add_row(r["model"], f"{100 * r['accuracy']:.1f}%", *cells,
                      ", ".join(f"{k} {v}" for k, v in r["outcomes"].items()))
    Console().print(table)


if __name__ == "__main__":
    main()
