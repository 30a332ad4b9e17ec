"""Render the recorded figures: `bench/results/*.json` (written by `bench/record.py`) into docs/results.md and
the README's headline table (between its `results:begin` and `results:end` markers). Figures are never typed
by hand: rerun a bench through `record.py`, then this script, and commit both.

    .venv/bin/python bench/render.py            # rewrite docs/results.md and the README's table
    .venv/bin/python bench/render.py --check    # exit 1 when either differs from what the records give
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
DOC = ROOT / "docs" / "results.md"
README = ROOT / "README.md"
BEGIN, END = "<!-- results:begin -->", "<!-- results:end -->"
FIELDS = ("name", "command", "commit", "date", "machine", "figures")


class RenderError(Exception):
    """A record or a target file this script cannot use, with what to do about it."""


@dataclass(frozen=True)
class Headline:
    """One README row: what was measured, the sentence its figures give, and the page that explains it."""

    what: str
    figure: Callable[[dict[str, Any]], str]
    page: str


def _pct(x: float) -> str:
    return f"{100 * x:.1f}"


def _demo(f: dict[str, Any]) -> str:
    skills = f["skills"]
    gains = [100 * (s["specialist"] - s["base"]) for s in skills.values()]
    kept = [(s.get("remeasured") or s)["retention"] for s in skills.values()]
    n = {(s.get("remeasured") or {}).get("n", f.get("eval_n")) for s in skills.values()}
    text = (f"specialists gain {min(gains):+.1f} to {max(gains):+.1f} points; the merge keeps "
            f"{100 * min(kept):.0f}-{100 * max(kept):.0f}% of each gain (n = {', '.join(map(str, sorted(n)))})")
    return text


def _poison(f: dict[str, Any]) -> str:
    attacks = f["attacks"]
    inside = [a["name"] for a in attacks if a["included"]]
    worst = max(a["max_loss_pts"] for a in attacks)
    unscreened = max(a["unscreened"]["max_loss_pts"] for a in attacks)
    head = f"none of {len(attacks)} attacks included" if not inside else f"included: {', '.join(inside)}"
    return (f"{head} ({'keys with a record' if f.get('reputed') else 'fresh keys'}); "
            f"max loss {worst:.1f} points (unscreened: up to {unscreened:.1f})")


def _flood(f: dict[str, Any]) -> str:
    runs = f["runs"]
    flood = runs["flood"]
    if not flood["completed"]:
        return "the round did NOT complete under the flood"
    text = ("the round completed with every honest delta" if flood["with_honest_deltas"]
            else "the round completed WITHOUT every honest delta")
    text += f": {flood['seconds']:.0f} s under the flood"
    if "baseline" in runs:
        text += f" against {runs['baseline']['seconds']:.0f} s alone"
    return text


def _continuity(f: dict[str, Any]) -> str:
    pullable = f["versions_pullable_at_end"]["count"]
    return (f"{f['rounds_completed']} rounds through a killed leader (failover in {f['failover_s']:.0f} s), a restarted "
            f"bootstrap and a leaving coordinator; {pullable} of {f['versions_total']} versions pulled from the archive "
            f"alone at the end; {f['forks_accepted']} forks")


def _sandbox(f: dict[str, Any]) -> str:
    return (f"{f['sandbox_ms_p50']:.1f} ms (p50) against {f['bare_ms_p50']:.1f} ms for a bare subprocess "
            f"(ratio {f['ratio']:.2f}), {f['calls_per_s']:.0f} calls/s")


def _transfer(f: dict[str, Any]) -> str:
    return (f"a verified fetch at {f['ratio_vs_hashing_bare']:.2f}x a bare stream that also hashes; three capped "
            f"providers {f['multi_source_speedup']:.2f}x faster than one")


def _rl_async(f: dict[str, Any]) -> str:
    return f"{f['ratio']:.2f}x the samples/s of lock-step training ({f['skill']})"


HEADLINES: dict[str, Headline] = {
    "demo": Headline("the demo: a swarm of 4 skills, 4 rounds, nano model", _demo, "docs/demo.md"),
    "poison": Headline("the poisoning drill", _poison, "docs/security-drills.md"),
    "poison-reputed": Headline("the poisoning drill, from keys with a record", _poison, "docs/security-drills.md"),
    "flood": Headline("a round under a record flood", _flood, "docs/security-drills.md"),
    "continuity": Headline("the continuity drill: 3 coordinators, quorum 2, an archive", _continuity,
                           "docs/continuity.md"),
    "rl_async": Headline("async against `--sync` training", _rl_async, "docs/learning-on-a-shard.md"),
    "transfer": Headline("transfer", _transfer, "docs/compression-and-transfer.md"),
    "sandbox": Headline("a sandboxed `python` run", _sandbox, "docs/sandbox.md"),
}


def load(results: Path = RESULTS) -> list[dict[str, Any]]:
    """Every record under `results`, checked for the fields a rendering needs, sorted by name."""
    records = []
    for path in sorted(results.glob("*.json")):
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise RenderError(f"{path.name} is not a JSON record ({e}): record it again with bench/record.py") from None
        missing = [k for k in FIELDS if not isinstance(record, dict) or k not in record]
        if missing:
            raise RenderError(f"{path.name} lacks {', '.join(missing)}: record it again with bench/record.py")
        if record["name"] != path.stem:
            raise RenderError(f"{path.name} names itself {record['name']!r}: the file name must be the record's name")
        records.append(record)
    return records


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, (list, tuple)) and all(not isinstance(v, (dict, list)) for v in value):
        return ", ".join(_cell(v) for v in value)
    return str(value).replace("|", "\\|")


def flatten(figures: Any, prefix: str = "") -> list[tuple[str, str]]:
    """Scalar leaves as (dotted key, text); a list of named dicts keys each by its `name`."""
    rows: list[tuple[str, str]] = []
    if isinstance(figures, dict):
        for key in sorted(figures):
            rows += flatten(figures[key], f"{prefix}.{key}" if prefix else str(key))
    elif isinstance(figures, list) and figures and all(isinstance(v, (dict, list)) for v in figures):
        for i, item in enumerate(figures):
            label = item.get("name", i) if isinstance(item, dict) else i
            rows += flatten(item, f"{prefix}[{label}]")
    else:
        rows.append((prefix, _cell(figures)))
    return rows


def _machine(m: dict[str, Any]) -> str:
    parts = [f"{m.get('cpu', '?')} ({m.get('arch', '?')}), {m.get('cores', '?')} cores"]
    if m.get("memory_gib"):
        parts.append(f"{m['memory_gib']} GiB")
    parts.append(f"GPU: {m.get('gpu') or 'none'}")
    parts.append(f"Python {m.get('python', '?')}, torch {m.get('torch') or 'none'}")
    return "; ".join(parts)


def _headline(record: dict[str, Any]) -> str | None:
    spec = HEADLINES.get(record["name"])
    if spec is None:
        return None
    try:
        return spec.figure(record["figures"])
    except (KeyError, TypeError, ValueError, ZeroDivisionError) as e:
        raise RenderError(f"{record['name']}.json does not hold the figures its headline reads ({type(e).__name__}: {e}); "
                          f"record it again with the current bench") from None


def render_doc(records: list[dict[str, Any]]) -> str:
    """docs/results.md: per record, its headline, command, commit, machine, date and every figure."""
    out = ["# Recorded results", "",
           "Every figure below was printed by the command shown, on the machine and commit shown, and saved by",
           "`bench/record.py`; `bench/render.py` wrote this page from `bench/results/*.json`. To refresh one, run",
           "`.venv/bin/python bench/record.py NAME -- COMMAND` and then `.venv/bin/python bench/render.py`. The topic pages",
           "under docs/ explain what each figure answers.", ""]
    for r in records:
        out += [f"## {r['name']}", ""]
        headline = _headline(r)
        if headline:
            out += [f"{headline[0].upper()}{headline[1:]}.", ""]
        out += [f"- command: `{r['command']}`", f"- commit: `{r['commit'][:12]}{'-dirty' if r['commit'].endswith('-dirty') else ''}`",
                f"- date: {r['date']}" + (f" ({r['seconds']:.0f} s)" if isinstance(r.get("seconds"), (int, float)) else ""),
                f"- machine: {_machine(r['machine'])}", "",
                "| figure | value |", "|---|---|"]
        out += [f"| `{key}` | {value} |" for key, value in flatten(r["figures"])]
        out.append("")
    missing = [name for name in HEADLINES if name not in {r["name"] for r in records}]
    if missing:
        out += ["## Not recorded yet", "", "Headline figures with no record in this tree (run `bench/record.py` for them): "
                + ", ".join(f"`{n}`" for n in missing) + ".", ""]
    return "\n".join(out).rstrip("\n") + "\n"


def render_table(records: list[dict[str, Any]]) -> str:
    """The README's headline table: one row per recorded headline, linking its topic page and its record."""
    by_name = {r["name"]: r for r in records}
    rows = ["| what | figure | machine | details |", "|---|---|---|---|"]
    for name, spec in HEADLINES.items():
        if name in by_name:
            r = by_name[name]
            m = r["machine"]
            where = f"{m.get('cores', '?')} cores, {'GPU' if m.get('gpu') else 'no GPU'}, {r['date'][:10]}"
            rows.append(f"| {spec.what} | {_headline(r)} | {where} | [topic]({spec.page}), "
                        f"[record](docs/results.md#{name}) |")
    return "\n".join(rows)


def splice(readme: str, table: str) -> str:
    """The README with the text between its markers replaced by `table`."""
    if readme.count(BEGIN) != 1 or readme.count(END) != 1 or readme.index(BEGIN) > readme.index(END):
        raise RenderError(f"README.md must hold one {BEGIN} line and, after it, one {END} line around the headline table")
    head, rest = readme.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{BEGIN}\n{table}\n{END}{tail}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 when a file is out of date")
    args = parser.parse_args()
    try:
        records = load()
        doc = render_doc(records)
        readme = splice(README.read_text(), render_table(records))
    except RenderError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)
    stale = [p for p, text in ((DOC, doc), (README, readme)) if not p.exists() or p.read_text() != text]
    if args.check:
        if stale:
            print(f"out of date: {', '.join(str(p.relative_to(ROOT)) for p in stale)}: run .venv/bin/python bench/render.py",
                  file=sys.stderr)
            sys.exit(1)
        return
    for path, text in ((DOC, doc), (README, readme)):
        if path in stale:
            tmp = path.with_name(f".{path.name}.tmp")
            tmp.write_text(text)
            tmp.replace(path)
            print(f"wrote {path.relative_to(ROOT)}", file=sys.stderr)


if __name__ == "__main__":
    main()
