"""Command-line options derived from the pydantic models that declare them (one declaration).

``model_options`` turns a model's fields into typer options (name, type, default and help all
from the field); ``with_options`` gives a command those options, and ``collect`` builds the model
back from the parsed values. A field's ``json_schema_extra["cli"]`` renames its option; a prefix
keeps groups apart (``--partition-seed`` next to the training ``--seed``); a yes/no/default field
(``bool | None``) is ``--name/--no-name``; a group may offer some
of its model's fields only (the others keep their defaults, or values the command gives ``collect``).
"""

from __future__ import annotations

import inspect
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any, Literal, Optional, Union

import typer
from pydantic import BaseModel
from pydantic.fields import FieldInfo


@dataclass(frozen=True)
class OptionGroup:
    """The options of one model: ``key`` names the group's parameters; ``prefix`` goes in front of
    every option name except those in ``unprefixed``; ``fields`` (default: all) are the fields
    that become options; with ``negatable`` a yes/no option also has its ``--no-`` form."""

    key: str
    model: type[BaseModel]
    prefix: str = ""
    unprefixed: frozenset[str] = frozenset()
    fields: tuple[str, ...] | None = None
    negatable: bool = False

    def offered(self) -> dict[str, FieldInfo]:
        """The model's fields that are options of this group, in the model's order."""
        return {name: info for name, info in self.model.model_fields.items()
                if self.fields is None or name in self.fields}


def option_name(group: OptionGroup, field: str) -> str:
    info = group.model.model_fields[field]
    extra = info.json_schema_extra or {}
    name = str(extra.get("cli", field)).replace("_", "-")  # type: ignore[union-attr]
    name = name if field in group.unprefixed else f"{group.prefix}{name}"
    tri_state = info.annotation == (bool | None)  # yes, no, or neither (the field's own default)
    return f"--{name}/--no-{name}" if tri_state or (group.negatable and info.annotation is bool) else f"--{name}"


def cli_type(annotation: Any) -> tuple[Any, bool]:
    """(type typer parses, whether the value is a comma list) for a field's annotation."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (Union, types.UnionType):
        rest = [a for a in args if a is not type(None)]
        if any(typing.get_origin(a) is list for a in rest):
            return str, True  # one value or one per layer: "200" or "200,100"
        inner, listed = cli_type(rest[0])
        return (Optional[inner] if type(None) in args else inner), listed
    if origin is Literal:
        return annotation, False
    return annotation, False


def model_options(group: OptionGroup) -> list[inspect.Parameter]:
    parameters = []
    for field, info in group.offered().items():
        kind, listed = cli_type(info.annotation)
        default = inspect.Parameter.empty if info.is_required() else info.get_default(call_default_factory=True)
        if listed and default is not None:
            default = ",".join(map(str, default)) if isinstance(default, list) else str(default)
        option = typer.Option(option_name(group, field), help=info.description or "")
        parameters.append(inspect.Parameter(f"{group.key}__{field}", inspect.Parameter.KEYWORD_ONLY,
                                            default=default, annotation=Annotated[kind, option]))
    return parameters


def with_options(*groups: OptionGroup) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Add the groups' options to a command (after the command's own parameters)."""
    def decorate(command: Callable[..., Any]) -> Callable[..., Any]:
        own = [p for p in inspect.signature(command, eval_str=True).parameters.values()
               if p.kind != inspect.Parameter.VAR_KEYWORD]
        extra = [p for g in groups for p in model_options(g)]
        command.__signature__ = inspect.Signature(own + extra)  # type: ignore[attr-defined]
        return command
    return decorate


def parse_list(value: str, cast: type) -> object:
    """``"200"`` -> 200, ``"200,100"`` -> [200, 100] (per-layer values)."""
    items = [cast(v) for v in value.split(",") if v.strip()]
    return items[0] if len(items) == 1 else items


def collect(group: OptionGroup, values: dict[str, Any], **given: Any) -> BaseModel:
    """The group's model from a command's parsed values (comma lists split, types checked by
    pydantic) and the values ``given`` of fields that are no options of the group."""
    data = dict(given)
    for field, info in group.offered().items():
        value = values[f"{group.key}__{field}"]
        kind, listed = cli_type(info.annotation)
        if listed and isinstance(value, str):
            element = next(typing.get_args(a)[0] for a in typing.get_args(info.annotation) if typing.get_origin(a) is list)
            value = parse_list(value, element)
        data[field] = value
    return group.model.model_validate(data)
