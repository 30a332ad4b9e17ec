"""Hypothesis strategies that build valid records of every kind."""

from __future__ import annotations


from hypothesis import strategies as st
from msgspec import UNSET

from skillswarm.protocol import records as r
from skillswarm.protocol.identity import peer_id_from_public_key

names = st.from_regex(r"[a-z0-9][a-z0-9_.-]{0,20}", fullmatch=True)
sha = st.binary(min_size=32, max_size=32).map(bytes.hex)
pubkeys = st.binary(min_size=32, max_size=32).map(bytes.hex)
peer_ids = st.binary(min_size=32, max_size=32).map(peer_id_from_public_key)
maddrs = st.from_regex(r"/ip4/127\.0\.0\.1/tcp/[0-9]{1,5}(/p2p/[1-9A-Za-z]{10,50})?", fullmatch=True)
reals = st.floats(min_value=-1e6, max_value=1e6, allow_nan=False)
fractions = st.floats(min_value=0.0, max_value=1.0)
counts = st.integers(min_value=0, max_value=10**9)
versions = st.integers(min_value=0, max_value=10**6)
params = st.dictionaries(st.from_regex(r"[a-z][a-z0-9_]{0,8}", fullmatch=True), reals, max_size=4)
signatures = st.one_of(st.just(b""), st.binary(min_size=64, max_size=64))


def envelope(**fields):
    """Common record fields; a signature, when present, comes with an author."""
    return st.builds(
        lambda network, author, created, sig: dict(network=network, author=author, created=created, signature=sig),
        names, pubkeys, st.floats(min_value=0, max_value=4e9), signatures,
    )


def _record(cls, **fields):
    return st.builds(lambda env, **kw: cls(**env, **kw), envelope(), **fields)


hardware = st.builds(
    r.Hardware, device=st.sampled_from(["cpu", "cuda", "mps", "other"]), accelerator=st.text(max_size=20),
    accelerator_mem_gb=st.floats(0, 1000), cpu_count=st.integers(0, 512), ram_gb=st.floats(0, 4096),
)
train_stats = st.builds(
    r.TrainStats, steps=counts, samples=counts, tokens=counts, seconds=st.floats(0, 1e6), mean_reward=reals,
    accuracy_before=st.none() | fractions, accuracy_after=st.none() | fractions, eval_n=counts,
    mean_staleness=st.floats(0, 100), dropped_groups=counts, filtered_groups=counts,
    engine=st.sampled_from(r.ENGINES), lora=st.booleans(),
)
file_entries = st.builds(
    r.FileEntry, path=st.from_regex(r"[a-z][a-z0-9_]{0,10}(/[a-z0-9]{1,8})?\.(json|safetensors)", fullmatch=True),
    sha256=sha, size=counts,
)

network_specs = _record(
    r.NetworkSpec, description=st.text(max_size=50), base_model=st.text(min_size=1, max_size=40),
    base_revision=st.none() | st.text(max_size=20), base_hash=sha,
    skills=st.lists(names, min_size=1, max_size=5, unique=True), coordinators=st.lists(pubkeys, max_size=3, unique=True),
    bootstrap=st.lists(maddrs, max_size=3), codec=st.sampled_from(r.CODECS),
    round=st.builds(r.RoundPolicy, steps_per_round=st.integers(1, 1000), min_deltas=st.integers(1, 64),
                    max_wait_s=st.floats(0.5, 1e5), lr_decay=st.just(UNSET) | st.floats(0.01, 1.0)),
    merge=st.builds(r.MergePolicy, method=st.sampled_from(r.MERGE_METHODS), aggregator=st.sampled_from(r.AGGREGATORS),
                    density=st.floats(0.01, 1.0), scale=st.floats(0.01, 10), trim_fraction=st.floats(0, 0.49),
                    max_norm_ratio=st.floats(1, 100)),
)
peer_records = _record(
    r.PeerRecord, peer_id=peer_ids, addrs=st.lists(maddrs, max_size=4), role=st.sampled_from(r.ROLES),
    skills=st.lists(names, max_size=4, unique=True), engine=st.sampled_from(r.ENGINES), hardware=hardware,
    checkpoint_version=st.none() | versions,
    state=st.sampled_from(["starting", "pulling", "training", "publishing", "merging", "evaluating", "idle"]),
    software=st.text(max_size=20),
)
delta_manifests = _record(
    r.DeltaManifest, skill=names, base_version=versions, base_hash=sha, blob=sha, size=st.integers(1, 2**40),
    codec=st.sampled_from(r.CODECS), codec_params=params, norm=st.floats(0, 1e6), num_tensors=st.integers(1, 10**5),
    stats=train_stats,
)


@st.composite
def checkpoint_manifests(draw):
    version = draw(versions)
    parent = None if version == 0 else draw(st.integers(0, version - 1))
    files = draw(st.lists(file_entries, min_size=1, max_size=5, unique_by=lambda f: f.path))
    included = draw(st.lists(st.builds(r.DeltaRef, blob=sha, author=pubkeys, skill=names, weight=reals),
                             max_size=4, unique_by=lambda d: d.blob))
    rejected = draw(st.lists(st.builds(r.Rejection, blob=sha, author=pubkeys, skill=names, reason=st.text(max_size=40)),
                             max_size=3))
    return r.CheckpointManifest(
        **draw(envelope()), version=version, parent_version=parent, parent_hash=None if parent is None else draw(sha),
        weights_hash=draw(sha), files=files, merged_delta=draw(st.none() | file_entries),
        method=draw(st.none() | st.sampled_from(r.MERGE_METHODS)), aggregator=draw(st.none() | st.sampled_from(r.AGGREGATORS)),
        params=draw(params), included=included, rejected=rejected,
        metrics=draw(st.dictionaries(names, st.builds(r.SkillMetrics, accuracy=fractions, mean_reward=reals, n=counts), max_size=4)),
    )


skill_stats = _record(r.SkillStats, skill=names, checkpoint_version=versions, stats=train_stats)

provider_records = _record(r.ProviderRecord, peer_id=peer_ids, blob=sha, size=counts, addrs=st.lists(maddrs, max_size=4))

any_record = st.one_of(network_specs, peer_records, delta_manifests, checkpoint_manifests(), skill_stats, provider_records)
