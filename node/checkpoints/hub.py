"""Where a model reference lives: a local directory as given, or a Hugging Face hub id fetched into the
local hub cache (huggingface_hub is imported only then). The one hub loader: merge recipes (`merge run
--recipe`, which hands it to skillswarm.merge, a package without network code) and `net init`'s base."""

from __future__ import annotations

import re
from pathlib import Path

from skillswarm.protocol.errors import ModelError

_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]*(/[A-Za-z0-9][A-Za-z0-9_.\-]*)?$")
ALLOW_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken"]


def resolve_model(ref: str, key: str = "model", patterns: list[str] | None = None) -> Path:
    """The local directory of a model reference: `ref` itself when it exists, else the snapshot of the hub
    repository `org/name[@revision]` (downloaded once into the hub cache; offline, the cached copy; only
    the files matching `patterns`, default ALLOW_PATTERNS). ModelError naming `key` when it is neither."""
    local = Path(ref).expanduser()
    if local.exists():
        if not local.is_dir():
            raise ModelError(f"{key}: {ref} is a file, not a model directory")
        return local
    repo, _, revision = ref.partition("@")
    if not _HUB_ID.match(repo) or ref.count("@") > 1 or repo.startswith((".", "/")):
        raise ModelError(f"{key}: {ref!r} is neither a local model directory nor a Hugging Face hub id (org/name)")
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise ModelError(f"{key}: {ref!r} is not a local directory, and huggingface_hub (to fetch it from the hub) "
                         "is not installed") from None
    try:
        path = snapshot_download(repo, revision=revision or None, allow_patterns=patterns or ALLOW_PATTERNS)
    except Exception as e:  # offline, unknown repo, gated, no cached copy: say which and how to get it
        raise ModelError(f"{key}: {ref!r} is not a local directory and could not be fetched from the Hugging Face "
                         f"hub ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else 'no detail'}); download it "
                         f"first (hf download {repo}) or give its local path") from None
    return Path(path)
