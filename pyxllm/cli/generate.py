"""``pyxllm generate``: one prompt's completion, streamed to stdout."""

from __future__ import annotations

import argparse
import sys

from pyxllm.cli.engine_args import add_engine_args
from pyxllm.cli.sampling import check_sampling_args, sampling_params
from pyxllm.config import EngineConfig
from pyxllm.entrypoints.flags import add_bool_flag, flag_names
from pyxllm.flag_types import float_value, int_value


def add_parser(commands, formatter) -> argparse.ArgumentParser:
    """The ``generate`` parser: the prompt, the sampling flags, the engine flags."""
    generate = commands.add_parser(
        "generate",
        help="generate a completion for one prompt and stream it to stdout",
        allow_abbrev=False,
        formatter_class=formatter,
        description="Generate a completion for one prompt and stream it to stdout.",
    )
    generate.add_argument("prompt", help="the prompt text; '-' reads it from stdin")
    sampling = generate.add_argument_group("sampling flags")
    sampling.add_argument(
        *flag_names("max_tokens"),
        dest="max_tokens",
        type=int_value,
        default=256,
        metavar="N",
        help="most new tokens to generate",
    )
    model_default = "(default: the model's generation_config.json, else 1.0)"
    sampling.add_argument(
        *flag_names("temperature"),
        dest="temperature",
        type=float_value,
        metavar="T",
        help=f"sampling temperature; 0 is greedy {model_default}",
    )
    sampling.add_argument(
        *flag_names("top_p"),
        dest="top_p",
        type=float_value,
        metavar="P",
        help=f"nucleus sampling probability mass, in (0, 1] {model_default}",
    )
    add_bool_flag(
        sampling, "chat", True, "apply the model's chat template to the prompt as one user message"
    )
    add_engine_args(generate)
    return generate


def check(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """Bad sampling flag values fail before the model loads (``parser``'s usage error)."""
    check_sampling_args(args, parser)


def run(args: argparse.Namespace, config: EngineConfig, out=None) -> int:
    """Stream one prompt's completion to ``out`` (stdout), then a newline; 0 when done.

    Sampling flags not given take the model's generation_config.json values (as the server's
    unset fields do), then ``SamplingParams``' defaults.
    """
    # here, not at the top: pyxllm --help loads no torch
    from pyxllm.engine.input_processor import ChatPrompt, TextPrompt

    out = out if out is not None else sys.stdout
    params = sampling_params(args)
    text = sys.stdin.read() if args.prompt == "-" else args.prompt
    prompt = ChatPrompt([{"role": "user", "content": text}]) if args.chat else TextPrompt(text)

    from pyxllm.engine.llm_engine import LLMEngine  # loads torch: here, as above

    engine = LLMEngine(config)
    printed = 0
    try:
        request = engine.input_processor.process("generate-0", prompt, params)
        engine.add_request(request)
        while engine.has_unfinished_requests():
            for output in engine.step():
                text = output.outputs[0].text
                if len(text) > printed:
                    out.write(text[printed:])
                    out.flush()
                    printed = len(text)
    finally:
        engine.shutdown()  # stops the TP workers, if any
    out.write("\n")
    out.flush()
    return 0
