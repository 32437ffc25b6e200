"""The ``pyxllm`` command: ``serve``, ``generate``, ``run-batch``, ``check-device``, ``bench``
(serve|eval|perplexity|throughput|latency), ``env`` and ``chat``.

Flags are defined in :mod:`pyxllm.entrypoints.args`. A bad flag value exits with argparse's
usage error (status 2); an error while loading the model (a ``ValueError`` or a missing file)
prints ``error: <message>`` and exits with status 2 instead of a traceback (set
``PYXLLM_DEBUG=1`` to see the traceback).

Tensor parallelism by hand: ``serve`` (or ``generate``) with ``--node-rank i > 0`` runs only
that rank's executor (no HTTP server) until rank 0 stops it. A rank that cannot join the others,
or a server stopped by a dead worker, prints ``error: <message naming the rank>`` and exits 1.
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import sys

from pyxllm.benchmarks.eval import bench_eval
from pyxllm.benchmarks.serve import bench_serve
from pyxllm.benchmarks.throughput import bench_throughput
from pyxllm.config import EngineConfig
from pyxllm.distributed.errors import DistributedError
from pyxllm.entrypoints import collect_env
from pyxllm.entrypoints.args import config_from_args, make_arg_parser, parse_args
from pyxllm.entrypoints.openai.server_options import ServerOptions
from pyxllm.flag_fields import from_namespace
from pyxllm.sampling_params import SamplingParams

__all__ = [
    "main",
    "make_arg_parser",
    "config_from_args",
    "run_serve",
    "run_generate",
    "run_run_batch",
    "run_check_device",
    "run_bench",
    "run_env",
    "run_chat",
]


def run_worker_rank(config: EngineConfig) -> int:
    """A node with ``--node-rank`` > 0: be that TP rank until rank 0 stops it (status 0) or
    goes away (status 1)."""
    # here, not at the top: pyxllm --help loads no torch
    from pyxllm.executor.worker import run_worker

    logging.basicConfig(
        level=logging.INFO, format=f"%(levelname)s rank {config.node_rank} %(name)s: %(message)s"
    )
    return run_worker(config, config.node_rank, config.world_size, config.master_addr)


def run_serve(args: argparse.Namespace, config: EngineConfig) -> int:
    """``pyxllm serve``: run the OpenAI-compatible server until interrupted."""
    # here, not at the top: pyxllm --help loads no torch or fastapi
    from pyxllm.entrypoints.openai.api_server import run_server

    run_server(config, from_namespace(ServerOptions, args))
    # The engine is shut down; what is left is freed as the process exits. Frozen, the
    # interpreter's final garbage collection skips it (it took ~3 s of the server's exit).
    gc.freeze()
    return 0


def _flag_error(message: str) -> str:
    """Turn a ``SamplingParams`` message (``"top_p: must be ..."``) into one naming the flag."""
    name, sep, rest = message.partition(":")
    if sep and name.isidentifier():
        return f"--{name.replace('_', '-')}:{rest}"
    return message


def _sampling_params(args: argparse.Namespace, command: str):
    """``SamplingParams`` of the ``--max-tokens``, ``--temperature`` and ``--top-p`` flags; a bad
    value exits with ``command``'s usage error naming the flag."""
    try:
        return SamplingParams(
            max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p
        )
    except ValueError as exc:
        make_arg_parser().command_parsers[command].error(_flag_error(str(exc)))


def run_generate(args: argparse.Namespace, config: EngineConfig, out=None) -> int:
    """``pyxllm generate``: stream one prompt's completion to ``out`` (stdout), then a newline.

    Sampling flags not given take the model's generation_config.json values (as the server's
    unset fields do), then ``SamplingParams``' defaults.
    """
    # here, not at the top: pyxllm --help loads no torch
    from pyxllm.engine.input_processor import ChatPrompt, TextPrompt

    out = out if out is not None else sys.stdout
    params = _sampling_params(args, "generate")  # bad flag values fail before the model loads
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


def run_run_batch(args: argparse.Namespace, config: EngineConfig) -> int:
    """``pyxllm run-batch``: a file of OpenAI batch requests answered by the server's app (see
    :mod:`pyxllm.entrypoints.openai.run_batch`)."""
    # here, not at the top: pyxllm --help loads no torch or fastapi
    from pyxllm.entrypoints.openai.run_batch import run_batch_command

    return run_batch_command(args, config)


def run_check_device(args: argparse.Namespace, config: EngineConfig) -> int:
    """``pyxllm check-device``: the device and runner checks of
    :mod:`pyxllm.entrypoints.check_device`."""
    # here, not at the top: pyxllm --help loads no torch
    from pyxllm.entrypoints.check_device import run_check_device as check

    return check(args, config)


def run_bench(args: argparse.Namespace, config: EngineConfig) -> int:
    """``pyxllm bench serve|eval|perplexity|throughput|latency`` (see :mod:`pyxllm.benchmarks`)."""
    if args.bench_command == "serve":
        payload = bench_serve(args)
        return 0 if payload["completed"] else 1
    if args.bench_command == "eval":
        report = bench_eval(args)
        return 0 if report["failed"] < report["accuracy"]["Num"] else 1
    if args.bench_command == "perplexity":
        # here, not at the top: pyxllm --help loads no torch
        from pyxllm.benchmarks.perplexity import bench_perplexity

        bench_perplexity(args, config)
        return 0
    if args.bench_command == "throughput":
        bench_throughput(args, config)
    else:
        # here, not at the top: pyxllm --help loads no torch
        from pyxllm.benchmarks.latency import bench_latency

        bench_latency(args, config)
    return 0


def run_env(args: argparse.Namespace, config: EngineConfig) -> int:
    """``pyxllm env``: the report of :mod:`pyxllm.entrypoints.collect_env`."""
    return collect_env.run_env(args)


def run_chat(args: argparse.Namespace, config: EngineConfig) -> int:
    """``pyxllm chat``: the terminal chat of :mod:`pyxllm.entrypoints.chat_cli`; its sampling
    flags are checked first (as ``generate``'s)."""
    # here, not at the top: pyxllm --help loads no openai
    from pyxllm.entrypoints.chat_cli import run_chat as chat

    _sampling_params(args, "chat")
    return chat(args)


COMMANDS = {
    "serve": run_serve,
    "generate": run_generate,
    "run-batch": run_run_batch,
    "check-device": run_check_device,
    "bench": run_bench,
    "env": run_env,
    "chat": run_chat,
}


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``pyxllm`` console script; returns the exit status."""
    args, config = parse_args(argv)
    try:
        if config.node_rank > 0 and args.command in ("serve", "generate", "run-batch"):
            return run_worker_rank(config)
        return COMMANDS[args.command](args, config)
    except KeyboardInterrupt:
        return 130
    except DistributedError as exc:
        if os.environ.get("PYXLLM_DEBUG"):
            raise
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 1
    except (ValueError, FileNotFoundError) as exc:
        if os.environ.get("PYXLLM_DEBUG"):
            raise
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
