"""Network files: `net init` writes a signed spec, loading validates it, bad files get clear errors."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest

from skillswarm.protocol.errors import SpecError
from skillswarm.protocol.hashing import weights_hash
from skillswarm.protocol.identity import Identity
from skillswarm.protocol.netspec import load_spec, parse_spec, save_spec, spec_to_toml
from skillswarm.protocol.records import DEFAULT_LAMBDA_SEARCH, DEFAULT_REPAIR_LAYERS, DEFAULT_SATURATED_AT, MIN_LR_FACTOR
from skillswarm.protocol.version import PROTOCOL_VERSION
from tests.conftest import run_cli


def test_net_init_writes_a_valid_signed_spec(tmp_path: Path, tiny_model_dir: Path) -> None:
    out = tmp_path / "net.toml"
    run_cli("net", "init", "--name", "alpha", "--model", str(tiny_model_dir), "--skill", "arith", "--skill", "sort",
            "--method", "task_arithmetic", "--lambda", "0.7", "--out", str(out))
    spec = load_spec(out)
    me = Identity.load_or_create()
    assert spec.network == "alpha" and spec.skills == ["arith", "sort"]
    assert spec.base_hash == weights_hash(tiny_model_dir)
    assert spec.coordinators == [me.public_key_hex]  # the creator is trusted by default
    assert spec.author == me.public_key_hex and len(spec.signature) == 64
    assert spec.merge.method == "task_arithmetic" and spec.merge.scale == 0.7
    assert "lambda = 0.7" in out.read_text()  # TOML uses mergekit's word
    # the other lambdas a coordinator may merge at, on evidence: the default ones unless given (the network's own
    # lambda among them is tried once)
    assert spec.merge.scales() == [0.7, *DEFAULT_LAMBDA_SEARCH]
    assert spec.round.lr_factor(7) == 1.0 and "lr_decay" not in out.read_text()  # a constant learning rate unless asked
    # a new network screens with the saturation and credit rules on
    assert spec.screen.saturated_at == DEFAULT_SATURATED_AT and spec.screen.on_credit is True
    assert spec.screen.repair_layers == DEFAULT_REPAIR_LAYERS  # a saturated skill's delta merges as a repair
    assert spec.screen.saturated(DEFAULT_SATURATED_AT) and not spec.screen.saturated(DEFAULT_SATURATED_AT - 0.01)
    shown = run_cli("net", "show", str(out)).stdout
    assert "no delta for a skill at >= 98% but a repair of its first 1 layer(s)" in shown and "merged on credit" in shown
    only = tmp_path / "only.toml"
    run_cli("net", "init", "--name", "alpha", "--model", str(tiny_model_dir), "--skill", "arith", "--lambda", "0.7",
            "--lambda-search", "0.7", "--lr-decay", "0.5", "--out", str(only))
    assert load_spec(only).merge.scales() == [0.7]
    # the workers' learning rate decays by checkpoint version, down to a floor
    decaying = load_spec(only).round
    assert decaying.lr_decay == 0.5 and decaying.lr_factor(0) == 1.0 and decaying.lr_factor(1) == 0.5
    assert decaying.lr_factor(1000) == MIN_LR_FACTOR
    assert "learning rate x0.5 per version" in run_cli("net", "show", str(only)).stdout
    shown = json.loads(run_cli("net", "show", str(out), "--json").stdout)
    assert shown["network"] == "alpha" and shown["merge"]["lambda"] == 0.7
    assert json.loads(run_cli("net", "show", "--network", str(out), "--json").stdout) == shown  # as every command takes it
    again = run_cli("net", "init", "--name", "alpha", "--model", str(tiny_model_dir), "--skill", "arith",
                    "--out", str(out), check=False)
    assert again.returncode != 0 and "--force" in again.stderr


@pytest.mark.parametrize("args, message", [
    (["--name", "Bad Name"], "network"),
    (["--method", "magic"], "method"),
    (["--density", "0"], "density"),
    (["--skill", "arith", "--skill", "arith"], "duplicate"),
])
def test_net_init_rejects_bad_settings(tmp_path: Path, tiny_model_dir: Path, args: list[str], message: str) -> None:
    base = {"--name": "alpha", "--model": str(tiny_model_dir), "--out": str(tmp_path / "n.toml")}
    argv = [x for k, v in base.items() if k not in args for x in (k, v)]
    if "--skill" not in args:
        argv += ["--skill", "arith"]
    proc = run_cli("net", "init", *argv, *args, check=False)
    assert proc.returncode != 0 and message in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "n.toml").exists()


def test_net_init_with_unreachable_model_says_what_to_do(tmp_path: Path) -> None:
    proc = run_cli("net", "init", "--name", "a", "--model", "nobody/no-such-model-xyz", "--skill", "arith",
                   "--out", str(tmp_path / "n.toml"), check=False, env={"HF_HUB_OFFLINE": "1"})
    assert proc.returncode != 0 and "local path" in proc.stderr and "Traceback" not in proc.stderr


def _spec_text(tiny_model_dir: Path, tmp_path: Path) -> str:
    out = tmp_path / "net.toml"
    run_cli("net", "init", "--name", "alpha", "--model", str(tiny_model_dir), "--skill", "arith", "--out", str(out))
    return out.read_text()


def test_loading_reports_each_problem(tmp_path: Path, tiny_model_dir: Path) -> None:
    text = _spec_text(tiny_model_dir, tmp_path)
    with pytest.raises(SpecError, match="does not exist"):
        load_spec(tmp_path / "missing.toml")
    with pytest.raises(SpecError, match="not valid TOML"):
        parse_spec(text + "\n[[[")
    with pytest.raises(SpecError, match="changed after it was signed"):
        parse_spec(text.replace('skills = [\n    "arith",\n]', 'skills = [\n    "sort",\n]').replace('"arith"', '"sort"'))
    unsigned = "\n".join(line for line in text.splitlines() if not line.startswith("signature"))
    assert parse_spec(unsigned).skills == ["arith"]  # hand-written (unsigned) specs are fine
    with pytest.raises(SpecError, match="base_hash"):
        parse_spec(unsigned.replace("base_hash = \"", "base_hash = \"zz"))
    with pytest.raises(SpecError, match="unknown field"):
        parse_spec(unsigned + "\nmystery = 1\n")
    with pytest.raises(SpecError, match="protocol version 99"):
        parse_spec(unsigned.replace(f"protocol = {PROTOCOL_VERSION}\n", "protocol = 99\n"))


def test_spec_round_trips_through_toml(tmp_path: Path, tiny_model_dir: Path) -> None:
    spec = parse_spec(_spec_text(tiny_model_dir, tmp_path))
    save_spec(spec, tmp_path / "copy.toml")
    assert load_spec(tmp_path / "copy.toml") == spec
    assert spec_to_toml(spec) == (tmp_path / "copy.toml").read_text()


def test_a_spec_signed_with_ints_in_float_fields_verifies_after_toml(tmp_path: Path) -> None:
    from skillswarm.protocol.identity import verify_record
    from skillswarm.protocol.records import MergePolicy, NetworkSpec, RoundPolicy

    key = Identity.generate()
    spec = key.sign_record(NetworkSpec(network="n", base_model="m", base_hash="ab" * 32, skills=["arith"],
                                       coordinators=[key.public_key_hex],
                                       round=RoundPolicy(max_wait_s=300), merge=MergePolicy(scale=1)))
    assert isinstance(spec.round.max_wait_s, float)  # normalised before signing
    loaded = load_spec(save_spec(spec, tmp_path / "net.toml"))
    verify_record(loaded, network="n", trusted=[key.public_key_hex])
    assert loaded == spec


# Signed by the code before `skill_versions` existed (key: the Ed25519 seed bytes 0..31).
OLD_SIGNED = dict(protocol=1, network="old", base_model="m", base_hash="ab" * 32, skills=["arith", "sort"],
                  author="03a107bff3ce10be1d70dd18e74bc09967e4d6309ba50d5f1ddc8664125531b8", created=1796112376.7853887,
                  signature="oWKq488kPvRGAnZva7FHo7MODQU5qxL0BuqZyM0yCV95SwvHxpKbcA6qtqVCL7ak/fEeOLq3XotmN/2BVWK/Aw==")


def test_plugin_versions_are_signed_and_old_files_still_verify(tmp_path: Path) -> None:
    import base64

    from skillswarm.protocol.codec import canonical_bytes
    from skillswarm.protocol.identity import verify_record
    from skillswarm.protocol.records import NetworkSpec, SkillVersion

    from skillswarm.protocol.records import MergePolicy, RoundPolicy, ScreenPolicy

    # A file states every policy value (as `net init` writes it), so defaults changed since do not alter it:
    # this one was signed when a round was 20 steps, the merge TIES at density 0.2 and the usefulness test 128 tasks.
    old = NetworkSpec(**{**OLD_SIGNED, "signature": base64.b64decode(OLD_SIGNED["signature"])},
                      round=RoundPolicy(steps_per_round=20), merge=MergePolicy(method="ties", density=0.2),
                      screen=ScreenPolicy(eval_n=128))
    verify_record(old, network="old")  # a file without plugin versions encodes exactly as it did
    assert old.plugin_versions() == {} and b"skill_versions" not in canonical_bytes(old)
    assert b"lambda_search" not in canonical_bytes(old) and old.merge.scales() == [1.0]  # it searches no lambda
    assert b"lr_decay" not in canonical_bytes(old) and old.round.lr_factor(9) == 1.0  # nor decays the learning rate
    assert b"saturated_at" not in canonical_bytes(old) and b"on_credit" not in canonical_bytes(old)
    assert b"repair_layers" not in canonical_bytes(old) and old.screen.repair_layers is msgspec.UNSET
    assert not old.screen.saturated(1.0) and old.screen.on_credit is not True  # nor screens by the newer rules
    assert load_spec(save_spec(old, tmp_path / "old.toml")) == old and "skill_versions" not in spec_to_toml(old)

    key = Identity.generate()
    pin = SkillVersion(version="0.2.0", distribution="skillswarm-vowels-skill", distribution_version="0.2.0")
    spec = key.sign_record(NetworkSpec(network="n", base_model="m", base_hash="ab" * 32, skills=["arith", "count_vowels"],
                                       skill_versions={"count_vowels": pin}))
    text = spec_to_toml(spec)
    assert "[skill_versions.count_vowels]" in text and parse_spec(text).plugin_versions() == {"count_vowels": pin}
    with pytest.raises(SpecError, match="changed after it was signed"):
        parse_spec(text.replace('version = "0.2.0"', 'version = "0.1.0"'))
    unsigned = "\n".join(line for line in text.splitlines() if not line.startswith("signature"))
    with pytest.raises(SpecError, match="not among the network's `skills`"):
        parse_spec(unsigned.replace("count_vowels", "other").replace('"other",', '"count_vowels",', 1))


def test_a_worker_trains_each_checkpoint_at_the_networks_learning_rate_schedule(tmp_path: Path) -> None:
    import msgspec

    from skillswarm.node.rl.config import TrainConfig, WorkerSettings, default_of
    from skillswarm.node.checkpoints.store import CheckpointStore
    from skillswarm.node.roles.worker import Worker, WorkerOptions
    from skillswarm.protocol.records import CheckpointManifest, NetworkSpec, RoundPolicy
    from skillswarm.protocol.transport.blobs import BlobStore

    key = Identity.generate()
    spec = NetworkSpec(network="n", base_model="m", base_hash="ab" * 32, skills=["arith", "sort"],
                       round=RoundPolicy(lr_decay=0.5))

    def config(spec: NetworkSpec, version: int, lr: float | None = None) -> TrainConfig:
        settings = WorkerSettings() if lr is None else WorkerSettings(lr=lr)
        worker = Worker(spec, key, None, CheckpointStore(tmp_path / "store"), BlobStore(tmp_path / "blobs"),
                        WorkerOptions(skill="arith", settings=settings))
        parent = {"parent_version": version - 1, "parent_hash": "ef" * 32} if version else {}
        return worker.round_config(CheckpointManifest(network="n", version=version, weights_hash="cd" * 32, files=[],
                                                      **parent))

    lr = default_of(TrainConfig, "lr")
    assert config(spec, 0).lr == lr and config(spec, 1).lr == lr / 2 and config(spec, 2).lr == lr / 4
    assert config(spec, 30).lr == lr * MIN_LR_FACTOR  # never below the floor
    assert config(spec, 1, lr=1e-3).lr == 5e-4  # a node's own rate decays the same way
    assert config(spec, 1).retain_skills == ("arith", "sort") and config(spec, 1).steps == spec.round.steps_per_round
    constant = msgspec.structs.replace(spec, round=RoundPolicy())  # a file without lr_decay: the rate never changes
    assert config(constant, 7).lr == lr


def test_net_init_and_the_demo_write_the_same_network_file(tmp_path: Path, tiny_model_dir: Path) -> None:
    """Both go through `new_network`: given the demo's settings, `net init` writes the demo's file."""
    from skillswarm.node.demo.config import DESCRIPTION, NETWORK, DemoConfig, make_spec

    key = tmp_path / "coordinator.key"
    cfg = DemoConfig(out=tmp_path / "demo", skills=["arith", "sort"])
    demo = make_spec(cfg, tiny_model_dir, Identity.load_or_create(key))
    run_cli("net", "init", "--name", NETWORK, "--model", str(tiny_model_dir), "--skill", "arith", "--skill", "sort",
            "--description", DESCRIPTION, "--codec", cfg.codec, "--steps-per-round", str(cfg.steps_per_round),
            "--min-deltas", "2", "--max-wait", str(cfg.timeout_s), "--replicas", str(cfg.replicas), "--key", str(key),
            "--out", str(tmp_path / "n.toml"))
    cli = load_spec(tmp_path / "n.toml")
    assert cli.author == demo.author and cli.screen == cfg.screen and cli.merge.scales() == [1.0, *DEFAULT_LAMBDA_SEARCH]

    def unsigned(spec: object) -> str:
        return spec_to_toml(msgspec.structs.replace(spec, created=0.0, signature=b""))  # type: ignore[type-var]

    assert unsigned(cli) == unsigned(demo)
