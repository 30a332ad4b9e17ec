"""WriteBehind: a download's dirty pages are written back window by window while it arrives."""

from __future__ import annotations

import ctypes
import os
import sys
from pathlib import Path

import pytest

from skillswarm.protocol import atomic
from skillswarm.protocol.atomic import WriteBehind

MB = 1 << 20


def _append(path: Path, wb: WriteBehind, chunks: int) -> bytes:
    data = os.urandom(chunks * MB)
    with open(path, "ab", buffering=0) as f:
        for i in range(chunks):
            f.write(data[i * MB:(i + 1) * MB])
            wb.advance(f.tell())
    return data


@pytest.mark.skipif(not sys.platform.startswith("linux") or atomic._sync_file_range is None, reason="Linux only")
def test_each_window_is_started_and_the_one_before_it_awaited(tmp_path: Path, monkeypatch) -> None:
    calls: list[tuple[int, int, int]] = []
    real = atomic._sync_file_range

    def spy(fd: int, offset: int, nbytes: int, flags: int) -> int:
        calls.append((offset, nbytes, flags))
        assert real(fd, offset, nbytes, flags) == 0, os.strerror(ctypes.get_errno())
        return 0

    monkeypatch.setattr(atomic, "_sync_file_range", spy)
    path = tmp_path / "blob.part"
    with open(path, "wb", buffering=0) as f:
        data = _append(path, WriteBehind(f.fileno(), window=2 * MB), 7)
    start, wait = WriteBehind._START, WriteBehind._START | WriteBehind._WAIT
    assert calls == [(0, 2 * MB, start),
                     (2 * MB, 2 * MB, start), (0, 2 * MB, wait),
                     (4 * MB, 2 * MB, start), (2 * MB, 2 * MB, wait)]
    assert path.read_bytes() == data


def test_without_sync_file_range_it_falls_back_to_fdatasync(tmp_path: Path, monkeypatch) -> None:
    synced: list[int] = []
    monkeypatch.setattr(atomic, "_sync_file_range", None)
    monkeypatch.setattr(atomic.os, "fdatasync", lambda fd: synced.append(fd))
    path = tmp_path / "blob.part"
    with open(path, "wb", buffering=0) as f:
        wb = WriteBehind(f.fileno(), window=3 * MB)
        data = _append(path, wb, 7)
        assert synced == [f.fileno()] * 2
    assert path.read_bytes() == data


def test_a_resumed_or_truncated_file_restarts_its_windows_at_its_length(tmp_path: Path, monkeypatch) -> None:
    calls: list[tuple[int, int]] = []
    monkeypatch.setattr(atomic, "_sync_file_range", lambda fd, off, n, flags: calls.append((off, n)) or 0)
    path = tmp_path / "blob.part"
    path.write_bytes(os.urandom(5 * MB))
    with open(path, "ab", buffering=0) as f:
        wb = WriteBehind(f.fileno(), window=2 * MB)
        wb.reset(5 * MB)  # resuming a partial download of 5 MB
        _append(path, wb, 2)
        assert calls == [(5 * MB, 2 * MB)]
        f.truncate(0)
        wb.reset()
        calls.clear()
        _append(path, wb, 2)
        assert calls == [(0, 2 * MB)]
