"""Command-line flags derived from a settings record, so that each setting is declared once: its field's type
gives the flag's type (a bool: ``--x/--no-x``; choices; a comma-separated list), and a ``Flag`` in its annotation
gives the help, and where they differ from the field's, the flag's name and the environment variable its default
comes from. Used by kvpoold (daemon/config.py's Config, a msgspec Struct) and kvpool-gateway (its dataclass).

A flag left out is None in the parsed namespace: ``given()`` then leaves the setting to the record's own
default, the config file or the environment."""

from __future__ import annotations

import argparse
import os
import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, get_args, get_origin


@dataclass(frozen=True)
class Flag:
    help: str = ""
    name: str = ""  # default: --the-field-name
    env: str = ""  # a variable the default is read from when the flag is not given
    metavar: str | None = None
    parse: Callable[[str], Any] | None = None  # how the text becomes the value (default: from the field's type)
    repeat: bool = False  # a list given one value per flag (--alias a --alias b), not comma-separated


@dataclass(frozen=True)
class Choices:
    """The values a text setting takes (daemon/config.py's one_of adds it): a flag offers them as choices."""

    values: tuple[str, ...]


def add_flags(parser: argparse.ArgumentParser, settings: type) -> list[str]:
    """A flag for every field of ``settings`` annotated with a Flag; returns those fields' names."""
    names = []
    for field, hint in typing.get_type_hints(settings, include_extras=True).items():
        extras = getattr(hint, "__metadata__", ())
        flag = next((m for m in extras if isinstance(m, Flag)), None)
        if flag is None:
            continue
        base = get_args(hint)[0] if extras else hint
        choices = next((m.values for m in extras if isinstance(m, Choices)), None)
        options: dict[str, Any] = {"dest": field, "help": flag.help, "default": None}
        if flag.env and (value := os.environ.get(flag.env)) is not None:
            options["default"] = value
        if flag.metavar is not None:
            options["metavar"] = flag.metavar
        if base is bool:
            options["action"] = argparse.BooleanOptionalAction
        elif choices is not None or get_origin(base) is Literal:
            options["choices"] = list(choices if choices is not None else get_args(base))
        elif flag.repeat:
            options["action"] = "append"
        elif flag.parse is not None:
            options["type"] = flag.parse
        elif get_origin(base) is list:
            options["type"] = comma_separated
        elif get_origin(base) is tuple:
            options["type"] = lambda text: tuple(comma_separated(text))
        elif base in (int, float):
            options["type"] = base
        parser.add_argument(flag.name or "--" + field.replace("_", "-"), **options)
        names.append(field)
    return names


def given(args: argparse.Namespace, names: Sequence[str]) -> dict[str, Any]:
    """The settings the command line gave (its flags, or their variables)."""
    return {name: getattr(args, name) for name in names if getattr(args, name) is not None}


def comma_separated(text: str) -> list[str]:
    """``a,b`` -> [a, b]; an empty text is an empty list (to clear the file's); an empty item is refused (``a,,b``,
    ``,``: a list that would mean less than was written)."""
    if not text.strip():
        return []
    items = [item.strip() for item in text.split(",")]
    if not all(items):
        raise argparse.ArgumentTypeError(f"{text!r} has an empty item; separate the items with single commas")
    return items
