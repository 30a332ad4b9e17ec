"""What `--skill verifiers:ENV_ID` needs, checked without importing verifiers or torch: light enough for the
training settings' validation and the CLI."""

from __future__ import annotations

import importlib.util

VERIFIERS_PREFIX = "verifiers:"
INSTALL_EXTRA = "pip install 'skillswarm[verifiers]'"


def env_id_of(skill: str) -> str | None:
    """ENV_ID of `verifiers:ENV_ID`, else None."""
    return skill[len(VERIFIERS_PREFIX):] if skill.startswith(VERIFIERS_PREFIX) else None


def module_name(env_id: str) -> str:
    """The module verifiers imports for an environment id (hub ids `owner/name@version` install as `name`)."""
    return env_id.rsplit("/", 1)[-1].split("@", 1)[0].replace("-", "_").lower()


def install_hint(env_id: str) -> str:
    return (f"install the environment package first (pip install {module_name(env_id).replace('_', '-')}, "
            f"or `prime env install {env_id}` for a hub environment)")


def verifiers_problems(skill: str) -> list[str]:
    """What keeps `--skill verifiers:ENV_ID` from running, found without importing verifiers (for validate)."""
    env_id = env_id_of(skill)
    if env_id is None:
        return []
    if not env_id.strip():
        return ["--skill verifiers:ENV_ID needs an environment id"]
    if importlib.util.find_spec("verifiers") is None:
        return [f"--skill {skill} needs the verifiers package: {INSTALL_EXTRA} (Python >= 3.11)"]
    module = module_name(env_id)
    try:
        found = importlib.util.find_spec(module) is not None or \
            importlib.util.find_spec(f"verifiers.v1.tasksets.{module}") is not None
    except (ImportError, ValueError):
        found = False
    return [] if found else [f"verifiers environment {env_id!r} is not installed (no module {module!r}): "
                             f"{install_hint(env_id)}"]
