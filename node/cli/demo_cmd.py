"""`skillswarm demo`: the whole swarm on this machine, on the nano model, with a retention table."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.table import Table

from skillswarm.node.cli.common import JsonOpt, console, err_console, print_json, table
from skillswarm.node.cli.options import field_option
from skillswarm.node.demo import DemoConfig
from skillswarm.node.rl.config import default_of
from skillswarm.protocol.records import ScreenPolicy
from skillswarm.skills.nano.recipe import DEFAULT_RECIPE

# The built-in skills of the default nano model (`code` is not among them: a code step takes ~20 s against
# calc's 3 s, and its warm-up doubles the base build; see `base build --with-code`).
DEMO_SKILLS = DEFAULT_RECIPE.skills


def _opt(name: str, *param_decls: str, **kwargs: object) -> object:
    """The option of DemoConfig's field `name` (its default stated there, once)."""
    return field_option(DemoConfig, name, *param_decls, **kwargs)


def demo_cmd(
    out: Annotated[Path, typer.Option(help="Where to write report.json, report.png, the final checkpoint and logs.")] = Path("runs/demo"),
    skill: Annotated[Optional[list[str]], typer.Option(help=f"Skills to train (default: {', '.join(DEMO_SKILLS)}).")] = None,
    rounds: int = _opt("rounds", help="Merge rounds.", min=1),
    minutes_per_round: float = _opt("minutes_per_round", help="At most this many training minutes per worker per round "
                                    "(0: no limit).", min=0),
    steps_per_round: int = _opt("steps_per_round", help="Optimizer steps per worker per round.", min=1),
    lr_decay: float = _opt("lr_decay", help="Workers train on checkpoint vN at their learning rate times LR_DECAY**N (at "
                           "least a quarter of it); 1: a constant rate.", min=0.01, max=1.0),
    method: str = _opt("method", help="Merge method across skills."),
    density: float = _opt("density", help="Fraction of each delta kept by ties/dare/breadcrumbs.", min=0.01, max=1.0),
    lambda_: float = _opt("scale", "--lambda", help="Scale of the merged task vector.", min=0.01, max=100.0),
    lambda_search: Annotated[Optional[list[float]], typer.Option(help="Another lambda the coordinator may merge a round "
                                                                 "at where it scores significantly better; repeatable "
                                                                 f"(default: {', '.join(f'{x:g}' for x in default_of(DemoConfig, 'scale_search'))}; "
                                                                 "--lambda-search 1: only --lambda).",
                                                            min=0.01, max=100.0)] = None,
    compare: Annotated[Optional[list[str]], typer.Option(help="Also re-merge the last round with METHOD or METHOD@LAMBDA and report its "
                                                        f"retention (default: {' and '.join(default_of(DemoConfig, 'compare'))}).")] = None,
    no_compare: Annotated[bool, typer.Option("--no-compare", help="Skip the re-merge comparison.")] = False,
    eval_n: int = _opt("eval_n", help="Held-out episodes per skill for every accuracy figure.", min=1),
    retention_n: int = _opt("retention_n", help="Held-out tasks per skill on which base, specialists and merged model "
                            "are re-measured at the end (a retention with half the sampling error, and its interval), and "
                            "every round's checkpoint is paired with the first-round specialists.", min=1),
    retain: float = _opt("retain", help="Workers keep the other skills where each round started (a KL of this weight "
                         "on the start's episodes of them; 0: off).", min=0.0),
    screen_eval_n: Annotated[int, typer.Option(help="Held-out tasks per skill the coordinator evaluates each delta on "
                                                    "before merging it (the network's usefulness test); 0: off.",
                                               min=0)] = ScreenPolicy().eval_n,
    json: JsonOpt = False,
) -> None:
    """Start a bootstrap peer, a coordinator and one worker per skill on 127.0.0.1, run a few rounds, pull
    the final checkpoint and print each skill's base, specialist and merged accuracy and the retention."""
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    from skillswarm.node.cli.base_cmd import build_with_progress
    from skillswarm.node.demo import run_demo
    from skillswarm.node.demo.compare import parse_method

    skills = skill or list(DEMO_SKILLS)
    cfg = DemoConfig(out=out.resolve(), skills=skills, rounds=rounds, steps_per_round=steps_per_round,
                     lr_decay=lr_decay, minutes_per_round=minutes_per_round or None, method=method, density=density, scale=lambda_,
                     **({'scale_search': lambda_search} if lambda_search else {}),
                     eval_n=eval_n, retention_n=retention_n, retain=retain, screen=ScreenPolicy.for_new_network(eval_n=screen_eval_n))
    if no_compare or compare:
        cfg.compare = [] if no_compare else compare
    for text in [method, *cfg.compare]:
        parse_method(text, cfg)  # a typo fails now, not after the rounds
    if not json:
        budget = f"{steps_per_round} steps" + (f" (at most {minutes_per_round:g} min)" if minutes_per_round else "") + \
            (f", learning rate x{lr_decay:g} a round" if lr_decay < 1 else "")
        console.print(f"skillswarm demo: {len(skills)} workers ({', '.join(skills)}), 1 coordinator, 1 bootstrap peer "
                      f"on 127.0.0.1; {rounds} rounds of {budget}; merge: {method}")
    base = build_with_progress()
    columns = (SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn())
    with Progress(*columns, console=err_console, transient=True) as bar:
        task = bar.add_task("starting the swarm", total=None)

        def show(st) -> None:
            text = {"training": f"round {st.version + 1}/{rounds}: workers training, {st.deltas}/{len(skills)} deltas in",
                    "pulling": "pulling the final checkpoint",
                    "comparing": "re-merging the last round with other methods",
                    "remeasuring": f"re-measuring base, specialists and every round's checkpoint on {retention_n} "
                                   "tasks per skill", "done": "done"}.get(st.phase, st.phase)
            bar.update(task, description=text)

        report = run_demo(cfg, base, on_status=show)
    if json:
        print_json(report)
        return
    print_report(report, out)


def print_report(report: dict, out: Path) -> None:
    """The demo's tables: retention per skill, merged accuracy per round against the specialists, the methods."""
    pct = lambda x: "-" if x is None else f"{100 * x:.1f}%"  # noqa: E731
    rows = [[k, pct(v["base"]), pct(v["specialist"]), pct(v["merged"]), _share(v["retention"]),
             *_remeasured_cells(v)] for k, v in report["skills"].items()]
    level = f"{100 * report['interval_level']:.0f}% interval"
    n2 = report["retention_n"]
    console.print(table(f"retention of each specialist's gain after {report['rounds']} rounds ({report['method_label']}; "
                        f"greedy, n={report['eval_n']} held-out tasks, then all three models re-measured on n={n2}; "
                        f"the interval: paired bootstrap over the tasks)",
                        ["skill", "base", "specialist", "merged", "retention", f"retention (n={n2})", level], rows))
    names = list(report["skills"])
    rows = [[f"v{r['version']}" + (" (base)" if r["version"] == 0 else ""), *(pct(r["accuracy"].get(k)) for k in names),
             "" if r["included"] is None else f"{r['included']} / {r['rejected']}"] for r in report["per_round"]]
    for label, key in (("first-round specialist", "first_round_specialist"),
                       ("best single-round specialist", "best_round_specialist")):
        rows.append([label, *(pct(report["skills"][k][key]) for k in names), ""])
    console.print(table("merged accuracy after each round", ["checkpoint", *names, "deltas merged / rejected"], rows))
    versus = {k: v.get("versus_first_specialist") or [] for k, v in report["skills"].items()}
    if any(versus.values()):
        console.print(versus_table(versus, report["retention_n"], report["at_or_above_p"]))
    if len(report["methods"]) > 1:
        rows = [[label, *(_cell(v[k]) for k in names)] for label, v in report["methods"].items()]
        console.print(table("the last round's deltas merged by each method: merged accuracy (retention)",
                            ["method", *names], rows))
    console.print(f"report: {out / 'report.json'}, plot: {out / 'report.png'}, checkpoint: {out / 'final'} "
                  f"({report['seconds'] / 60:.1f} min)")


def versus_table(versus: dict[str, list[dict]], n: int, level: float) -> Table:
    """Each round's checkpoint against each skill's first-round specialist on `n` tasks (report.json's
    `versus_first_specialist` rows per skill), below where the sign test gives p <= `level`."""
    names = list(versus)
    by_version: dict[int, dict[str, dict]] = {}
    for skill, rows in versus.items():
        for r in rows:
            by_version.setdefault(r["version"], {})[skill] = r
    first = {k: rows[0]["specialist"] for k, rows in versus.items() if rows}
    out = [["specialist", *(f"{100 * first[k]:.1f}%" if k in first else "-" for k in names), ""]]
    for version, row in sorted(by_version.items()):
        below = [k for k in names if k in row and not row[k]["at_or_above"]]
        out.append([f"v{version}", *(_versus_cell(row.get(k)) for k in names),
                    "every skill" if not below and len(row) == len(names) else ("below: " + ", ".join(below) if below else "-")])
    return table(f"each round's checkpoint against the first-round specialist (re-measured on n={n}; "
                 f"merged, points ahead, tasks won:lost; at or above unless a one-sided sign test gives p <= {level:g})",
                 ["checkpoint", *names, "at or above"], out)


def _versus_cell(r: dict | None) -> str:
    if r is None:
        return "-"
    p = "" if r["at_or_above"] else ", p<0.0001" if r["p_worse"] < 1e-4 else f", p={r['p_worse']:.2g}"
    return f"{100 * r['merged']:.1f}% {100 * (r['merged'] - r['specialist']):+.1f} ({r['wins']}:{r['losses']}{p})"


def _share(x: float | None) -> str:
    return "n/a (no gain)" if x is None else f"{100 * x:.0f}%"


def _remeasured_cells(v: dict) -> list[str]:
    r, iv = v.get("remeasured"), v.get("retention_interval")
    return ["-" if r is None else _share(r["retention"]), "-" if not iv else "{:.0f}-{:.0f}%".format(*(100 * x for x in iv))]


def _cell(m: dict) -> str:
    merged = "-" if m["merged"] is None else f"{100 * m['merged']:.1f}%"
    return merged + ("" if m["retention"] is None else f" ({100 * m['retention']:.0f}%)")
