"""The endpoint in a training run: the source of a run that plays against its own endpoint, which the RL
engine takes from its caller (`skillswarm.node.rl.run.train(..., endpoint_source=endpoint_source)`, as
`skillswarm train` passes it): harnesses (`live`, `train --serve`) or a verifiers environment
(`verifiers_env`, `train --skill verifiers:ENV_ID`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from skillswarm.node.endpoint.live import Publish, live_source
from skillswarm.node.endpoint.verifiers_env import verifiers_source
from skillswarm.skills.skill import Skill


def endpoint_source(cfg: Any, trainer: Any, run_dir: Path, device: str, skill: Skill | None, start_batch: int,
                    should_stop: Callable[[], bool]) -> tuple[Any, Publish]:
    """The source of a run of mode live or verifiers (`cfg` a TrainConfig) and the function that publishes the
    trainer's new weights to its endpoint."""
    if cfg.mode() == "verifiers":
        return verifiers_source(cfg, trainer, run_dir, device, start_batch)
    return live_source(cfg, trainer, run_dir, device, skill, start_batch, should_stop)
