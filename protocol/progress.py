"""Progress bars for work another process does: poll a file that grows (a download's partial file)."""

from __future__ import annotations

import os
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn

# Below this size a bar would only flicker.
MIN_BYTES_FOR_BAR = 8 << 20


class PartialProgress:
    """A rich progress bar (on stderr) fed by the size of `path`; `update()` is called by the waiter."""

    def __init__(self, path: Path, total: int | None, label: str, enabled: bool = True) -> None:
        self.path = path
        self.enabled = enabled and (total is None or total >= MIN_BYTES_FOR_BAR)
        self._progress = Progress(
            TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(), TimeRemainingColumn(),
            console=Console(stderr=True), transient=True,
        ) if self.enabled else None
        self._task = self._progress.add_task(label, total=total) if self._progress else None

    def __enter__(self) -> PartialProgress:
        if self._progress:
            self._progress.start()
        return self

    def update(self) -> None:
        """Show how many bytes the partial file holds now."""
        if self._progress is None:
            return
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return
        done = min(st.st_size, st.st_blocks * 512)  # a download written piece by piece may have holes
        self._progress.update(self._task, completed=done)

    def __exit__(self, *exc: object) -> None:
        if self._progress:
            self._progress.stop()
