"""The records nodes exchange (msgspec Structs). Types and ranges here are the validation: decoding
through `skillswarm.protocol.codec.decode_record` enforces every annotation and `__post_init__` check.

Every record is a tagged `Record`: the protocol version it was written under, the network it belongs
to, its author's Ed25519 public key, a creation time, and a signature over everything else.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

import msgspec
from msgspec import UNSET, Meta, Struct, UnsetType

from skillswarm.protocol.version import PROTOCOL_VERSION

# ---- field types (each annotation is a validation rule) -------------------------------------------
Sha256 = Annotated[str, Meta(pattern=r"^[0-9a-f]{64}$", description="lower-case sha256 hex digest")]
PublicKeyHex = Annotated[str, Meta(pattern=r"^([0-9a-f]{64})?$", description="Ed25519 public key, hex")]
Name = Annotated[str, Meta(pattern=r"^[a-z0-9][a-z0-9_.-]{0,63}$", description="network or skill name")]
PeerId = Annotated[str, Meta(pattern=r"^[1-9A-HJ-NP-Za-km-z]{32,64}$", description="libp2p peer id")]
Multiaddr = Annotated[str, Meta(pattern=r"^/[!-~]{1,255}$", description="libp2p multiaddr")]
RelPath = Annotated[str, Meta(pattern=r"^(?!/)(?!.*\.\.)[A-Za-z0-9_.\-/]{1,200}$", description="relative file path")]
Version = Annotated[int, Meta(ge=0, le=2**31 - 1)]
Count = Annotated[int, Meta(ge=0, le=2**53)]
Seconds = Annotated[float, Meta(ge=0.0, le=1e9)]
Timestamp = Annotated[float, Meta(ge=0.0, le=1e11)]
Fraction = Annotated[float, Meta(ge=0.0, le=1.0)]
Real = Annotated[float, Meta(ge=-1e12, le=1e12)]  # finite: NaN and inf fail both bounds
SHORT_TEXT_CHARS = 256  # a reason, a note: what a record shows on one line
ShortText = Annotated[str, Meta(max_length=SHORT_TEXT_CHARS)]
Text = Annotated[str, Meta(max_length=1024)]
Params = Annotated[dict[Annotated[str, Meta(pattern=r"^[a-z][a-z0-9_]{0,31}$")], Real], Meta(max_length=32)]

Role = Literal["worker", "coordinator", "bootstrap", "observer", "archive"]
Engine = Literal["hf", "vllm", "none"]
Codec = Literal["dense_fp32", "dense_bf16", "dense_fp16", "topk", "int8", "lora"]
MergeMethod = Literal["linear", "task_arithmetic", "ties", "dare_linear", "dare_ties", "breadcrumbs"]
Aggregator = Literal["mean", "trimmed_mean", "median", "clipped_mean"]
NodeState = Literal["starting", "pulling", "training", "publishing", "merging", "evaluating", "idle", "waiting"]
Admission = Literal["open", "allowlist"]
Device = Literal["cpu", "cuda", "mps", "other"]

ROLES: tuple[str, ...] = Role.__args__  # type: ignore[attr-defined]
ENGINES: tuple[str, ...] = Engine.__args__  # type: ignore[attr-defined]
# The inference engine every setting defaults to (node.rl.engines re-exports it): hf runs on CPU or GPU with no extra.
DEFAULT_ENGINE: Engine = "hf"
CODECS: tuple[str, ...] = Codec.__args__  # type: ignore[attr-defined]
# The codec workers publish unless a network says otherwise: int8 (one scale per row) lost 0.0 points on
# every skill against dense bf16 at 1.9x fewer bytes in `bench/codecs.py`; top-k lost 3-35 (RL deltas
# are dense) and LoRA r4 up to 11 on the nano model (docs/compression-and-transfer.md).
DEFAULT_CODEC: Codec = "int8"
MERGE_METHODS: tuple[str, ...] = MergeMethod.__args__  # type: ignore[attr-defined]
AGGREGATORS: tuple[str, ...] = Aggregator.__args__  # type: ignore[attr-defined]

ADMISSIONS: tuple[str, ...] = Admission.__args__  # type: ignore[attr-defined]

SIGNATURE_BYTES = 64
KeyHex = Annotated[str, Meta(pattern=r"^[0-9a-f]{64}$", description="Ed25519 public key, hex")]
Figures = Annotated[dict[Annotated[str, Meta(pattern=r"^[a-z][a-z0-9_]{0,31}$")], Real], Meta(max_length=8)]


def _unique(field: str, items: list) -> None:
    if len(set(items)) != len(items):
        raise ValueError(f"`{field}` has duplicate entries")


class _Part(Struct, kw_only=True, forbid_unknown_fields=True, frozen=True):
    """A nested value inside a record (no tag, no signature)."""


class Record(_Part, tag_field="kind", kw_only=True):
    """Envelope shared by every record: who wrote it, for which network, under which protocol."""

    protocol: Annotated[int, Meta(ge=1, le=1_000_000)] = PROTOCOL_VERSION
    network: Name
    author: PublicKeyHex = ""  # filled by `identity.sign`
    created: Timestamp = 0.0
    signature: Annotated[bytes, Meta(max_length=SIGNATURE_BYTES)] = b""

    def __post_init__(self) -> None:
        if len(self.signature) not in (0, SIGNATURE_BYTES):
            raise ValueError(f"`signature` must be empty or {SIGNATURE_BYTES} bytes")
        if self.signature and not self.author:
            raise ValueError("`author` is required on a signed record")


# ---- nested parts ---------------------------------------------------------------------------------
class Hardware(_Part, kw_only=True):
    """What a peer runs on, so inspectors and coordinators know what to expect of it."""

    device: Device = "cpu"
    accelerator: ShortText = ""  # GPU name, empty on CPU
    accelerator_mem_gb: Annotated[float, Meta(ge=0.0, le=1e6)] = 0.0
    cpu_count: Annotated[int, Meta(ge=0, le=1_000_000)] = 0
    ram_gb: Annotated[float, Meta(ge=0.0, le=1e7)] = 0.0


class TrainStats(_Part, kw_only=True):
    """What a stretch of training on one shard did; travels in DeltaManifest and SkillStats."""

    steps: Count = 0
    samples: Count = 0
    tokens: Count = 0
    seconds: Seconds = 0.0
    mean_reward: Real = 0.0
    accuracy_before: Fraction | None = None  # held-out accuracy at the start of the round
    accuracy_after: Fraction | None = None  # held-out accuracy after it
    eval_n: Count = 0
    mean_staleness: Annotated[float, Meta(ge=0.0, le=1e6)] = 0.0
    dropped_groups: Count = 0  # env_error groups and stale groups
    filtered_groups: Count = 0  # zero-variance groups
    engine: Engine = DEFAULT_ENGINE
    lora: bool = False


class FileEntry(_Part, kw_only=True, omit_defaults=True):
    """One file of a checkpoint: a puller fetches it by hash and verifies it before use. `tree` (the tree
    hash of its pieces, `transport.pieces`) lets a puller fetch it from every provider at once, each piece
    verified; an entry without one (written before it existed) encodes exactly as it did then."""

    path: RelPath
    sha256: Sha256
    size: Count
    tree: Sha256 | None = None


# The protocol whose manifests say a delta's merge layers in `DeltaRef.layers`; a manifest of an earlier protocol says
# them in the figure LEGACY_LAYERS_FIGURE (`delta_layers`, at the end of this file, reads both).
LAYERS_SINCE_PROTOCOL = 2
LEGACY_LAYERS_FIGURE = "layers"


class DeltaRef(_Part, kw_only=True):
    """A delta a merge used, the weight it got, the decoder layers it was merged in, and the screening figures that let
    it in (norm, gain, ...)."""

    blob: Sha256
    author: PublicKeyHex
    skill: Name
    weight: Real = 1.0
    norm: Annotated[float, Meta(ge=0.0, le=1e12)] = 0.0
    figures: Figures = {}
    # N: merged in the model's first N decoder layers only (a saturated skill's repair, ScreenPolicy.repair_layers),
    # and `--verify` recomputes it so. UNSET (every other delta, and every manifest before protocol 2) encodes as
    # nothing: the delta was merged in every layer.
    layers: Annotated[int, Meta(ge=1, le=1024)] | UnsetType = UNSET


class Rejection(_Part, kw_only=True):
    """A delta a coordinator screened out, why (shown by `net deltas`), and the figures it was judged on."""

    blob: Sha256
    author: PublicKeyHex
    skill: Name
    reason: ShortText
    step: Annotated[str, Meta(pattern=r"^[a-z_]{0,32}$")] = ""  # the round step that rejected it
    figures: Figures = {}


class SkillVersion(_Part, kw_only=True):
    """The plugin that provides one of a network's skills: its `Skill.version` and the pip distribution
    (and version) it comes from. Every node of the network must have exactly this installed."""

    version: Annotated[str, Meta(min_length=1, max_length=64)]
    distribution: Annotated[str, Meta(pattern=r"^[A-Za-z0-9]([A-Za-z0-9._-]{0,126}[A-Za-z0-9])?$")]
    distribution_version: Annotated[str, Meta(max_length=64)] = ""


class SkillMetrics(_Part, kw_only=True):
    """A skill's held-out score on a checkpoint."""

    accuracy: Fraction
    mean_reward: Real = 0.0
    n: Count = 0


# The lowest the round schedule takes the workers' learning rate (a quarter: late rounds still learn).
MIN_LR_FACTOR = 0.25


# Copies of a checkpoint held by other peers before its coordinator leaves, and how long it waits for them.
DEFAULT_REPLICAS = 2
DEFAULT_REPLICA_WAIT_S = 600.0
# How long past its round's wait an online leader may run before the next coordinator takes the round over.
DEFAULT_FAILOVER_S = 300.0


class RoundPolicy(_Part, kw_only=True):
    """When a round ends (enough deltas, or the wait ran out), and how long its downloads may take."""

    # 100: at 50 steps a round arith gained under +15 in 3 of 4 demo runs (+11.3 to +12.7); at 100 every skill
    # gained +15 or more in 3 of 3 (docs/demo.md, "Rounds of 100 steps, TIES and retain 2").
    steps_per_round: Annotated[int, Meta(ge=1, le=1_000_000)] = 100
    min_deltas: Annotated[int, Meta(ge=1, le=4096)] = 1
    max_wait_s: Annotated[float, Meta(gt=0.0, le=1e7)] = 900.0
    fetch_budget_s: Annotated[float, Meta(gt=0.0, le=1e7)] = 900.0  # every delta of a round, fetched concurrently
    max_backoff_s: Annotated[float, Meta(gt=0.0, le=1e6)] = 300.0  # longest pause after an empty or all-rejected round
    # The workers' learning rate on checkpoint vN is lr * lr_decay**N, never below MIN_LR_FACTOR * lr (the decaying
    # step size federated averaging needs to converge over many rounds). UNSET (the default, and every file written
    # before this existed) encodes as nothing and keeps the rate constant. Opt-in: in the 4-round nano demo 0.8 did
    # not keep more of each gain and merged 5 points fewer (docs/merging.md, "What the last round loses").
    lr_decay: Annotated[float, Meta(gt=0.0, le=1.0)] | UnsetType = UNSET
    # Before a coordinator leaves (`coordinator run --rounds N` done, Ctrl-C, SIGTERM) it keeps serving its latest
    # checkpoint until this many other peers hold a verified copy of every file of it, or `replica_wait_s` passes:
    # otherwise the one holder leaves and no pull can succeed. UNSET (as in every file written before these existed)
    # encodes as nothing and means DEFAULT_REPLICAS and DEFAULT_REPLICA_WAIT_S.
    replicas: Annotated[int, Meta(ge=0, le=64)] | UnsetType = UNSET
    replica_wait_s: Annotated[float, Meta(ge=0.0, le=1e6)] | UnsetType = UNSET
    # With several coordinators: how long past `max_wait_s` a round's leader, still online, may take before the next
    # coordinator in the round's order runs the round (node/roles/leadership.py). A leader that goes offline is
    # replaced as soon as its heartbeat expires. UNSET (as in older files) means DEFAULT_FAILOVER_S.
    failover_s: Annotated[float, Meta(gt=0.0, le=1e6)] | UnsetType = UNSET

    def overdue_s(self) -> float:
        """Seconds after a round began at which its online leader counts as silent (`max_wait_s` + `failover_s`)."""
        return self.max_wait_s + (DEFAULT_FAILOVER_S if self.failover_s is UNSET else self.failover_s)

    def copies_wanted(self) -> int:
        """How many other peers must hold a checkpoint before its coordinator leaves."""
        return DEFAULT_REPLICAS if self.replicas is UNSET else self.replicas

    def copies_wait_s(self) -> float:
        """The longest a leaving coordinator waits for those copies, in seconds."""
        return DEFAULT_REPLICA_WAIT_S if self.replica_wait_s is UNSET else self.replica_wait_s

    def lr_factor(self, version: int) -> float:
        """What the workers' learning rate is multiplied by on checkpoint `version`."""
        if self.lr_decay is UNSET:
            return 1.0
        return max(MIN_LR_FACTOR, self.lr_decay ** max(0, version))


class MergePolicy(_Part, kw_only=True):
    """How a coordinator folds a round's deltas into the next checkpoint."""

    # TIES at lambda 1 (signs elected): at 100 steps a round the summed deltas of task arithmetic overshoot (reverse
    # lost 12-23 points from one round's sum), TIES kept each skill within two points of where the round started, or
    # above it (docs/demo.md, "Rounds of 100 steps, TIES and retain 2"; bench/interference.py). Half of each delta kept,
    # not 30%: trimming cost a late round's small deltas a quarter of their gain, and replayed last rounds kept
    # >= 90% of every gain in 11 of 12 runs at 0.5 against 8 at 0.3 (docs/screening-and-merge-guard.md, "Saturated skills and deltas on credit").
    method: MergeMethod = "ties"
    aggregator: Aggregator = "mean"  # within one skill's deltas
    density: Annotated[float, Meta(gt=0.0, le=1.0)] = 0.5
    scale: Annotated[float, Meta(gt=0.0, le=100.0)] = msgspec.field(default=1.0, name="lambda")
    trim_fraction: Annotated[float, Meta(ge=0.0, lt=0.5)] = 0.1
    max_norm_ratio: Annotated[float, Meta(ge=1.0, le=1e6)] = 5.0  # reject norms above ratio * median
    # Other lambdas a coordinator merges a round at, keeping one only where it beats `lambda` significantly on the
    # usefulness test's tasks (node/roles/rounds/scale_search.py). UNSET, as in a network file written before this
    # existed, encodes as nothing and searches nothing; `net init` and the demo write DEFAULT_LAMBDA_SEARCH.
    scale_search: Annotated[list[Annotated[float, Meta(gt=0.0, le=100.0)]], Meta(max_length=4)] | UnsetType = \
        msgspec.field(default=UNSET, name="lambda_search")

    def scales(self) -> list[float]:
        """`lambda` first, then the other lambdas to try, each once."""
        out = [self.scale]
        for s in [] if self.scale_search is UNSET else self.scale_search:
            if s not in out:
                out.append(s)
        return out


# A demo's first deltas, large and trained from one model, lost 10-21 points (summed over the 4 skills) to their
# specialists merged at lambda 1 and 6-11 at 1.25-1.5; later rounds were best at 1 (docs/merging.md, "Choosing lambda on
# evidence").
DEFAULT_LAMBDA_SEARCH = (1.25, 1.5)


class TrustPolicy(_Part, kw_only=True):
    """Who may contribute deltas, and how much one key may: the network's sybil resistance. Every peer's
    validator refuses delta records from keys the admission excludes; coordinators apply the rest."""

    admission: Admission = "open"  # open: any key; allowlist: only `workers`
    workers: Annotated[list[KeyHex], Meta(max_length=4096)] = []
    max_deltas_per_author: Annotated[int, Meta(ge=1, le=64)] = 2  # per round, across skills
    max_deltas_per_round: Annotated[int, Meta(ge=1, le=128)] = 32  # considered per round, best reputation first
    min_reputation: Annotated[float, Meta(ge=0.0, le=1.0)] = 0.2  # keys below it are not considered
    reputation_rounds: Annotated[int, Meta(ge=1, le=1000)] = 20  # checkpoints a key's history is read from

    def __post_init__(self) -> None:
        _unique("trust.workers", self.workers)
        if self.admission == "allowlist" and not self.workers:
            raise ValueError("an allowlist network needs at least one key in `trust.workers`")


# Held-out tasks per skill per evaluation (screening, training, merges): at 128 real 3-5 point gains went unseen.
EVAL_N = 300


class ScreenPolicy(_Part, kw_only=True):
    """What a delta must show before it enters a merge (besides being well-formed and finite)."""

    eval_n: Annotated[int, Meta(ge=0, le=100_000)] = EVAL_N  # held-out tasks per skill per candidate (0: no eval check)
    confidence: Annotated[float, Meta(ge=0.5, lt=1.0)] = 0.9  # one-sided: it improves its own skill
    max_other_drop: Annotated[float, Meta(ge=0.0, le=1.0)] = 0.15  # the most it may cost another skill (honest
    # single-round deltas of the nano demo cost calc up to 12 points, measured by bench/poison.py)
    min_norm_ratio: Annotated[float, Meta(ge=0.0, le=1.0)] = 0.02  # norm bounds against the skill's history
    min_cosine: Annotated[float, Meta(ge=-1.0, le=1.0)] = 0.0  # against the consensus of the skill's other deltas
    history_rounds: Annotated[int, Meta(ge=1, le=1000)] = 8  # checkpoints the norm history is read from
    # A skill the parent already solves this well (its first-look accuracy) takes no delta in the round: its delta
    # has no gain left to show and costs the other skills (docs/screening-and-merge-guard.md, "Saturated skills and deltas on credit").
    saturated_at: Annotated[float, Meta(gt=0.0, le=1.0)] | UnsetType = UNSET
    # A delta whose own-skill test is inconclusive (not significantly better, not significantly worse), that costs
    # no other skill beyond `max_other_drop`, that changes at least CREDIT_MIN_CHANGE of its skill's tasks
    # (node/roles/rounds/usefulness.py), from a key with a record (reputation above a fresh key's) is merged on credit: it earns
    # its key no reputation. A late round's honest gain is often too small to show on the
    # test's tasks, and each one left out is its skill's last gain lost. Fresh keys must show significance.
    # UNSET, as in every file written before these existed, encodes as nothing and keeps both rules off;
    # `net init` and the demo write them on (`ScreenPolicy.for_new_network`).
    on_credit: bool | UnsetType = UNSET
    # With saturation: a saturated skill's delta is judged as a repair of its first `repair_layers` decoder layers
    # (with credit's floor set aside) and, when it passes, merged there only, instead of held in reserve. In the demo
    # the first of three layers held 89% of what a saturated reverse's whole delta repaired, at 31% of its cost to
    # sort (docs/screening-and-merge-guard.md, "A saturated skill repaired in its first layer"). UNSET (as in older files): the reserve.
    repair_layers: Annotated[int, Meta(ge=1, le=1024)] | UnsetType = UNSET

    @classmethod
    def for_new_network(cls, **overrides: Any) -> "ScreenPolicy":
        """The policy `net init` and the demo write: the defaults with the saturation (repairs in the first layer)
        and credit rules on."""
        return cls(**{"saturated_at": DEFAULT_SATURATED_AT, "on_credit": True, "repair_layers": DEFAULT_REPAIR_LAYERS,
                      **overrides})

    def saturated(self, accuracy: float) -> bool:
        """Whether a skill at `accuracy` on the parent takes no delta (never when `saturated_at` is unset)."""
        return self.saturated_at is not UNSET and accuracy >= self.saturated_at


# reverse's parent at 98-100% merged deltas that gained nothing and cost sort 1.5-2.0 points (bench/replay_round.py)
DEFAULT_SATURATED_AT = 0.98
# the first of the nano model's three layers held 89% of a saturated reverse's repair at 31% of its cost to sort
DEFAULT_REPAIR_LAYERS = 1


# ---- records --------------------------------------------------------------------------------------
class NetworkSpec(Record, tag="network", kw_only=True):
    """Genesis of a network (`skillswarm net init`); `network` is its name. Shared as a TOML file."""

    description: Text = ""
    base_model: Annotated[str, Meta(min_length=1, max_length=512)]
    base_revision: Annotated[str, Meta(max_length=128)] | None = None
    base_hash: Sha256  # state-dict hash of the base weights = checkpoint v0
    skills: Annotated[list[Name], Meta(min_length=1, max_length=64)]
    coordinators: Annotated[list[Annotated[str, Meta(pattern=r"^[0-9a-f]{64}$")]], Meta(max_length=32)] = []
    bootstrap: Annotated[list[Multiaddr], Meta(max_length=16)] = []
    codec: Codec = DEFAULT_CODEC
    round: RoundPolicy = RoundPolicy()
    merge: MergePolicy = MergePolicy()
    trust: TrustPolicy = TrustPolicy()
    screen: ScreenPolicy = ScreenPolicy()
    # The third-party (plugin) skills' versions. UNSET (no plugin skill) encodes as nothing at all, so a
    # file written before the field existed reads, and verifies, exactly as it did.
    skill_versions: Annotated[dict[Name, SkillVersion], Meta(max_length=64)] | UnsetType = UNSET
    # k of the n `coordinators` must sign the same checkpoint before any node accepts it (protocol/quorum.py). UNSET
    # (every file written before it existed) encodes as nothing and means 1: one coordinator's signature suffices.
    quorum: Annotated[int, Meta(ge=1, le=32)] | UnsetType = UNSET

    def __post_init__(self) -> None:
        super().__post_init__()
        _unique("skills", self.skills)
        _unique("coordinators", self.coordinators)
        if self.quorum is not UNSET and self.coordinators and self.quorum > len(self.coordinators):
            raise ValueError(f"`quorum` is {self.quorum} but the network lists {len(self.coordinators)} coordinator(s); "
                             "no checkpoint could ever be accepted")
        stray = sorted(set(self.plugin_versions()) - set(self.skills))
        if stray:
            raise ValueError(f"`skill_versions` names {stray}, which are not among the network's `skills`")

    def quorum_k(self) -> int:
        """How many of the network's coordinators must sign the same checkpoint before it is accepted."""
        return 1 if self.quorum is UNSET else self.quorum

    def plugin_versions(self) -> dict[str, SkillVersion]:
        """The pinned plugin skills (name -> version); empty when every skill is a built-in."""
        return {} if self.skill_versions is UNSET else dict(self.skill_versions)


class PeerRecord(Record, tag="peer", kw_only=True):
    """A node's announcement (short expiration, heartbeated): who is online, doing what, reachable how."""

    peer_id: PeerId
    addrs: Annotated[list[Multiaddr], Meta(max_length=16)] = []
    role: Role
    skills: Annotated[list[Name], Meta(max_length=32)] = []
    engine: Engine = "none"
    hardware: Hardware = Hardware()
    checkpoint_version: Version | None = None
    state: NodeState = "starting"
    note: ShortText = ""  # what the node waits for or why it backs off (a coordinator's round status)
    software: Annotated[str, Meta(max_length=64)] = ""

    def __post_init__(self) -> None:
        super().__post_init__()
        _unique("skills", self.skills)


# The protocol whose delta manifests name their blob's tree hash; an older one is refused (its worker must upgrade).
TREES_SINCE_PROTOCOL = 3


class DeltaManifest(Record, tag="delta", kw_only=True):
    """A worker's published delta (trained - base) for one skill, addressed by its blob's sha256. `tree`, the tree
    hash of its pieces (`transport.pieces`), lets a fetcher take it from every holder at once (its worker, the
    coordinators that merged it, an archive), each piece verified."""

    skill: Name
    base_version: Version
    base_hash: Sha256
    blob: Sha256
    size: Annotated[int, Meta(ge=1, le=2**40)]
    codec: Codec
    codec_params: Params = {}
    norm: Annotated[float, Meta(ge=0.0, le=1e12)]
    num_tensors: Annotated[int, Meta(ge=1, le=1_000_000)]
    stats: TrainStats = TrainStats()
    tree: Sha256 | UnsetType = UNSET

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.protocol < TREES_SINCE_PROTOCOL:
            raise ValueError(f"a delta manifest of protocol {self.protocol} names no piece tree; its worker runs an "
                             f"older skillswarm and must upgrade (protocol {TREES_SINCE_PROTOCOL} or later)")


class CheckpointManifest(Record, tag="checkpoint", kw_only=True):
    """A merged checkpoint published by a coordinator: everything to fetch, verify and recompute it."""

    version: Version
    parent_version: Version | None = None
    parent_hash: Sha256 | None = None
    weights_hash: Sha256
    files: Annotated[list[FileEntry], Meta(min_length=1, max_length=64)]
    merged_delta: FileEntry | None = None  # delta parent -> this version, for workers holding the parent
    method: MergeMethod | None = None  # None for the genesis checkpoint
    aggregator: Aggregator | None = None
    params: Params = {}
    included: Annotated[list[DeltaRef], Meta(max_length=128)] = []
    rejected: Annotated[list[Rejection], Meta(max_length=128)] = []
    omitted: Count = 0  # rejections not listed: over the round's caps, or beyond what fits the manifest's size
    eval_seed: Annotated[int, Meta(ge=0, le=2**63 - 1)] | None = None  # the screening eval's seed, drawn after publication
    metrics: Annotated[dict[Name, SkillMetrics], Meta(max_length=64)] = {}

    def __post_init__(self) -> None:
        super().__post_init__()
        if (self.parent_version is None) != (self.parent_hash is None):
            raise ValueError("`parent_version` and `parent_hash` must be given together")
        if self.parent_version is not None and self.parent_version >= self.version:
            raise ValueError("`parent_version` must be lower than `version`")
        if self.version > 0 and self.parent_version is None:
            raise ValueError("a checkpoint after version 0 needs `parent_version`")
        _unique("files", [f.path for f in self.files])
        _unique("included", [d.blob for d in self.included])


class SkillStats(Record, tag="skill_stats", kw_only=True):
    """A worker's live progress on a shard (heartbeated while training; `net skills` shows it)."""

    skill: Name
    checkpoint_version: Version
    stats: TrainStats


class ProviderRecord(Record, tag="provider", kw_only=True):
    """A peer that serves a blob (by sha256) over its blob stream handler; short expiration, heartbeated."""

    peer_id: PeerId
    blob: Sha256
    size: Count
    addrs: Annotated[list[Multiaddr], Meta(max_length=16)] = []


class ArchivedCheckpoint(Record, tag="archived", kw_only=True):
    """An archive node's copy of one version's signed checkpoint manifests (each coordinator's signature on it, as
    it was published), so the version stays findable after its coordinators are gone and their records expired.
    Its author vouches for nothing: every reader checks each manifest's own signature and the network's quorum."""

    version: Version
    manifests: Annotated[list[Annotated[bytes, Meta(max_length=64 * 1024)]], Meta(min_length=1, max_length=32)]


AnyRecord = Union[NetworkSpec, PeerRecord, DeltaManifest, CheckpointManifest, SkillStats, ProviderRecord,
                  ArchivedCheckpoint]
RECORD_TYPES: tuple[type[Record], ...] = AnyRecord.__args__  # type: ignore[attr-defined]

# Encoded-size caps per kind. DHT values stay a few KB: a read of a key carries all its values in one message,
# which p2pd caps at 4 MiB, and every peer bounds what a key holds (`transport.storage_caps.MAX_BYTES_PER_KEY`,
# a quarter of that): the smaller the records, the more authors one key holds (1024 heartbeats of ~1 KB), and
# the fewer bytes a flood of records at their cap moves. Every peer storing or returning a value also decodes
# and verifies it whole. A checkpoint manifest, the largest, travels as a blob referenced from the DHT when it grows.
MAX_BYTES: dict[str, int] = {
    "network": 64 * 1024,
    "peer": 8 * 1024,
    "delta": 8 * 1024,
    "checkpoint": 64 * 1024,
    "skill_stats": 4 * 1024,
    "provider": 4 * 1024,
    "archived": 192 * 1024,  # the signatures of one version: several manifests of a few KB
}
MAX_RECORD_BYTES = max(MAX_BYTES.values())


def kind_of(record_type: type[Record]) -> str:
    """The tag a record type is encoded under."""
    return record_type.__struct_config__.tag  # type: ignore[return-value]


def delta_layers(manifest: CheckpointManifest, ref: DeltaRef) -> int | None:
    """The decoder layers `manifest` says its included delta `ref` was merged in (N: its first N; None: all): the
    entry's `layers` field, or in a manifest of a protocol before LAYERS_SINCE_PROTOCOL, its `layers` figure. A figure
    that is no layer count names no merge: RecordError."""
    import math

    from skillswarm.protocol.errors import RecordError

    if ref.layers is not UNSET:
        return ref.layers
    n = ref.figures.get(LEGACY_LAYERS_FIGURE) if manifest.protocol < LAYERS_SINCE_PROTOCOL else None
    if n is None:
        return None
    if not (math.isfinite(n) and n == int(n) and 1 <= n <= 1024):
        raise RecordError(f"v{manifest.version} (protocol {manifest.protocol}): a {ref.skill} delta's "
                          f"`{LEGACY_LAYERS_FIGURE}` figure is {n}, not a layer count (1-1024), so the manifest does "
                          "not say how it was merged and cannot be recomputed")
    return int(n)
