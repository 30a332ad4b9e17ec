"""report.json and report.png: per skill the base, specialist and merged accuracy and the retention of the gain,
the run's history and every round against the first-round specialists."""

from __future__ import annotations

from pathlib import Path

from skillswarm.node.demo.compare import method_label
from skillswarm.node.demo.config import DemoConfig
from skillswarm.node.demo.retention import AT_OR_ABOVE_P, LEVEL, Remeasured, Versus, retention
from skillswarm.protocol.records import CheckpointManifest, DeltaManifest, MergePolicy


def make_report(cfg: DemoConfig, final: CheckpointManifest, history: list[CheckpointManifest],
                deltas: dict[int, list[DeltaManifest]], seconds: float,
                alternatives: dict[str, dict[str, float]] | None = None,
                remeasured: dict[str, Remeasured] | None = None,
                versus: dict[str, list[Versus]] | None = None) -> dict:
    """report.json: per skill base / specialist / merged accuracy and retention, plus the run's history;
    `methods` holds the same figures for the final round re-merged with other methods; `remeasured` the three
    models on `retention_n` tasks (from `remeasure`), and `retention_interval` that retention's interval;
    `versus_first_specialist` every round's checkpoint against the first-round specialist (`versus_specialists`)."""
    skills = {}
    last = final.version - 1
    for skill in cfg.skills:
        first = [d for d in deltas.get(0, []) if d.skill == skill]
        spec_d = [d for d in deltas.get(last, []) if d.skill == skill]
        base = first[0].stats.accuracy_before if first else None
        specialist = max((d.stats.accuracy_after for d in spec_d if d.stats.accuracy_after is not None), default=None)
        metric = final.metrics.get(skill)
        merged = metric.accuracy if metric else None
        rounds = [max((d.stats.accuracy_after for d in deltas.get(v, []) if d.skill == skill
                       and d.stats.accuracy_after is not None), default=None) for v in range(final.version)]
        best = max((a for a in rounds if a is not None), default=None)
        skills[skill] = {"base": base, "specialist": specialist, "merged": merged,
                         "retention": retention(base, specialist, merged),
                         "round_specialists": rounds, "best_round_specialist": best,
                         "first_round_specialist": rounds[0] if rounds else None,
                         "remeasured": _remeasured_row(r) if (r := (remeasured or {}).get(skill)) else None,
                         "retention_interval": list(r.interval) if r and r.interval else None,
                         "versus_first_specialist": [_versus_row(x) for x in (versus or {}).get(skill, [])]}
    run_label = method_label(MergePolicy(method=cfg.method, density=cfg.density, scale=cfg.scale))  # type: ignore[arg-type]
    methods = {run_label: {k: {"merged": v["merged"], "retention": v["retention"]} for k, v in skills.items()}}
    for label, accuracy in (alternatives or {}).items():
        methods[label] = {k: {"merged": accuracy.get(k), "retention": retention(v["base"], v["specialist"], accuracy.get(k))}
                          for k, v in skills.items()}
    return {
        "skills": skills, "method": cfg.method, "method_label": run_label, "methods": methods,
        "rounds": final.version, "steps_per_round": cfg.steps_per_round, "minutes_per_round": cfg.minutes_per_round,
        "retain": cfg.retain, "lr_decay": cfg.lr_decay,
        "eval_n": cfg.eval_n, "retention_n": cfg.retention_n, "interval_level": LEVEL, "at_or_above_p": AT_OR_ABOVE_P,
        "seconds": round(seconds, 1), "final_version": final.version,
        "weights_hash": final.weights_hash, "checkpoint": str(cfg.out / "final"),
        "history": [{"version": h.version, "included": len(h.included), "rejected": len(h.rejected),
                     "accuracy": {k: m.accuracy for k, m in sorted(h.metrics.items())}} for h in history],
        "per_round": per_round(skills, history),
        "specialists": {str(v): {d.skill: {"before": d.stats.accuracy_before, "after": d.stats.accuracy_after}
                                 for d in ds} for v, ds in sorted(deltas.items())},
    }


def _remeasured_row(r: Remeasured) -> dict:
    return {"n": r.n, "base": r.base, "specialist": r.specialist, "merged": r.merged, "retention": r.retention}


def _versus_row(x: Versus) -> dict:
    return {"version": x.version, "merged": x.merged, "specialist": x.specialist, "wins": x.wins, "losses": x.losses,
            "p_worse": round(x.p_worse, 4), "at_or_above": x.at_or_above}


def per_round(skills: dict[str, dict], history: list[CheckpointManifest]) -> list[dict]:
    """Merged accuracy per skill at every version (v0: the base, as its workers measured it), with how many
    deltas each merge included and rejected: whether the swarm keeps improving round over round."""
    rows = [{"version": 0, "accuracy": {k: v["base"] for k, v in skills.items()}, "included": None, "rejected": None}]
    for h in sorted(history, key=lambda h: h.version):
        rows.append({"version": h.version, "accuracy": {k: (h.metrics[k].accuracy if k in h.metrics else None)
                                                        for k in skills},
                     "included": len(h.included), "rejected": len(h.rejected)})
    return rows


def plot_report(report: dict, png: Path) -> Path:
    """A grouped bar chart: base, specialist and merged accuracy per skill."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(report["skills"])
    fig, ax = plt.subplots(figsize=(1.8 * len(names) + 2, 3.6))
    for i, (key, color) in enumerate((("base", "#9e9e9e"), ("specialist", "#1f77b4"), ("merged", "#2ca02c"))):
        values = [100 * (report["skills"][n][key] or 0) for n in names]
        ax.bar([x + 0.27 * (i - 1) for x in range(len(names))], values, 0.27, label=key, color=color)
    ax.set_xticks(range(len(names)), names)
    ax.set_ylabel("held-out accuracy (%)")
    ax.set_title(f"skillswarm demo: {report.get('method_label', report['method'])}, {report['rounds']} rounds")
    ax.legend(frameon=False)
    fig.tight_layout()
    tmp = png.with_name(f".{png.name}.tmp.png")
    fig.savefig(tmp, dpi=120)
    plt.close(fig)
    tmp.replace(png)
    return png
