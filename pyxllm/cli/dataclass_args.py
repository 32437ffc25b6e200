"""argparse flags written from dataclass fields and their :func:`~pyxllm.flag_fields.flag`
metadata (:class:`~pyxllm.config.EngineConfig`'s, ``ServerOptions``').

A field's type and default come from the dataclass: ``bool`` takes ``--x``, ``--no-x``,
``--x=false`` or ``--x false`` (see :mod:`pyxllm.entrypoints.flags`; any other value is an error
naming the flag, never a silent ``True``); ``int``, ``float`` and ``str``, optionally
``| None`` (then ``none``/``auto`` read as ``None`` for numbers); ``tuple[str, ...]`` one or more
values. Its help, group, other spellings, choices and metavar come from the metadata; a field
without metadata (with ``every_field``) still becomes a flag, with generic help.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from collections.abc import Iterable

from pyxllm.entrypoints.flags import add_bool_flag, flag_names
from pyxllm.flag_fields import FIELD_DEFAULT, Flag, alias_spellings, flag_fields, flag_name
from pyxllm.flag_types import float_value, int_value, optional

OTHER_FLAGS = "other engine flags"
_CONVERTERS = {int: int_value, float: float_value, str: str}


def _field_type(hint) -> tuple[type, bool]:
    """``(base type, accepts None)`` of a dataclass field annotation; ``tuple[str, ...]`` is
    ``(tuple, ...)``, a flag taking one or more values.

    Raises:
        TypeError: a type with no command-line form.
    """
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(args) == 1:
            return _field_type(args[0])[0], True
    if origin is tuple and typing.get_args(hint)[1:] == (...,):  # items: str, or the flag's type
        return tuple, False
    if hint in (bool, *_CONVERTERS):
        return hint, False
    raise TypeError(f"config field of type {hint!r} has no command-line form; give its flag a type")


def _default(field: dataclasses.Field, spec: Flag | None):
    """The flag's default: the :class:`Flag`'s, else the field's (a tuple as a list)."""
    if spec is not None and spec.flag_default is not FIELD_DEFAULT:
        return spec.flag_default
    default = field.default
    if default is dataclasses.MISSING and field.default_factory is not dataclasses.MISSING:
        default = field.default_factory()
    if default is dataclasses.MISSING:
        raise TypeError(f"config field {field.name!r} needs a default to become a flag")
    return list(default) if isinstance(default, tuple) else default


def _add_flag(group, name: str, base: type, nullable: bool, default, spec: Flag) -> None:
    """One flag named ``name`` of a value of type ``base`` (see the module's docstring)."""
    aliases = alias_spellings(spec.aliases)
    if base is bool and spec.type is None:
        add_bool_flag(group, name, default, spec.help, aliases or None)
        return
    convert = spec.type
    if convert is None:
        convert = _CONVERTERS[str if base is tuple else base]
        if nullable and base not in (str, tuple):
            convert = optional(convert)
    choices = spec.choices() if callable(spec.choices) else spec.choices
    metavar = spec.metavar
    if metavar is None and choices is None:  # with choices, argparse shows {a,b,c}
        metavar = {str: name.upper(), int: "N", float: "X", tuple: name.upper()}[base]
    extra = {"action": spec.action} if spec.action else {}
    group.add_argument(
        *flag_names(name),
        *aliases,
        dest=name,
        type=convert,
        nargs=spec.nargs or ("+" if base is tuple and spec.type is None else None),
        default=default,
        choices=choices,
        help=spec.help,
        metavar=metavar,
        **extra,
    )


def _add_field_flags(group, owner: type, field: dataclasses.Field, spec: Flag | None) -> None:
    """The flag of ``field`` (of the dataclass ``owner``), then its :attr:`Flag.also` flags."""
    if spec is None:
        spec = Flag(help=field.name.replace("_", " "))
    base, nullable = _field_type(typing.get_type_hints(owner)[field.name])
    _add_flag(group, flag_name(field, spec), base, nullable, _default(field, spec), spec)
    for also in spec.also:
        if isinstance(also.flag_default, bool):
            _add_flag(group, also.name, bool, False, also.flag_default, also)
        else:
            _add_flag(group, also.name, str, True, also.flag_default, also)


def add_dataclass_flags(
    parser: argparse.ArgumentParser,
    classes: Iterable[type],
    order: Iterable[str] = (),
    titles: dict[str, str] | None = None,
    every_field: Iterable[type] = (),
    include: Iterable[str] | None = None,
) -> None:
    """Add a flag for each field of ``classes`` (dataclasses) that has flag metadata, and for
    every field of those in ``every_field``, in argument groups: those titled in ``order``
    first, in that order, then the others as they first appear (fields without a group last,
    under "other engine flags"); in a group, the flags follow ``classes`` and their fields.
    ``titles`` renames groups (``serve`` lists the "response flags" among its "server flags");
    with ``include``, only the groups of those (original) titles get flags.

    Raises:
        TypeError: a field whose type has no command-line form, or without a default.
    """
    titles = titles or {}
    include = None if include is None else set(include)
    groups: dict[str, list] = {title: [] for title in order}
    every_field = set(every_field)
    for cls in classes:
        for owner, field, spec in flag_fields(cls, every_field=cls in every_field):
            title = spec.group if spec is not None else OTHER_FLAGS
            if include is not None and title not in include:
                continue
            groups.setdefault(titles.get(title, title), []).append((owner, field, spec))
    if OTHER_FLAGS in groups:  # last
        groups[OTHER_FLAGS] = groups.pop(OTHER_FLAGS)
    for title, members in groups.items():
        if members:
            group = parser.add_argument_group(title)
            for owner, field, spec in members:
                _add_field_flags(group, owner, field, spec)
