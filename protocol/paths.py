"""Where a node keeps its key, caches and state; SKILLSWARM_HOME moves all of it (tests, multi-node hosts)."""

from __future__ import annotations

import os
from pathlib import Path

import platformdirs

APP = "skillswarm"


def _home() -> Path | None:
    home = os.environ.get("SKILLSWARM_HOME")
    return Path(home).expanduser() if home else None


def config_dir() -> Path:
    """Directory for the node's identity key and settings."""
    home = _home()
    return home / "config" if home else Path(platformdirs.user_config_dir(APP))


def cache_dir(home: Path | None = None) -> Path:
    """Directory for blobs, checkpoints and built base models (safe to delete, refetched on demand); with
    `home`, that of a node whose SKILLSWARM_HOME it is."""
    home = home or _home()
    return home / "cache" if home else Path(platformdirs.user_cache_dir(APP))


def default_key_path() -> Path:
    """The node's Ed25519 key file, unless --key or SKILLSWARM_KEY says otherwise."""
    env = os.environ.get("SKILLSWARM_KEY")
    return Path(env).expanduser() if env else config_dir() / "identity.key"
