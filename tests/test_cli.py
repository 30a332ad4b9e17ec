"""The command line: help lists what exists, version, identity output."""

from __future__ import annotations

import json

from tests.conftest import run_cli


def test_help_lists_registered_commands() -> None:
    out = run_cli("--help").stdout
    for command in ("net", "id"):
        assert command in out
    assert "Usage" in run_cli("net", "--help").stdout


def test_flags_are_drawn_without_a_value_and_options_with_their_type() -> None:
    """`--json` takes no value, so --help must not draw it as `--json <bool>`; valued options keep their type."""
    out = run_cli("eval", "--help", env={"COLUMNS": "200"}).stdout
    flags = [line for line in out.splitlines() if "--json" in line or "--help" in line]
    assert len(flags) == 2 and not any("<bool>" in line for line in flags), flags
    assert any("--n" in line and "<int" in line for line in out.splitlines()), out
    assert "<bool>" not in run_cli("train", "--help", env={"COLUMNS": "200"}).stdout


def test_version() -> None:
    from skillswarm.protocol.version import PROTOCOL_VERSION

    out = run_cli("--version").stdout
    assert out.startswith("skillswarm ") and f"protocol {PROTOCOL_VERSION}" in out


def test_id_json_is_stable_and_creates_the_key() -> None:
    first = json.loads(run_cli("id", "--json").stdout)
    second = json.loads(run_cli("id", "--json").stdout)
    assert first == second and first["peer_id"].startswith("12D3KooW") and len(first["public_key"]) == 64


def test_unknown_option_is_a_usage_error() -> None:
    proc = run_cli("net", "init", "--bogus", check=False)
    assert proc.returncode == 2 and "bogus" in proc.stderr


def test_the_checkpoints_table_shows_the_lambda_each_merge_used() -> None:
    from skillswarm.node.cli.net_inspect_cmd import _method

    assert _method({"method": "ties", "params": {"lambda": 1.5, "density": 0.3}}) == "ties @ 1.5"
    assert _method({"method": "ties", "params": {}}) == "ties"  # a manifest that records no lambda
    assert _method({"method": None, "params": {}}) == "base"
