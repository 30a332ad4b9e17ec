"""Command-line options read from a settings dataclass: an option's default, and its help and bounds where the field
states them, come from the field, so the dataclass stays the one place each is set."""

from __future__ import annotations

import dataclasses
import typing
from typing import Any

import typer
from msgspec import Meta

from skillswarm.node.rl.config import default_of

T = typing.TypeVar("T")

# Where an option's value came from when the user gave it (by name: typer carries its own copy of click's enum).
_GIVEN = ("COMMANDLINE", "ENVIRONMENT", "PROMPT")


def _bounds(cls: type, name: str) -> dict[str, Any]:
    """typer's min/max from the field's msgspec Meta(ge=..., le=...) bounds (other bounds are checked on conversion)."""
    hint = typing.get_type_hints(cls, include_extras=True)[name]
    out: dict[str, Any] = {}
    for part in (hint, *typing.get_args(hint)):  # `Annotated[int, Meta(...)] | None` holds the Annotated in its args
        if typing.get_origin(part) is typing.Annotated:
            for meta in part.__metadata__:
                if isinstance(meta, Meta):
                    out.update({k: v for k, v in (("min", meta.ge), ("max", meta.le)) if v is not None})
    return out


def field_option(cls: type, name: str, *param_decls: str, **kwargs: Any) -> Any:
    """A typer option (for a parameter's default) whose default is dataclass `cls`'s field `name`; its help and bounds
    are the field's (`metadata["help"]`, Meta ge/le) unless `kwargs` gives them."""
    f = {x.name: x for x in dataclasses.fields(cls)}[name]
    if "help" in f.metadata:
        kwargs.setdefault("help", f.metadata["help"])
    for key, value in _bounds(cls, name).items():
        kwargs.setdefault(key, value)
    return typer.Option(default_of(cls, name), *param_decls, **kwargs)


def given(ctx: typer.Context, cls: type) -> dict[str, Any]:
    """The values of the command's options named as `cls`'s fields that the user gave (not left at their default)."""
    names = {f.name for f in dataclasses.fields(cls)}
    return {k: v for k, v in ctx.params.items()
            if k in names and getattr(ctx.get_parameter_source(k), "name", None) in _GIVEN}


def config_from(ctx: typer.Context, cls: type[T], **values: Any) -> T:
    """`cls` from the command's options named as its fields (typed by the command's parameters), with `values` for the
    fields an option does not give as they are (a converted or derived value)."""
    names = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    chosen = {k: v for k, v in ctx.params.items() if k in names}
    return cls(**(chosen | values))
