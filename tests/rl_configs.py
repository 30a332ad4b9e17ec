"""The RL engine's nested configs for tests, built the one way the engine builds them: from a TrainConfig
(whose defaults are the only ones), with some settings changed."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from skillswarm.node.rl.config import LossConfig, OptimConfig, RolloutConfig, TrainConfig


def train_config(**changes: Any) -> TrainConfig:
    """A TrainConfig for an unused model directory, with `changes`."""
    return TrainConfig(model_dir=Path("unused-model"), skill="arith", **changes)


def loss_config(**changes: Any) -> LossConfig:
    """The loss settings of a run with `changes` (TrainConfig names: loss, eps_low, max_new_tokens, ...)."""
    return train_config(**changes).loss_config()


def optim_config(**changes: Any) -> OptimConfig:
    """The trainer's settings of a run with `changes`."""
    return train_config(**changes).optim_config()


def rollout_config(**changes: Any) -> RolloutConfig:
    """The rollout settings of a run with `changes` (batch: groups per generation batch)."""
    return train_config(**changes).rollout_config()
