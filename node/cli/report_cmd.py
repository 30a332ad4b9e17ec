"""`skillswarm report RUN_DIR`: PNG plots of a training run (reward, accuracy, staleness, outcomes)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from skillswarm.node.cli.common import JsonOpt, console, print_json, table


def report_cmd(
    run_dir: Annotated[Path, typer.Argument(help="A `skillswarm train --out` directory.")],
    out: Annotated[Optional[Path], typer.Option(help="Where to write the PNGs (default: RUN_DIR/plots).")] = None,
    json_out: JsonOpt = False,
) -> None:
    """Plot a training run's metrics: reward, held-out accuracy, staleness and outcome counts."""
    from skillswarm.node.rl.report import summarize_run, write_report

    paths = write_report(run_dir, out)
    data = summarize_run(run_dir)
    evals = data["evals"]
    summary = {"run_dir": str(run_dir), "plots": [str(p) for p in paths], "steps": len(data["steps"]),
               "accuracy": [[e["step"], e["accuracy"]] for e in evals], "staleness": data["staleness"],
               "outcomes": data["outcomes"], "groups": data["groups"]}
    if json_out:
        print_json(summary)
        return
    rows = [[e["step"], f"{e['accuracy']:.1%}", f"{e['mean_reward']:.3f}"] for e in evals]
    if rows:
        console.print(table("held-out evals", ["step", "accuracy", "mean reward"], rows))
    console.print(table("groups", ["kind", "count"], [[k, v] for k, v in data["groups"].items()]))
    for p in paths:
        console.print(f"wrote {p}", highlight=False)
