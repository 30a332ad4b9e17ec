"""NetworkSpec on disk: a TOML file shared out of band (the network's genesis), validated on load."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Mapping, Sequence

import msgspec
from msgspec import UNSET

from skillswarm.protocol.atomic import atomic_write_text
from skillswarm.protocol.codec import decode_record, encode_record
from skillswarm.protocol.errors import RecordError, SignatureError, SpecError
from skillswarm.protocol.identity import verify_record
from skillswarm.protocol.records import (
    DEFAULT_CODEC,
    DEFAULT_LAMBDA_SEARCH,
    MergePolicy,
    NetworkSpec,
    RoundPolicy,
    ScreenPolicy,
    SkillVersion,
    TrustPolicy,
)
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


def new_network(name: str, base_model: str, base_hash: str, skills: Sequence[str], coordinators: Sequence[str], *,
                description: str = "", base_revision: str | None = None, bootstrap: Sequence[str] = (),
                codec: str = DEFAULT_CODEC, round: RoundPolicy | None = None, merge: MergePolicy | None = None,
                trust: TrustPolicy | None = None, screen: ScreenPolicy | None = None,
                skill_versions: Mapping[str, SkillVersion] | None = None, replicas: int | None = None,
                replica_wait_s: float | None = None, quorum: int | None = None,
                failover_s: float | None = None) -> NetworkSpec:
    """A new network's spec, unsigned and validated: what `net init` and the demo write. A policy left out is the
    records' default, except that a new network searches DEFAULT_LAMBDA_SEARCH (unless `merge` names its own
    lambdas) and screens with `ScreenPolicy.for_new_network`'s rules; `replicas` and `replica_wait_s`, when given,
    set the round policy's copies a coordinator waits for before it leaves; `quorum` (k of the coordinators that
    must sign a checkpoint) and `failover_s`, when given, are written too. Invalid settings raise SpecError."""
    merge = MergePolicy() if merge is None else merge
    round = RoundPolicy() if round is None else round
    if replicas is not None:
        round = msgspec.structs.replace(round, replicas=replicas)
    if replica_wait_s is not None:
        round = msgspec.structs.replace(round, replica_wait_s=replica_wait_s)
    if failover_s is not None:
        round = msgspec.structs.replace(round, failover_s=failover_s)
    if merge.scale_search is UNSET:
        merge = msgspec.structs.replace(merge, scale_search=list(DEFAULT_LAMBDA_SEARCH))
    try:
        spec = NetworkSpec(
            network=name, description=description, base_model=base_model, base_revision=base_revision,
            base_hash=base_hash, skills=list(skills), coordinators=list(coordinators), bootstrap=list(bootstrap),
            codec=codec, round=round, merge=merge,  # type: ignore[arg-type]
            trust=TrustPolicy() if trust is None else trust,
            screen=ScreenPolicy.for_new_network() if screen is None else screen,
            skill_versions=dict(skill_versions) if skill_versions else UNSET,  # none: the file reads as before plugins
            quorum=UNSET if quorum is None else quorum,
        )
        return decode_record(encode_record(spec), NetworkSpec)  # every field's type and bounds, as a reader checks them
    except (ValueError, RecordError) as e:
        raise SpecError(f"invalid network settings: {e}") from None


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
