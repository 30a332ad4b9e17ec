"""The demo's method comparison: the last round's included deltas re-merged onto its parent with each `--compare`
method through the coordinator's own `round_merge`, every skill evaluated on the same held-out tasks."""

from __future__ import annotations

import logging
import typing

from skillswarm.node.demo.config import DemoConfig
from skillswarm.protocol.errors import SkillswarmError
from skillswarm.protocol.records import CheckpointManifest, MergeMethod, MergePolicy, NetworkSpec

log = logging.getLogger(__name__)


def parse_method(text: str, cfg: DemoConfig) -> MergePolicy:
    """`METHOD` or `METHOD@LAMBDA` (density from the demo's settings) as a merge policy."""
    method, _, scale = text.partition("@")
    known = typing.get_args(MergeMethod)
    try:
        value = float(scale) if scale else cfg.scale
    except ValueError:
        value = -1.0
    if method not in known or not 0 < value <= 100:
        raise SkillswarmError(f"bad merge method {text!r}: use METHOD or METHOD@LAMBDA with METHOD one of "
                              f"{', '.join(known)} and 0 < LAMBDA <= 100, e.g. task_arithmetic@0.6")
    return MergePolicy(method=method, density=cfg.density, scale=value)  # type: ignore[arg-type]


def method_label(policy: MergePolicy) -> str:
    """`ties(density=0.5, lambda=1.0)`: a method with the parameters that matter to it."""
    uses_density = policy.method in ("ties", "dare_linear", "dare_ties", "breadcrumbs")
    density = f"density={policy.density:g}, " if uses_density else ""
    return f"{policy.method}({density}lambda={policy.scale:g})"


def compare_methods(obs, spec: NetworkSpec, final: CheckpointManifest, cfg: DemoConfig) -> dict[str, dict]:
    """Re-merge the final round's deltas onto its parent with each of `cfg.compare` and evaluate every skill
    (same deltas, same held-out tasks), so one run reports retention per merge method."""
    import shutil

    from skillswarm.merge import round_merge
    from skillswarm.node.roles.coordinator import evaluate_all
    from skillswarm.node.roles.verification import merge_inputs

    parent_dir, deltas = merge_inputs(spec, obs.dht, obs.store, obs.blobs, final)
    out: dict[str, dict] = {}
    if not deltas:  # the last round rejected every delta: its checkpoint is its parent, nothing to re-merge
        log.info("v%d merged no delta: no other method to compare", final.version)
        return out
    for text in cfg.compare:
        policy = parse_method(text, cfg)
        staging = obs.store.staging()
        try:
            round_merge(parent_dir, deltas, policy, staging / "ckpt", seed=final.parent_version or 0, progress=True)
            metrics = evaluate_all(staging / "ckpt", list(cfg.skills), cfg.eval_n)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        out[method_label(policy)] = {k: m.accuracy for k, m in metrics.items()}
        log.info("re-merged v%d with %s: %s", final.version, method_label(policy), out[method_label(policy)])
    return out
