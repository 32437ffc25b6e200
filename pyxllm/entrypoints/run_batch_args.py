"""The flags of ``pyxllm run-batch`` (:mod:`pyxllm.entrypoints.openai.run_batch`) of its own;
its engine flags and its response flags are ``serve``'s (:mod:`pyxllm.cli.run_batch`). Kept
apart from the command, whose app (``fastapi``, ``httpx``) takes a second to import."""

from __future__ import annotations

import argparse

from pyxllm.entrypoints.flags import flag_names


def _positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text!r}")
    return value


_positive_int.__name__ = "int"  # argparse's message: "invalid int value"


def add_run_batch_args(group) -> None:
    """``-i/--input-file``, ``-o/--output-file`` and ``--max-concurrency`` (vLLM's names)."""
    group.add_argument(
        "-i",
        *flag_names("input_file"),
        dest="input_file",
        required=True,
        metavar="PATH",
        help="the requests: a JSONL file in OpenAI's batch format, one request a line "
        '({"custom_id": ..., "method": "POST", "url": "/v1/chat/completions", "body": {...}}; '
        "urls /v1/chat/completions, /v1/completions, /v1/embeddings); '-' reads stdin",
    )
    group.add_argument(
        "-o",
        *flag_names("output_file"),
        dest="output_file",
        required=True,
        metavar="PATH",
        help="the JSONL file each request's result line is appended to as it finishes (in "
        "finishing order, not the input's); the custom_ids already in it are skipped, so a "
        "stopped run resumes where it left off; '-' writes stdout (nothing skipped)",
    )
    group.add_argument(
        *flag_names("max_concurrency"),
        dest="max_concurrency",
        type=_positive_int,
        default=None,
        metavar="N",
        help="most requests in flight at once, batched together by the engine (default: "
        "--max-seqs-per-batch)",
    )
