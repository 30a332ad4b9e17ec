"""k of n coordinators: a version counts only once a quorum signed the same manifest, racing leaders never get two
manifests of one version accepted, the round's lead passes in a fixed order, and an archive node's copies of the
signed manifests are read like the coordinators' own, between real DHT peers on 127.0.0.1."""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import msgspec
import pytest

from skillswarm.node.roles.leadership import round_leader, round_order
from skillswarm.protocol.codec import encode_record
from skillswarm.protocol.errors import SpecError
from skillswarm.protocol.identity import Identity
from skillswarm.protocol.netspec import load_spec, new_network, parse_spec, spec_to_toml
from skillswarm.protocol.quorum import accepted, body_digest
from skillswarm.protocol.records import ArchivedCheckpoint, CheckpointManifest, FileEntry, NetworkSpec
from skillswarm.protocol.transport.dht import SwarmDHT
from skillswarm.protocol.transport.validation import StorePolicy
from tests.conftest import run_cli

NET = "quorum"


def _manifest(version: int, weights: str) -> CheckpointManifest:
    return CheckpointManifest(network=NET, version=version, parent_version=version - 1, parent_hash="0" * 64,
                              weights_hash=weights, files=[FileEntry(path="model.safetensors", sha256=weights, size=10)])


@pytest.fixture(scope="module")
def keys() -> list[Identity]:
    return [Identity.generate() for _ in range(3)]


@pytest.fixture(scope="module")
def spec(keys: list[Identity]) -> NetworkSpec:
    return new_network(NET, "base", "0" * 64, ["arith"], [k.public_key_hex for k in keys], quorum=2)


@pytest.fixture(scope="module")
def peers(keys: list[Identity], spec: NetworkSpec) -> Iterator[dict[str, SwarmDHT]]:
    """One DHT peer per coordinator key, a reader, and a peer that plays an archive node."""
    policy = StorePolicy.from_spec(spec)
    out: dict[str, SwarmDHT] = {}
    try:
        out["reader"] = SwarmDHT(NET, Identity.generate(), policy=policy).start()
        boot = out["reader"].visible_maddrs()
        for name, key in zip("abc", keys):
            out[name] = SwarmDHT(NET, key, initial_peers=boot, policy=policy).start()
        out["archive"] = SwarmDHT(NET, Identity.generate(), initial_peers=boot, policy=policy).start()
        yield out
    finally:
        for dht in out.values():
            dht.shutdown()


def test_quorum_setting_round_trips_and_older_files_keep_their_bytes(keys: list[Identity]) -> None:
    coords = [k.public_key_hex for k in keys]
    one = new_network(NET, "base", "0" * 64, ["arith"], coords)
    assert one.quorum_k() == 1 and "quorum" not in msgspec.to_builtins(one)  # a file written before reads the same
    two = new_network(NET, "base", "0" * 64, ["arith"], coords, quorum=2, failover_s=30)
    assert "quorum" in msgspec.to_builtins(two) and parse_spec(spec_to_toml(two)).quorum_k() == 2 and two.round.overdue_s() == two.round.max_wait_s + 30
    with pytest.raises(SpecError, match="`quorum` is 4 but the network lists 3 coordinator"):
        new_network(NET, "base", "0" * 64, ["arith"], coords, quorum=4)


def test_the_lead_passes_in_a_fixed_order_and_over_silent_or_offline_leaders() -> None:
    c = ["a", "b", "c"]
    assert [round_order(c, v)[0] for v in range(4)] == ["a", "b", "c", "a"]
    assert round_leader(c, 0, {"a", "b", "c"}, elapsed_s=10, overdue_s=100) == "a"
    assert round_leader(c, 0, {"b", "c"}, elapsed_s=10, overdue_s=100) == "b"  # a is offline
    assert round_leader(c, 0, {"a", "b", "c"}, elapsed_s=150, overdue_s=100) == "b"  # a is online but silent
    assert round_leader(c, 0, {"a", "b", "c"}, elapsed_s=250, overdue_s=100) == "c"
    assert round_leader(c, 0, {"a", "b", "c"}, elapsed_s=1e6, overdue_s=100) == "c"  # the last stays
    assert round_leader(c, 1, {"a", "c"}, elapsed_s=0, overdue_s=100) == "c"
    assert round_leader(c, 1, set(), elapsed_s=0, overdue_s=100) is None


def test_a_copy_signed_by_another_coordinator_is_the_same_checkpoint(keys: list[Identity]) -> None:
    a, b, c = keys
    x = a.sign_record(_manifest(1, "1" * 64))
    x_by_b = b.sign_record(msgspec.structs.replace(x, author="", created=0.0, signature=b""))
    y = c.sign_record(_manifest(1, "2" * 64))
    assert body_digest(x) == body_digest(x_by_b) != body_digest(y)
    assert accepted([x], 2) == {}
    [(version, got)] = accepted([x, y, x_by_b], 2).items()
    assert version == 1 and got.signers == tuple(sorted([a.public_key_hex, b.public_key_hex]))
    assert accepted([x, x], 2) == {}  # one key signing twice is one signature


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_quorum_of_two_accepts_one_checkpoint_per_version(peers: dict[str, SwarmDHT], spec: NetworkSpec) -> None:
    reader, trusted = peers["reader"], spec.coordinators
    x = _manifest(1, "1" * 64)
    assert peers["a"].put(x, ttl=600)
    assert reader.get_checkpoint(1, trusted=trusted) is not None  # one signature is enough for a quorum of one
    assert reader.get_checkpoint(1, trusted=trusted, quorum=2) is None  # ...and refused by a quorum of two
    assert reader.latest_checkpoint(trusted=trusted, quorum=2) is None
    # a racing leader signs another checkpoint of v1: still nothing accepted
    assert peers["c"].put(_manifest(1, "2" * 64), ttl=600)
    assert reader.get_checkpoint(1, trusted=trusted, quorum=2) is None
    assert [len(e.signers) for e in reader.checkpoint_endorsements(1, trusted=trusted)] == [1, 1]
    # b recomputes a's merge and co-signs it: v1 is a's checkpoint, and only a's
    assert peers["b"].put(x, ttl=600)
    got = reader.get_checkpoint(1, trusted=trusted, quorum=2)
    assert got is not None and got.weights_hash == "1" * 64
    assert reader.latest_checkpoint(trusted=trusted, quorum=2).weights_hash == "1" * 64
    [two, one] = reader.checkpoint_endorsements(1, trusted=trusted)
    assert set(two.signers) == {peers["a"].identity.public_key_hex, peers["b"].identity.public_key_hex}
    assert one.signers == (peers["c"].identity.public_key_hex,)
    # a newer version with one signature does not hide the accepted one
    assert peers["c"].put(_manifest(2, "3" * 64), ttl=600)
    assert reader.latest_checkpoint(trusted=trusted, quorum=2).version == 1
    assert [m.version for m in reader.get_checkpoints(trusted=trusted, quorum=2)] == [1]


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_an_archive_copy_is_read_like_the_coordinators_own(peers: dict[str, SwarmDHT], keys: list[Identity],
                                                           spec: NetworkSpec) -> None:
    reader, archive, trusted = peers["reader"], peers["archive"], spec.coordinators
    a, b, c = keys
    z = _manifest(7, "7" * 64)
    signed = [k.sign_record(z) for k in (a, b)]  # never put by a or b: only the archive holds them
    rec = ArchivedCheckpoint(network=NET, version=7, manifests=[encode_record(m) for m in signed])
    assert archive.put(rec, ttl=600)
    got = reader.get_checkpoint(7, trusted=trusted, quorum=2)
    assert got is not None and got.weights_hash == "7" * 64
    assert reader.latest_checkpoint(trusted=trusted, quorum=2).version == 7
    # an archive cannot forge: a manifest signed by a key the network does not trust, or altered, is refused
    outsider = Identity.generate().sign_record(_manifest(8, "8" * 64))
    assert not archive.put(ArchivedCheckpoint(network=NET, version=8, manifests=[encode_record(outsider)]), ttl=600)
    altered = msgspec.structs.replace(a.sign_record(_manifest(9, "9" * 64)), weights_hash="a" * 64)
    assert not archive.put(ArchivedCheckpoint(network=NET, version=9, manifests=[encode_record(altered)]), ttl=600)
    one = [encode_record(c.sign_record(_manifest(10, "b" * 64)))]  # genuine, but one signature of the two needed
    assert archive.put(ArchivedCheckpoint(network=NET, version=10, manifests=one), ttl=600)
    assert reader.get_checkpoint(10, trusted=trusted, quorum=2) is None
    assert reader.get_checkpoint(8, trusted=None) is None and reader.get_checkpoint(9, trusted=None) is None


def test_net_init_writes_the_quorum_and_warns_when_it_is_no_majority(tiny_model_dir: Path, tmp_path: Path) -> None:
    coords = [a for _ in range(3) for a in ("--coordinator", Identity.generate().public_key_hex)]
    base = ["net", "init", "--name", "k", "--model", str(tiny_model_dir), "--skill", "arith", *coords]
    weak = run_cli(*base, "--out", str(tmp_path / "weak.toml"))
    assert "is not a majority" in weak.stdout and "--quorum 2" in weak.stdout
    strong = run_cli(*base, "--quorum", "2", "--failover", "45", "--out", str(tmp_path / "strong.toml"))
    assert "majority" not in strong.stdout
    spec = load_spec(tmp_path / "strong.toml")
    assert spec.quorum_k() == 2 and spec.round.overdue_s() == spec.round.max_wait_s + 45
    bad = run_cli(*base, "--quorum", "4", "--out", str(tmp_path / "bad.toml"), check=False)
    assert bad.returncode == 1 and "`quorum` is 4 but the network lists 3 coordinator(s)" in bad.stdout + bad.stderr
    assert "Traceback" not in bad.stdout + bad.stderr and not (tmp_path / "bad.toml").exists()
