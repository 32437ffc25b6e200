"""Settings that describe their own command-line flag, once, as dataclass field metadata.

A field of :class:`~pyxllm.config.EngineConfig` or of the server's ``ServerOptions`` is declared
with :func:`flag`: its default, and the :class:`Flag` of its help text, argument group, other
spellings, choices, metavar and converter. The ``pyxllm`` command builds its parsers from these
(``pyxllm.cli.dataclass_args``), docs/cli.md's tables are written from those parsers, and
:func:`from_namespace` builds the dataclass back from the parsed flags; nothing else lists a
flag.

A leaf module: it imports nothing of pyxllm (nor torch), so the config and the server's options
can use it.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

METADATA_KEY = "flag"
# the metadata of a field holding a dataclass whose own fields are flags (ServerOptions.limits)
NESTED = "nested"
# Flag.flag_default when the flag's default is the field's
FIELD_DEFAULT = "<the field's default>"


@dataclasses.dataclass(frozen=True, slots=True)
class Flag:
    """How one setting reads from the command line.

    Attributes:
        help: the help text; a trailing ``(default: ...)`` replaces the shown default (and is
            docs/cli.md's default column).
        group: the title of the argument group the flag is listed under.
        name: the flag's name (``--name`` and ``--name`` with ``_``) and the parsed attribute,
            when not the field's.
        aliases: other spellings: a bare name (vLLM's or xLLM's, ``"max_num_seqs"``) is a flag
            in both spellings and a keyword :func:`keyword_aliases` accepts; one starting with
            ``-`` (``"--tp"``, ``"-dp"``) is that spelling only. A boolean's each get a
            ``--no-`` form.
        choices: the values accepted; a callable is called when the parser is built (a
            registry's names).
        metavar: the value's placeholder in ``--help`` (default: from the type, or the choices).
        type: the converter of the text (default: from the field's annotation).
        action: argparse's action, when not ``store`` (``"append"``, ``"extend"``).
        nargs: argparse's ``nargs``, for a flag with a ``type`` that takes several values
            (``"+"``); a ``tuple[str, ...]`` field without a ``type`` takes ``"+"`` anyway.
        flag_default: the flag's default, when not the field's (:data:`FIELD_DEFAULT`).
        to_field: the field's value from the parsed namespace, when it is not the flag's value
            as parsed (an inverted ``--disable-x``, a sentinel meaning ``None``).
        also: flags without a field of their own listed right after this one (each with its
            ``name``; a bool ``flag_default`` makes a boolean flag), which ``to_field`` reads.
    """

    help: str
    group: str = "other engine flags"
    name: str | None = None
    aliases: tuple[str, ...] = ()
    choices: tuple | Callable[[], Any] | None = None
    metavar: str | None = None
    type: Callable[[str], Any] | None = None
    action: str | None = None
    nargs: str | None = None
    flag_default: Any = FIELD_DEFAULT
    to_field: Callable[[argparse.Namespace], Any] | None = None
    also: tuple[Flag, ...] = ()


def flag(
    default: Any = dataclasses.MISSING,
    *,
    default_factory: Any = dataclasses.MISSING,
    repr: bool = True,
    **spec: Any,
) -> Any:
    """A dataclass field (``dataclasses.field``) with ``default`` (or ``default_factory``) whose
    flag is ``Flag(**spec)``; ``repr=False`` keeps the value out of ``repr`` (API keys).

    Raises:
        TypeError: an unknown keyword of :class:`Flag`, or no ``help``.
    """
    return dataclasses.field(
        default=default,
        default_factory=default_factory,
        repr=repr,
        metadata={METADATA_KEY: Flag(**spec)},
    )


def nested(cls: type) -> Any:
    """A field holding a ``cls`` (a dataclass), made with its defaults, whose own :func:`flag`
    fields are flags of the outer dataclass."""
    return dataclasses.field(default_factory=cls, metadata={METADATA_KEY: NESTED})


def flag_of(field: dataclasses.Field) -> Flag | str | None:
    """The :class:`Flag` of ``field``, :data:`NESTED`, or ``None`` for a field without one."""
    return field.metadata.get(METADATA_KEY)


def flag_name(field: dataclasses.Field, spec: Flag | None) -> str:
    """The name of ``field``'s flag (and its parsed attribute)."""
    return spec.name if spec is not None and spec.name else field.name


def alias_spellings(aliases: tuple[str, ...]) -> list[str]:
    """The option strings of :attr:`Flag.aliases`: a bare name in both spellings (``--a-b``,
    ``--a_b``), a ``-``-prefixed one as it is."""
    spellings: list[str] = []
    for alias in aliases:
        if alias.startswith("-"):
            spellings.append(alias)
        else:
            dashed, underscored = "--" + alias.replace("_", "-"), "--" + alias
            spellings += [dashed] if dashed == underscored else [dashed, underscored]
    return spellings


def keyword_aliases(cls: type) -> dict[str, str]:
    """``{alias: field name}`` of the bare-name aliases of ``cls``'s fields (vLLM's names of
    ``EngineConfig`` fields, accepted by ``LLM(...)`` too)."""
    aliases = {}
    for field in dataclasses.fields(cls):
        spec = flag_of(field)
        if isinstance(spec, Flag):
            aliases |= {a: field.name for a in spec.aliases if not a.startswith("-")}
    return aliases


def flag_fields(
    cls: type, every_field: bool = False
) -> Iterator[tuple[type, dataclasses.Field, Flag | None]]:
    """``(owner, field, its Flag)`` for each field of ``cls`` with a :class:`Flag`, those of its
    :func:`nested` fields in place (``owner`` the dataclass declaring it); with
    ``every_field``, the fields without one too (their ``Flag`` ``None``)."""
    for field in dataclasses.fields(cls):
        spec = flag_of(field)
        if spec == NESTED:
            yield from flag_fields(field.default_factory, every_field)
        elif spec is not None or every_field:
            yield cls, field, spec


def from_namespace(cls: type, args: argparse.Namespace, **overrides: Any) -> Any:
    """A ``cls`` from parsed flags: each field whose flag ``args`` holds takes its value (through
    :attr:`Flag.to_field`; a list becomes a tuple), the others their defaults; ``overrides``
    win.

    Raises:
        ValueError, TypeError: as ``cls(...)`` raises them.
    """
    kwargs: dict[str, Any] = {}
    for field in dataclasses.fields(cls):
        spec = flag_of(field)
        if spec == NESTED:
            kwargs[field.name] = from_namespace(field.default_factory, args)
            continue
        if spec is None or not hasattr(args, flag_name(field, spec)):
            continue
        value = spec.to_field(args) if spec.to_field else getattr(args, flag_name(field, spec))
        kwargs[field.name] = tuple(value) if isinstance(value, list) else value
    return cls(**(kwargs | overrides))
