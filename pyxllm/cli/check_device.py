"""``pyxllm check-device``: the device's logits against the CPU's and every runner's tokens
against eager's (the checks are :mod:`pyxllm.cli.device_checks`)."""

from __future__ import annotations

import argparse

from pyxllm.cli.engine_args import add_engine_args
from pyxllm.config import EngineConfig
from pyxllm.entrypoints.flags import flag_names
from pyxllm.flag_types import float_value, int_value


def add_parser(commands, formatter) -> argparse.ArgumentParser:
    """The ``check-device`` parser: its check flags, then the engine flags (float32 unless
    ``--dtype`` says otherwise)."""
    check = commands.add_parser(
        "check-device",
        help="check a device against the CPU and every runner against eager",
        allow_abbrev=False,
        formatter_class=formatter,
        description="Check the device's float32 logits against the CPU's, each runner's greedy "
        "tokens against eager's, and measure decode throughput (see docs/devices.md).",
    )
    checks = check.add_argument_group("check flags")
    checks.add_argument(
        *flag_names("max_tokens"),
        dest="max_tokens",
        type=int_value,
        default=16,
        metavar="N",
        help="greedy tokens per prompt",
    )
    checks.add_argument(
        *flag_names("batch_size"),
        dest="batch_size",
        type=int_value,
        default=8,
        metavar="N",
        help="sequences decoded together for the throughput figure",
    )
    checks.add_argument(
        "--atol",
        type=float_value,
        default=1e-2,
        help="largest |logit difference| allowed between device and CPU (float32)",
    )
    checks.add_argument(
        "--runners",
        default="eager,graph,compile",
        help="comma-separated runners to compare (those the device lacks are skipped)",
    )
    add_engine_args(check)
    check.set_defaults(dtype="float32")
    return check


def run(args: argparse.Namespace, config: EngineConfig) -> int:
    """Run the checks; 0 when all pass, else 1."""
    # here, not at the top: pyxllm --help loads no torch
    from pyxllm.cli.device_checks import run_checks

    return run_checks(args, config)
