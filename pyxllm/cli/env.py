"""``pyxllm env``: what this process runs on (:mod:`pyxllm.entrypoints.collect_env`)."""

from __future__ import annotations

import argparse

from pyxllm.config import EngineConfig
from pyxllm.entrypoints import collect_env


def add_parser(commands, formatter) -> argparse.ArgumentParser:
    """The ``env`` parser."""
    env = commands.add_parser(
        "env",
        help="report this environment: torch, CPU features, threads, device libraries loaded",
        allow_abbrev=False,
        formatter_class=formatter,
        description="Report pyxllm, Python, the OS, torch and its build, the CPU and its "
        "features, threads, the fused CPU kernels' build, and for every device platform its "
        "package and the paths of its shared libraries loaded (as vllm collect-env).",
    )
    collect_env.add_env_args(env)
    return env


def run(args: argparse.Namespace, config: EngineConfig) -> int:
    """Print the report; 0."""
    return collect_env.run_env(args)
