"""A training run's metrics log: one JSON object per line (`kind` = start | step | eval | end).

Lines are appended and flushed as they happen, so a killed run keeps everything up to its last step;
a half-written last line is ignored when reading. On resume the log is cut back to the checkpoint's step.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any, Iterable, Sequence

from skillswarm.protocol.atomic import atomic_write_text

log = logging.getLogger(__name__)


def _clean(value: Any) -> Any:
    """JSON-safe values: NaN/inf become null (JSON has no such numbers)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    return value


def read_metrics(path: Path | str) -> list[dict[str, Any]]:
    """Every complete record of a metrics file, in order (an unparseable line, e.g. the torn last line
    of a killed run, is skipped)."""
    out = []
    p = Path(path)
    if not p.exists():
        return out
    for line in p.read_text().splitlines():
        if not line.strip():
            continue
        try:
            out.append(json.loads(line))
        except ValueError:
            log.debug("skipping a torn metrics line in %s", p)
    return out


class MetricsLog:
    """Append-only JSONL writer; every record also goes to the run's trackers (`skillswarm.node.tracking`)."""

    def __init__(self, path: Path | str, trackers: Sequence[Any] = ()) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._f = self.path.open("a")
        self.trackers = list(trackers)

    def write(self, record: dict[str, Any]) -> None:
        """Append one record and flush it."""
        clean = _clean(record)
        self._f.write(json.dumps(clean, sort_keys=True) + "\n")
        self._f.flush()
        if self.trackers:
            from skillswarm.node.tracking import send

            send(self.trackers, clean)

    def close(self) -> None:
        self._f.close()
        for tracker in self.trackers:
            tracker.close()
        self.trackers = []

    @staticmethod
    def truncate(path: Path | str, step: int) -> list[dict[str, Any]]:
        """Keep the records up to `step` (a resumed run redoes what came after its checkpoint)."""
        kept = [r for r in read_metrics(path) if int(r.get("step", 0)) <= step and r.get("kind") != "end"]
        atomic_write_text(path, "".join(json.dumps(r, sort_keys=True) + "\n" for r in kept))
        return kept


def last_eval(records: Iterable[dict[str, Any]], step: int | None = None) -> dict[str, Any] | None:
    """The latest eval record (at `step` exactly when given)."""
    evals = [r for r in records if r.get("kind") == "eval" and (step is None or r.get("step") == step)]
    return evals[-1] if evals else None
