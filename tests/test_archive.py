"""An archive node (`net serve --archive DIR`) keeps a network's history pullable: the coordinator publishes v1 and
leaves once the archive holds a copy; the bootstrap restarts empty while the archive runs, and a fresh node pulls
v1 through it; then every peer stops, the archive included, the bootstrap and the archive come back, and a fresh
node pulls v0, served and found through the archive alone. Its quota drops the oldest versions' files, never the
newest."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
from pathlib import Path

import pytest

from skillswarm.protocol.hashing import weights_hash
from skillswarm.protocol.identity import Identity
from skillswarm.protocol.netspec import load_spec
from skillswarm.protocol.records import CheckpointManifest
from skillswarm.protocol.transport.blobs import BlobStore
from skillswarm.protocol.transport.dht import SwarmDHT
from skillswarm.protocol.transport.validation import StorePolicy
from tests.conftest import ROOT, SKILLSWARM, run_cli
from tests.net_helpers import offer_delta, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(args: list[str], home: Path) -> subprocess.Popen:
    env = {**os.environ, "SKILLSWARM_HOME": str(home), "COLUMNS": "200"}
    env.pop("SKILLSWARM_FAILPOINT", None)
    return subprocess.Popen([str(SKILLSWARM), *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            cwd=ROOT, env=env)


def _serve(spec_file: Path, home: Path, *extra: str) -> tuple[subprocess.Popen, str]:
    """A `net serve --json` process and the address it prints first."""
    p = _start(["net", "serve", "--host", "127.0.0.1", "--network", str(spec_file), "--json", *extra], home)
    line = p.stdout.readline()
    assert line.startswith("{"), line + p.stdout.read() if p.poll() is not None else line
    return p, json.loads(line)["maddrs"][0]


def _stop(p: subprocess.Popen) -> str:
    if p.poll() is None:
        p.send_signal(signal.SIGTERM)
    try:
        p.wait(90)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait(10)
    return p.stdout.read()


def _pull_through(spec_file: Path, maddr: str, version: int, tmp_path: Path, weights: str) -> None:
    """A fresh node (its own home) pulls `version` through `maddr` (retried while the records come back)."""
    out_dir = tmp_path / f"pulled-v{version}"
    wait_for(lambda: run_cli("pull", "--network", str(spec_file), "--peers", maddr, "--version", str(version), "--out",
                             str(out_dir), "--json", check=False, timeout=180,
                             env={"SKILLSWARM_HOME": str(tmp_path / f"h-fresh-{version}")}).returncode == 0,
             120, f"v{version} pulled through the restarted bootstrap", poll=2.0)
    assert weights_hash(out_dir) == weights


def test_a_fresh_node_pulls_every_version_from_an_archive_after_every_peer_restarted(nano_model: Path,
                                                                                       tmp_path: Path) -> None:
    key, spec_file, archive_dir = tmp_path / "coord.key", tmp_path / "net.toml", tmp_path / "archive"
    run_cli("net", "init", "--name", "arch", "--model", str(nano_model), "--skill", "arith", "--min-deltas", "1",
            "--codec", "dense_fp32", "--screen-eval-n", "0", "--replicas", "1", "--replica-wait", "300",
            "--key", str(key), "--out", str(spec_file))
    spec = load_spec(spec_file)
    port = _free_port()
    boot_args = ("--port", str(port), "--key", str(tmp_path / "boot.key"))
    procs: list[subprocess.Popen] = []
    try:
        boot, maddr = _serve(spec_file, tmp_path / "h-boot", *boot_args)
        procs.append(boot)
        archive, _ = _serve(spec_file, tmp_path / "h-arch", "--peers", maddr, "--archive", str(archive_dir),
                            "--refresh", "3", "--key", str(tmp_path / "arch.key"))
        procs.append(archive)
        blobs = BlobStore(tmp_path / "worker-blobs")
        with SwarmDHT("arch", Identity.generate(), initial_peers=[maddr], policy=StorePolicy.from_spec(spec)) as dht:
            dht.serve_blobs(blobs)
            dht.start_heartbeat(lambda: dht.make_peer_record(role="worker", skills=["arith"]))
            offer_delta(dht, blobs, "arch", spec.base_hash, nano_model, tmp_path)
            coordinator = _start(["coordinator", "run", "--network", str(spec_file), "--peers", maddr, "--host",
                                  "127.0.0.1", "--key", str(key), "--eval-n", "4", "--rounds", "1"], tmp_path / "h-coord")
            procs.append(coordinator)
            assert coordinator.wait(300) == 0, coordinator.stdout.read()[-3000:]
            out = coordinator.stdout.read()
            assert "v1 held by 1 other peer" in out, out[-3000:]  # the archive's copy: the coordinator could leave
            manifests = {v: dht.get_checkpoint(v, trusted=spec.coordinators) for v in (0, 1)}
        assert all(manifests.values())
        wait_for(lambda: sorted(p.name for p in (archive_dir / "records").glob("v*.msgpack")) == ["v0.msgpack",
                                                                                                "v1.msgpack"],
                 60, "both versions archived")

        # the bootstrap restarts empty while the archive runs: the archive dials it again and gives it the records
        _stop(boot)
        boot, again = _serve(spec_file, tmp_path / "h-boot", *boot_args)
        procs.append(boot)
        assert again == maddr
        _pull_through(spec_file, maddr, 1, tmp_path, manifests[1].weights_hash)
        # then every peer but the archive is gone, and the archive itself restarts from its disk, under another key
        for p in (archive, boot):
            _stop(p)
        boot, _ = _serve(spec_file, tmp_path / "h-boot", *boot_args)
        procs.append(boot)
        archive, _ = _serve(spec_file, tmp_path / "h-arch", "--peers", maddr, "--archive", str(archive_dir),
                            "--refresh", "3", "--key", str(tmp_path / "arch2.key"))
        procs.append(archive)
        _pull_through(spec_file, maddr, 0, tmp_path, manifests[0].weights_hash)
        latest = run_cli("pull", "--network", str(spec_file), "--peers", maddr, "--out", str(tmp_path / "latest"),
                         "--json", timeout=180, env={"SKILLSWARM_HOME": str(tmp_path / "h-fresh-latest")})
        assert json.loads(latest.stdout)["version"] == 1
        status = json.loads(run_cli("net", "peers", "--network", str(spec_file), "--peers", maddr, "--json").stdout)
        assert "archive" in {p["role"] for p in status["peers"]}
    finally:
        outs = [_stop(p) for p in procs]
    assert any('"served_bytes"' in o for o in outs)


def test_archive_without_a_network_file_is_refused(tmp_path: Path) -> None:
    r = run_cli("net", "serve", "--archive", str(tmp_path / "a"), check=False)
    assert r.returncode != 0 and "--archive needs --network FILE" in r.stdout + r.stderr
    assert "Traceback" not in r.stdout + r.stderr


def _version(model: Path, version: int, weights: float) -> tuple[Path, CheckpointManifest]:
    """A model directory whose weights differ by `weights`, and its (unsigned) manifest as `version`."""
    import shutil

    import torch
    from safetensors.torch import save_file

    from skillswarm.node.checkpoints.store import checkpoint_files

    d = model.parent / f"m{version}"
    shutil.copytree(model, d)
    save_file({"w": torch.full((64, 64), weights), "b": torch.zeros(3)}, str(d / "model.safetensors"))
    parent = {} if version == 0 else {"parent_version": version - 1, "parent_hash": "0" * 64}
    return d, CheckpointManifest(network="quota", version=version, weights_hash=weights_hash(d),
                                 files=checkpoint_files(d), **parent)


def test_the_quota_drops_the_oldest_files_and_keeps_the_newest(tiny_model_dir: Path, tmp_path: Path) -> None:
    from skillswarm.node.roles.archive import Archive
    from skillswarm.protocol.netspec import new_network

    spec = new_network("quota", str(tiny_model_dir), weights_hash(tiny_model_dir), ["arith"], ["a" * 64])
    with SwarmDHT("quota", Identity.generate()) as dht:
        archive = Archive(spec, dht.identity, dht, tmp_path / "archive")
        for v in range(3):
            d, m = _version(tiny_model_dir, v, float(v))
            for f in m.files:
                archive.blobs.add_file(d / f.path)
            archive.store.assemble(m, archive.blobs)
        one = archive.blobs.size(archive.store.manifest(2).files[-1].sha256)  # one version's weights
        archive.quota_bytes = 2 * one + 1000  # two versions fit, not three
        assert archive.held_bytes() > archive.quota_bytes
        archive.evict()
        assert archive.store.versions() == [1, 2] and archive.held_bytes() <= archive.quota_bytes
        config = archive.store.manifest(2).files[0]
        assert config.path == "config.json" and archive.blobs.has(config.sha256)  # shared with a kept version
        archive.quota_bytes = 1  # not even the newest fits: it stays, and says so
        archive.evict()
        assert archive.store.versions() == [2] and "over the quota" in archive.note
