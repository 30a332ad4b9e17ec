"""Bad input and unforeseen failures end in one clear line on stderr, never a traceback."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.conftest import run_cli


def test_messages_with_brackets_print_as_text() -> None:
    # libp2p dial errors list addresses in brackets; rich markup once crashed the error printer on them
    proc = run_cli("skills", "show", "[/ip4/10.213.0.1/tcp/38839]", check=False)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr and "MarkupError" not in proc.stderr
    assert "unknown skill '[/ip4/10.213.0.1/tcp/38839]'" in " ".join(proc.stderr.split())


def test_unwritable_key_path_is_named(tmp_path: Path) -> None:
    proc = run_cli("id", "--key", "/proc/nokey/k", check=False)
    text = " ".join(proc.stderr.split())
    assert proc.returncode == 1 and "cannot create the key file /proc/nokey/k" in text and "Traceback" not in text


def test_report_on_a_foreign_metrics_file(tmp_path: Path) -> None:
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"kind": "step", "step": 1, "reward": "high"}) + "\n")
    proc = run_cli("report", str(tmp_path), check=False)
    text = " ".join(proc.stderr.split())
    assert proc.returncode == 1 and "reward = 'high', not a number" in text and "Traceback" not in text


def test_unexpected_errors_are_one_line_unless_verbose() -> None:
    script = ("import sys\nfrom skillswarm.node.cli import app as a\n"
              "@a.app.command('boom')\ndef boom() -> None:\n    raise RuntimeError('kaboom [/x]')\n"
              "sys.argv = ['skillswarm', *sys.argv[1:], 'boom']\na.main()\n")
    quiet = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    text = " ".join(quiet.stderr.split())
    assert quiet.returncode == 1 and "unexpected RuntimeError: kaboom [/x] (run with -v for the traceback)" in text
    assert "Traceback" not in quiet.stderr
    loud = subprocess.run([sys.executable, "-c", script, "-v"], capture_output=True, text=True, timeout=120)
    assert loud.returncode == 1 and "kaboom" in loud.stderr and "Traceback" in loud.stderr



def test_a_key_in_use_by_another_process_is_named(tmp_path: Path) -> None:
    key = tmp_path / "shared.key"
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time\nfrom skillswarm.protocol.identity import Identity\n"
                               f"Identity.claim({str(key)!r})\nprint('held', flush=True)\ntime.sleep(60)\n"],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"  # type: ignore[union-attr]
        proc = run_cli("net", "serve", "--key", str(key), "--port", "0", check=False, timeout=60)
        text = " ".join(proc.stderr.split())
        assert proc.returncode == 1 and f"the key {key} is in use by process {holder.pid}" in text, text
        assert "--key FILE" in text and "Traceback" not in text
    finally:
        holder.kill()
        holder.wait()
    # the kernel drops the lock with its holder: the key is free again
    from skillswarm.protocol.identity import Identity

    assert Identity.claim(key).public_key_hex
