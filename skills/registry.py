"""The skill registry: the built-ins, plus third-party skills found through the entry-point group
`skillswarm.skills` (an entry point names a Skill, or a callable that returns one).

A plugin skill's version (its `Skill.version` and its distribution's version) is what a nano base
recipe and a network file pin, so that a changed plugin never reuses a stale base and never trains a
network's shard with different tasks or rewards than its other nodes."""

from __future__ import annotations

import importlib
import logging
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import Iterable

from skillswarm.protocol.errors import SkillError
from skillswarm.protocol.records import NetworkSpec
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
    origin_version: str = ""  # the distribution's version (empty for built-ins)


def _plugin_sources() -> dict[str, SkillSource]:
    found: dict[str, SkillSource] = {}
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        dist = ep.dist.name if ep.dist is not None else "unknown"
        dist_version = ep.dist.version if ep.dist is not None else ""
        if ep.name in BUILTINS:
            log.warning("ignoring skill %r from %s: the name is taken by a built-in skill", ep.name, dist)
        elif ep.name in found:
            log.warning("ignoring skill %r from %s: %s provides it already", ep.name, dist, found[ep.name].origin)
        else:
            found[ep.name] = SkillSource(ep.name, ep.value, dist, dist_version)
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


@dataclass(frozen=True)
class PluginVersion:
    """What pins a plugin skill: its `Skill.version` and the distribution (and version) that provides it."""

    skill: str
    version: str
    distribution: str
    distribution_version: str

    def describe(self) -> str:
        """For messages: `skill count_vowels version 0.1.0 from distribution skillswarm-vowels-skill`
        (the distribution's version added when it differs from the skill's)."""
        same = self.distribution_version in ("", self.version)
        dist = self.distribution if same else f"{self.distribution} {self.distribution_version}"
        return f"skill {self.skill} version {self.version} from distribution {dist}"

    def versions(self) -> str:
        """`0.1.0`, or `0.1.0 (distribution 0.1.1)` when the distribution's version differs."""
        same = self.distribution_version in ("", self.version)
        return self.version if same else f"{self.version} (distribution {self.distribution_version})"

    def requirement(self) -> str:
        """What to pip install to get exactly this plugin."""
        return f"{self.distribution}=={self.distribution_version}" if self.distribution_version else self.distribution


def is_builtin(name: str) -> bool:
    """Whether `name` is a built-in skill (part of skillswarm itself, versioned with it)."""
    return name in BUILTINS


def plugin_names() -> list[str]:
    """Every installed third-party skill name, sorted (without loading them)."""
    return sorted(_plugin_sources())


def _pin(skill: Skill, source: SkillSource) -> PluginVersion:
    return PluginVersion(skill.name, skill.version, source.origin, source.origin_version)


def plugin_version(skill: Skill) -> PluginVersion | None:
    """The pin of a loaded plugin skill; None for a built-in."""
    source = sources().get(skill.name)
    return None if source is None or source.origin == "builtin" else _pin(skill, source)


def check_installed(network: str, expected: PluginVersion) -> None:
    """Raise a SkillError saying what to install when this machine lacks the plugin `network` pins, or
    has another version of it (every node of a network must train and grade a shard the same way)."""
    wanted = f"network {network} trains {expected.describe()}"
    source = sources().get(expected.skill)
    if source is None or source.origin == "builtin":
        raise SkillError(f"{wanted}; this machine does not have it: pip install '{expected.requirement()}'")
    found = _pin(_load(source), source)
    if found != expected:
        have = found.describe() if found.distribution != expected.distribution else found.versions()
        raise SkillError(f"{wanted}; this machine has {have}: pip install '{expected.requirement()}'")


def check_network(spec: NetworkSpec, names: Iterable[str]) -> None:
    """Check every plugin skill of `names` that the network file pins (`skill_versions`) against this machine."""
    for name in names:
        pin = spec.plugin_versions().get(name)
        if pin is not None:
            check_installed(spec.network, PluginVersion(name, pin.version, pin.distribution, pin.distribution_version))
