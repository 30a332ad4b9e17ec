"""The endpoint's settings that the CLI shows as defaults (kept free of heavy imports)."""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_HOST, DEFAULT_PORT = "127.0.0.1", 8000


@dataclass(frozen=True)
class StoreLimits:
    """How long a trajectory waits for its reward, when an unfinished group counts as idle, and bounds."""

    deadline_s: float = 600.0
    group_idle_s: float = 5.0
    max_open: int = 10_000
    max_group: int = 256
