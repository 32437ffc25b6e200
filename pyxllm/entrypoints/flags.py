"""Flag-parsing helpers shared by every ``pyxllm`` subcommand, the benchmarks' included.

A leaf module (it imports nothing of pyxllm), so :mod:`pyxllm.benchmarks` can parse its flags
the way :mod:`pyxllm.cli` does without importing the command line that imports it.
"""

from __future__ import annotations

import argparse

TRUE_WORDS = ("true", "1", "yes", "on", "t", "y")
FALSE_WORDS = ("false", "0", "no", "off", "f", "n")


def flag_names(name: str) -> list[str]:
    """Both spellings of a flag: ``flag_names("top_p") == ["--top-p", "--top_p"]``."""
    dashed, underscored = "--" + name.replace("_", "-"), "--" + name.replace("-", "_")
    return [dashed] if dashed == underscored else [dashed, underscored]


def parse_bool(text: str) -> bool:
    """Read a boolean flag value; raises ``argparse.ArgumentTypeError`` listing accepted words."""
    word = text.strip().lower()
    if word in TRUE_WORDS:
        return True
    if word in FALSE_WORDS:
        return False
    raise argparse.ArgumentTypeError(
        f"invalid boolean value {text!r}: expected one of {'/'.join(TRUE_WORDS)} or "
        f"{'/'.join(FALSE_WORDS)} (a bare flag means true; arguments that are not "
        "booleans go before it or after --)"
    )


def add_bool_flag(
    parser, name: str, default: bool, help: str, aliases: list[str] | None = None
) -> None:
    """Add ``--name [BOOL]`` and ``--no-name`` (both spellings each) storing into ``name``;
    each alias ``--other`` in ``aliases`` also gets its ``--no-other``."""
    aliases = aliases or []
    parser.add_argument(
        *flag_names(name),
        *aliases,
        dest=name,
        type=parse_bool,
        nargs="?",
        const=True,
        default=default,
        metavar="BOOL",
        help=help,
    )
    parser.add_argument(
        *flag_names("no_" + name),
        *(f"--no{'_' if '_' in alias else '-'}{alias[2:]}" for alias in aliases),
        dest=name,
        action="store_false",
        default=argparse.SUPPRESS,
        help=f"same as {flag_names(name)[0]}=false",
    )


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows a flag's default unless it is ``None`` or the help already says it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.default is None or "(default" in text:
            return text
        return super()._get_help_string(action)
