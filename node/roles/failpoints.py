"""Crash points for testing recovery: `SKILLSWARM_FAILPOINT=name` makes the process SIGKILL itself when
it reaches `hit(name)`, exactly as a power cut or OOM kill would stop it there."""

from __future__ import annotations

import logging
import os
import signal

log = logging.getLogger(__name__)


def hit(name: str) -> None:
    """Die here (SIGKILL, no cleanup) when the failpoint `name` is armed."""
    if os.environ.get("SKILLSWARM_FAILPOINT") == name:
        log.warning("failpoint %s: killing this process", name)
        os.kill(os.getpid(), signal.SIGKILL)
