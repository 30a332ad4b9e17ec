"""NetworkSpec on disk: a TOML file shared out of band (the network's genesis), validated on load."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import msgspec

from skillswarm.protocol.atomic import atomic_write_text
from skillswarm.protocol.errors import SignatureError, SpecError
from skillswarm.protocol.identity import verify_record
from skillswarm.protocol.records import NetworkSpec
from skillswarm.protocol.version import PROTOCOL_VERSION

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib
import tomli_w


def _drop_none(value: Any) -> Any:
    """TOML has no null: leave unset optional fields out."""
    if isinstance(value, dict):
        return {k: _drop_none(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_drop_none(v) for v in value]
    return value


def spec_to_toml(spec: NetworkSpec) -> str:
    """Render a spec as TOML (signature base64-encoded)."""
    data = _drop_none(msgspec.to_builtins(spec))
    header = f"# skillswarm network file (protocol {PROTOCOL_VERSION}). Share it with everyone who joins.\n"
    return header + tomli_w.dumps(data)


def save_spec(spec: NetworkSpec, path: Path | str) -> Path:
    """Write the spec atomically (temp file + rename)."""
    return atomic_write_text(path, spec_to_toml(spec))


def parse_spec(text: str, source: str = "<network file>") -> NetworkSpec:
    """Parse and validate TOML text; a signed spec must verify (an edited one must be re-signed)."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise SpecError(f"{source} is not valid TOML: {e}") from None
    if isinstance(data.get("protocol"), int) and data["protocol"] > PROTOCOL_VERSION:
        raise SpecError(
            f"{source} is for protocol version {data['protocol']} but this node speaks {PROTOCOL_VERSION}; "
            "upgrade skillswarm"
        )
    data.setdefault("kind", "network")
    try:
        spec = msgspec.convert(data, NetworkSpec, dec_hook=None)
    except msgspec.ValidationError as e:
        text_, _, where = str(e).rpartition(" - at `")
        field = where.rstrip("`").removeprefix("$.") if text_ else ""
        msg = f"field `{field}`: {text_}" if text_ else str(e)
        raise SpecError(f"{source}: {msg}") from None
    if spec.signature:
        try:
            verify_record(spec, network=spec.network)
        except SignatureError:
            raise SpecError(
                f"{source} was changed after it was signed; recreate it with `skillswarm net init` "
                "or delete its `signature` line to use it unsigned"
            ) from None
    return spec


def load_spec(path: Path | str) -> NetworkSpec:
    """Read and validate a network file; errors say what to fix."""
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise SpecError(f"network file {path} does not exist; create one with `skillswarm net init`") from None
    except (OSError, UnicodeDecodeError) as e:
        raise SpecError(f"cannot read network file {path}: {e}") from None
    return parse_spec(text, source=str(path))
