"""The nano base model's recipe: every setting that changes the weights, and its hash (the cache key)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace

from skillswarm.protocol.errors import ModelError
from skillswarm.protocol.hashing import sha256_bytes

# Bump when the build code changes what a recipe produces (tokenizer, data rendering, training loop).
RECIPE_VERSION = 5


@dataclass(frozen=True)
class NanoRecipe:
    """Model shape, warm-up schedule, data mix (`weights`: each skill's share of a batch), the calibration
    that stops each skill at `target_accuracy`, and the skills (`pooled`) whose warm-up tasks come from a
    fixed pool of `pool_size` played up front (see `skillswarm.skills.nano.warmup`)."""

    seed: int = 0
    hidden_size: int = 64
    layers: int = 3
    heads: int = 4
    intermediate_size: int = 256
    max_positions: int = 512
    steps: int = 2000
    batch_size: int = 48
    lr: float = 3e-3
    warmup_steps: int = 100
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    skills: tuple[str, ...] = ("arith", "calc", "reverse", "sort")
    weights: tuple[float, ...] = (2.0, 2.0, 1.0, 1.0)
    target_accuracy: float = 0.3
    floor_accuracy: float = 0.15
    check_every: int = 25
    val_tasks: int = 64
    pooled: tuple[str, ...] = ("code",)
    pool_size: int = 1024

    def __post_init__(self) -> None:
        if len(self.skills) != len(self.weights) or not self.skills:
            raise ModelError("a nano recipe needs one weight per skill, and at least one skill")
        if self.steps < 1 or self.batch_size < 1 or self.hidden_size % self.heads:
            raise ModelError("a nano recipe needs steps >= 1, batch_size >= 1 and hidden_size divisible by heads")
        if self.pool_size < 1:
            raise ModelError("a nano recipe needs pool_size >= 1")
        if not 0 <= self.floor_accuracy <= self.target_accuracy <= 1 or self.check_every < 1 or self.val_tasks < 1:
            raise ModelError("a nano recipe needs 0 <= floor_accuracy <= target_accuracy <= 1, check_every >= 1, val_tasks >= 1")

    def with_(self, **changes: object) -> "NanoRecipe":
        """A copy with some settings changed (None values are ignored)."""
        return replace(self, **{k: v for k, v in changes.items() if v is not None})

    def as_dict(self) -> dict[str, object]:
        return {**asdict(self), "skills": list(self.skills), "weights": list(self.weights), "pooled": list(self.pooled)}

    def hash(self) -> str:
        """sha256 of the canonical JSON of the settings and the recipe version."""
        payload = json.dumps({"version": RECIPE_VERSION, **self.as_dict()}, sort_keys=True, separators=(",", ":"))
        return sha256_bytes(payload.encode())


DEFAULT_RECIPE = NanoRecipe()
# The default plus the `code` skill (`skillswarm base build --with-code`). Its warm-up plays every code
# task through the sandbox and needs the 2000-step cap: ~1.8x the default's build time on 2 cores, which
# would push a fresh `make demo` past its 15 minutes, so the default (the demo's base) leaves it out.
CODE_RECIPE = DEFAULT_RECIPE.with_(skills=(*DEFAULT_RECIPE.skills, "code"), weights=(*DEFAULT_RECIPE.weights, 2.0))
# The tests' recipe: the same code path, a fraction of the warm-up (under a minute on 2 cores), on the
# four skills the other tests use (`code` has its own tests, with its own tiny builds).
TEST_RECIPE = NanoRecipe(steps=450, batch_size=36, skills=("arith", "calc", "reverse", "sort"), weights=(4.0, 1.0, 2.0, 2.0))
