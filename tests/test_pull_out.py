"""`skillswarm pull --out DIR` never deletes what it did not write: a directory that is not empty and not an
earlier pull is refused (one line, how to fix it), an earlier pull is replaced whole, an empty directory is
used, and a pull that fails half-way leaves the earlier one as it was. Real checkpoints of the nano model,
made the way `pull` makes them (v0 from the local base model)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from skillswarm.node.roles.coordinator import genesis_manifest
from skillswarm.node.checkpoints.pull import PULL_MARKER, export, pull, write_out
from skillswarm.node.checkpoints.store import CheckpointStore, checkpoint_files
from skillswarm.protocol.errors import SkillswarmError
from skillswarm.protocol.hashing import weights_hash
from skillswarm.protocol.identity import Identity
from skillswarm.protocol.records import CheckpointManifest, NetworkSpec
from skillswarm.protocol.transport.blobs import BlobStore
from tests.conftest import run_cli

DROPPED = "generation_config.json"  # in v0, not in v1: a second pull must not leave it behind


@pytest.fixture(scope="module")
def store(nano_model: Path, tmp_path_factory: pytest.TempPathFactory) -> CheckpointStore:
    """A store holding v0 (the nano model, pulled from the local base as `pull` does) and v1 (v0 without
    one file, signed by the same coordinator)."""
    tmp = tmp_path_factory.mktemp("pull-out")
    coordinator = Identity.generate()
    spec = NetworkSpec(network="pullout", base_model=str(nano_model), base_hash=weights_hash(nano_model),
                       skills=["arith"])
    store = CheckpointStore("pullout", tmp / "store")
    v0 = genesis_manifest(spec, coordinator, nano_model)
    pull(None, spec, v0, store, BlobStore(tmp / "blobs"), progress=False)  # type: ignore[arg-type]
    built = store.staging()
    for f in v0.files:
        if f.path != DROPPED:
            shutil.copyfile(store.path(0) / f.path, built / f.path)
    v1 = coordinator.sign_record(CheckpointManifest(network="pullout", version=1, parent_version=0,
                                                    parent_hash=v0.weights_hash, weights_hash=weights_hash(built),
                                                    files=checkpoint_files(built)))
    store.commit(v1, built)
    return store


def _tree(d: Path) -> dict[str, bytes]:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def _user_dir(d: Path) -> dict[str, bytes]:
    """A directory of the user's own: a file and a git repository."""
    (d / ".git" / "objects").mkdir(parents=True)
    (d / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    (d / "notes.txt").write_text("my notes, not a checkpoint\n")
    return _tree(d)


def _version(d: Path) -> int:
    return json.loads((d / "manifest.json").read_text())["version"]


def _no_staging_left(out: Path) -> bool:
    return not list(out.parent.glob(f".{out.name}.pull-*"))


def test_the_cli_refuses_a_directory_it_did_not_write_in_one_line(tmp_path: Path) -> None:
    out = tmp_path / "mine"
    before = _user_dir(out)
    # refused before it joins any network: the network file need not even exist
    proc = run_cli("pull", "--network", str(tmp_path / "no-such-net.toml"), "--out", str(out), check=False)
    text = " ".join(proc.stderr.split())
    assert proc.returncode == 1 and "Traceback" not in proc.stderr and text.count("error:") == 1, proc.stderr
    assert f"--out {out} is not empty" in text and "pick an empty or new directory" in text, text
    assert _tree(out) == before


def test_export_refuses_a_directory_it_did_not_write(store: CheckpointStore, tmp_path: Path) -> None:
    out = tmp_path / "mine"
    before = _user_dir(out)
    with pytest.raises(SkillswarmError, match="is not empty .* pick an empty or new directory"):
        export(store, 0, out)
    assert _tree(out) == before and _no_staging_left(out)
    file = tmp_path / "a-file"
    file.write_text("x")
    with pytest.raises(SkillswarmError, match="is a file, not a directory"):
        export(store, 0, file)
    assert file.read_text() == "x"


def test_a_second_pull_replaces_the_first(store: CheckpointStore, tmp_path: Path) -> None:
    out = tmp_path / "model"
    export(store, 0, out)
    assert _version(out) == 0 and (out / DROPPED).is_file() and (out / PULL_MARKER).is_file()
    export(store, 1, out)
    assert _version(out) == 1 and not (out / DROPPED).exists()
    expected = {f.path for f in store.manifest(1).files} | {"manifest.msgpack", "manifest.json", PULL_MARKER}
    assert set(os.listdir(out)) == expected
    assert _tree(out)["model.safetensors"] == (store.path(1) / "model.safetensors").read_bytes()
    assert _no_staging_left(out)
    export(store, 0, out)  # and back
    assert _version(out) == 0 and (out / DROPPED).is_file() and _no_staging_left(out)


def test_an_earlier_pull_the_user_added_to_or_changed_is_refused(store: CheckpointStore, tmp_path: Path) -> None:
    out = tmp_path / "model"
    export(store, 0, out)
    (out / "finetune-notes.md").write_text("mine")
    before = _tree(out)
    with pytest.raises(SkillswarmError, match="also holds files it did not write .*finetune-notes.md"):
        export(store, 1, out)
    assert _tree(out) == before
    (out / "finetune-notes.md").unlink()
    (out / "config.json").write_text((out / "config.json").read_text() + "\n")  # an edit of the user's
    before = _tree(out)
    with pytest.raises(SkillswarmError, match="changed or removed since .*config.json"):
        export(store, 1, out)
    assert _tree(out) == before and _no_staging_left(out)


def test_an_empty_or_new_directory_is_used(store: CheckpointStore, tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    export(store, 1, empty)
    assert _version(empty) == 1 and (empty / "config.json").is_file()
    new = tmp_path / "a" / "b" / "new"
    export(store, 1, new)
    assert _version(new) == 1 and _no_staging_left(new)


def test_a_pull_that_fails_half_way_leaves_the_earlier_one_whole(store: CheckpointStore, tmp_path: Path) -> None:
    out = tmp_path / "model"
    export(store, 0, out)
    before = _tree(out)

    def broken(new: Path) -> None:
        shutil.copytree(store.path(1), new)
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space left"):
        write_out(out, broken, version=1)
    assert _tree(out) == before and _no_staging_left(out)
    # a pull killed outright leaves its staging sibling: the next pull removes it, and only it
    dead = tmp_path / ".model.pull-dead"
    shutil.copytree(store.path(1), dead / "new")
    (dead / ".skillswarm-pull-staging").write_text("999999999")  # no such process
    foreign = tmp_path / ".model.pull-someone-elses"
    foreign.mkdir()
    export(store, 1, out)
    assert _version(out) == 1 and not dead.exists() and foreign.is_dir()
