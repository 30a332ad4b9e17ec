"""The skill registry: the built-ins, plus third-party skills found through the entry-point group
`skillswarm.skills` (an entry point names a Skill, or a callable that returns one)."""

from __future__ import annotations

import importlib
import logging
from dataclasses import dataclass
from importlib.metadata import entry_points

from skillswarm.protocol.errors import SkillError
from skillswarm.skills.skill import Skill

log = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "skillswarm.skills"
BUILTINS: dict[str, str] = {
    "arith": "skillswarm.skills.builtin.arith:make_skill",
    "calc": "skillswarm.skills.builtin.calc:make_skill",
    "code": "skillswarm.skills.builtin.code:make_skill",
    "reverse": "skillswarm.skills.builtin.strings:make_reverse",
    "sort": "skillswarm.skills.builtin.strings:make_sort",
}


@dataclass(frozen=True)
class SkillSource:
    """Where a skill comes from: `builtin` or the distribution that provides its entry point."""

    name: str
    target: str
    origin: str


def _plugin_sources() -> dict[str, SkillSource]:
    found: dict[str, SkillSource] = {}
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        dist = ep.dist.name if ep.dist is not None else "unknown"
        if ep.name in BUILTINS:
            log.warning("ignoring skill %r from %s: the name is taken by a built-in skill", ep.name, dist)
        elif ep.name in found:
            log.warning("ignoring skill %r from %s: %s provides it already", ep.name, dist, found[ep.name].origin)
        else:
            found[ep.name] = SkillSource(ep.name, ep.value, dist)
    return found


def sources() -> dict[str, SkillSource]:
    """Every known skill name and where it comes from, without loading any of them."""
    out = {name: SkillSource(name, target, "builtin") for name, target in BUILTINS.items()}
    out.update(_plugin_sources())
    return dict(sorted(out.items()))


def skill_names() -> list[str]:
    """Every known skill name, sorted."""
    return list(sources())


def _load(source: SkillSource) -> Skill:
    module, _, attr = source.target.partition(":")
    try:
        obj = importlib.import_module(module)
        for part in attr.split(".") if attr else []:
            obj = getattr(obj, part)
        skill = obj() if callable(obj) and not isinstance(obj, Skill) else obj
    except Exception as e:
        raise SkillError(f"skill {source.name!r} ({source.target}, from {source.origin}) failed to load: {e}") from e
    if not isinstance(skill, Skill):
        raise SkillError(f"skill {source.name!r} ({source.target}) gave a {type(skill).__name__}, not a Skill")
    if skill.name != source.name:
        raise SkillError(f"entry point {source.name!r} ({source.target}) gave a skill named {skill.name!r}; the names must match")
    return skill


def get_skill(name: str) -> Skill:
    """The skill called `name`; a clear error lists what exists when it is unknown."""
    known = sources()
    if name not in known:
        raise SkillError(f"unknown skill {name!r}; known skills: {', '.join(known)} (see `skillswarm skills list`)")
    return _load(known[name])


def list_skills() -> list[Skill]:
    """Every skill that loads, sorted by name; a plugin that fails to load is logged and skipped."""
    skills = []
    for source in sources().values():
        try:
            skills.append(_load(source))
        except SkillError as e:
            log.warning("%s", e)
    return skills


def origin(name: str) -> str:
    """`builtin` or the distribution that provides the skill."""
    return sources()[name].origin
