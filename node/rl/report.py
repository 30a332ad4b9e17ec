"""Plots of a training run from its metrics log: reward, accuracy, staleness and outcome counts (PNG)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

from skillswarm.node.rl.rundir import METRICS, read_metrics
from skillswarm.protocol.atomic import atomic_open
from skillswarm.protocol.errors import TrainError

PLOTS = ("reward", "accuracy", "staleness", "outcomes")


def _smooth(values: list[float], window: int = 10) -> list[float]:
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def _bins(steps: list[dict[str, Any]], count: int = 60) -> list[list[dict[str, Any]]]:
    """Consecutive step records in at most `count` bins (bars stay readable over thousands of steps)."""
    size = max(1, -(-len(steps) // count))
    return [steps[i:i + size] for i in range(0, len(steps), size)]


def _save(fig: Any, path: Path) -> Path:
    with atomic_open(path, "wb") as f:
        fig.savefig(f, format="png", dpi=110, bbox_inches="tight")
    return path


# The fields the plots read, and the shape each must have: a hand-edited or foreign metrics file gets an
# error naming the record and field, not a TypeError from deep inside the plotting.
_NUMBERS = ("step", "reward", "accuracy", "episodes", "groups", "env_error_groups", "zero_variance_groups", "stale_groups",
            "staleness_mean", "staleness_max")
_COUNTS = ("staleness", "outcomes")


def _check(record: dict[str, Any], path: Path) -> dict[str, Any]:
    where = f"{path}: the {record.get('kind')} record of step {record.get('step')!r}"
    for key in _NUMBERS:
        v = record.get(key)
        if key in record and (isinstance(v, bool) or not isinstance(v, (int, float))):
            raise TrainError(f"{where} has {key} = {v!r}, not a number; was this file written by `skillswarm train`?")
    for key in _COUNTS:
        v = record.get(key)
        if key in record and v is not None and not (isinstance(v, dict) and all(
                isinstance(c, (int, float)) and not isinstance(c, bool) for c in v.values())):
            raise TrainError(f"{where} has {key} = {v!r}, not a table of counts; was this file written by `skillswarm train`?")
    if record.get("kind") == "step" and "step" not in record:
        raise TrainError(f"{where} has no step number; was this file written by `skillswarm train`?")
    return record


def summarize_run(run_dir: Path | str) -> dict[str, Any]:
    """The numbers behind the plots: steps, rewards, evals, staleness histogram, outcome totals."""
    path = Path(run_dir) / METRICS
    records = [_check(r, path) for r in read_metrics(path) if isinstance(r, dict)]
    steps = [r for r in records if r.get("kind") == "step"]
    evals = [r for r in records if r.get("kind") == "eval"]
    if not steps and not evals:
        raise TrainError(f"{run_dir} has no training metrics ({METRICS} is missing or empty); is it a run directory?")
    staleness: Counter = Counter()
    outcomes: Counter = Counter()
    groups: Counter = Counter()
    for r in steps:
        staleness.update({int(k): v for k, v in (r.get("staleness") or {}).items()})
        outcomes.update(r.get("outcomes") or {})
        groups.update({"ok": r.get("groups", 0), "env_error": r.get("env_error_groups", 0),
                       "zero_variance": r.get("zero_variance_groups", 0), "stale": r.get("stale_groups", 0)})
    return {"steps": steps, "evals": evals, "staleness": dict(sorted(staleness.items())), "outcomes": dict(outcomes),
            "groups": dict(groups)}


def write_report(run_dir: Path | str, out_dir: Path | str | None = None) -> list[Path]:
    """Write reward.png, accuracy.png, staleness.png and outcomes.png into OUT (default RUN_DIR/plots)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run = Path(run_dir)
    data = summarize_run(run)
    out = Path(out_dir) if out_dir is not None else run / "plots"
    out.mkdir(parents=True, exist_ok=True)
    steps = data["steps"]
    x = [r["step"] for r in steps]
    paths = []

    fig, ax = plt.subplots(figsize=(7, 4))
    rewards = [r.get("reward", 0.0) for r in steps]
    ax.plot(x, rewards, alpha=0.35, label="reward (per step)")
    ax.plot(x, _smooth(rewards), label="reward (10-step mean)")
    ax.set(xlabel="step", ylabel="mean episode reward", title=f"{run.name}: training reward")
    ax.legend()
    paths.append(_save(fig, out / "reward.png"))
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(x, _smooth([r.get("accuracy", 0.0) for r in steps]), label="train episodes correct (10-step mean)")
    if data["evals"]:
        ax.plot([e["step"] for e in data["evals"]], [e["accuracy"] for e in data["evals"]], "o-", label="held-out accuracy")
    ax.set(xlabel="step", ylabel="accuracy", ylim=(0, 1), title=f"{run.name}: accuracy")
    ax.legend()
    paths.append(_save(fig, out / "accuracy.png"))
    plt.close(fig)

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
    a1.plot(x, [r.get("staleness_mean", 0.0) for r in steps], label="mean")
    a1.plot(x, [r.get("staleness_max", 0) for r in steps], alpha=0.6, label="max")
    a1.set(xlabel="step", ylabel="policy versions behind", title="staleness of trained groups")
    a1.legend()
    hist = data["staleness"]
    a2.bar([str(k) for k in hist], list(hist.values()))
    a2.set(xlabel="staleness", ylabel="groups", title="staleness distribution")
    paths.append(_save(fig, out / "staleness.png"))
    plt.close(fig)

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
    names = sorted({k for r in steps for k in (r.get("outcomes") or {})})
    bins = _bins(steps)
    left = [b[0]["step"] for b in bins]
    width = [max(1, b[-1]["step"] - b[0]["step"] + 1) for b in bins]
    totals = [sum(sum((r.get("outcomes") or {}).values()) for r in b) or 1 for b in bins]
    bottom = [0.0] * len(bins)
    for name in names:
        share = [sum((r.get("outcomes") or {}).get(name, 0) for r in b) / t for b, t in zip(bins, totals)]
        a1.bar(left, share, width=width, bottom=bottom, align="edge", label=name)
        bottom = [x + y for x, y in zip(bottom, share)]
    correct = [sum(r.get("accuracy", 0.0) * r.get("episodes", 0) for r in b) / t for b, t in zip(bins, totals)]
    a1.plot([x + w / 2 for x, w in zip(left, width)], correct, "k.-", label="correct")
    a1.set(xlabel="step", ylabel="share of episodes", ylim=(0, 1.05), title="episode outcomes")
    if names:
        a1.legend(fontsize="small")
    g = data["groups"]
    a2.bar(list(g), list(g.values()), color=["tab:green", "tab:red", "tab:gray", "tab:orange"][:len(g)])
    a2.set(ylabel="groups", title="groups: trained, dropped, filtered")
    paths.append(_save(fig, out / "outcomes.png"))
    plt.close(fig)
    return paths
