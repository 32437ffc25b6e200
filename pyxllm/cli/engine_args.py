"""The engine flags: one per :class:`~pyxllm.config.EngineConfig` field (``max_seqs_per_batch``
-> ``--max-seqs-per-batch``, also spelled ``--max_seqs_per_batch``), written from the fields and
their metadata by :mod:`pyxllm.cli.dataclass_args`, so a field added later is a flag without
another edit."""

from __future__ import annotations

import argparse
import dataclasses

from pyxllm.cli.dataclass_args import add_dataclass_flags
from pyxllm.config import ENGINE_FLAG_GROUPS, EngineConfig
from pyxllm.entrypoints.flags import HelpFormatter


def add_engine_args(parser: argparse.ArgumentParser, config_cls: type = EngineConfig) -> None:
    """Add one flag per field of ``config_cls`` (a dataclass) to ``parser``, in the argument
    groups of :data:`~pyxllm.config.ENGINE_FLAG_GROUPS` (see :func:`add_dataclass_flags`)."""
    add_dataclass_flags(parser, [config_cls], order=ENGINE_FLAG_GROUPS, every_field=[config_cls])


def config_from_args(args: argparse.Namespace) -> EngineConfig:
    """The :class:`EngineConfig` of parsed flags; raises ``ValueError`` naming a bad flag."""
    names = [f.name for f in dataclasses.fields(EngineConfig)]
    kwargs = {n: getattr(args, n) for n in names if hasattr(args, n)}
    return EngineConfig.from_kwargs(
        **kwargs, kv_cache_memory_bytes=getattr(args, "kv_cache_memory_bytes", None)
    )


def engine_flags_help() -> str:
    """The engine flags section, for the top-level ``pyxllm --help``."""
    parser = argparse.ArgumentParser(
        prog="pyxllm",
        usage=argparse.SUPPRESS,
        add_help=False,
        allow_abbrev=False,
        formatter_class=HelpFormatter,
    )
    add_engine_args(parser)
    return (
        "engine flags (serve, generate, run-batch, check-device, bench):\n\n"
        + parser.format_help().strip()
    )
