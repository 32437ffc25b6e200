"""llama.cpp's perplexity of a GGUF on the windows ``pyxllm bench perplexity`` scores, through
llama-cpp-python: the peer column of the quality table of docs/evaluation.md.

Same tokens, windows and scoring half as ``pyxllm bench perplexity`` and llama.cpp's
``llama-perplexity`` (``tools/perplexity/perplexity.cpp``): the text (``--file``, else GSM8K's
train answers) is tokenized by pyxllm's tokenizer of the GGUF and cut by
:func:`pyxllm.benchmarks.perplexity.text_windows`; each window is evaluated alone from an empty
KV cache with ``logits_all=True`` (one decode of ``--ctx`` tokens), and its logits at positions
``ctx/2 .. ctx-2`` score the tokens after them, in float64 log-softmax;
PPL = exp(mean NLL) with llama.cpp's uncertainty (:class:`pyxllm.benchmarks.ppl_stats.Perplexity`).
It also reports whether llama.cpp's own tokenizer (``common_tokenize(text, add_special=true)``)
gives the same tokens for the text.

Needs llama-cpp-python (``.venv/bin/pip install 'pyxllm[llamacpp]'``). Run it in a process of
its own: llama.cpp's OpenMP runtime competes with torch's. From the repository root::

    OMP_NUM_THREADS=1 taskset -c 1 .venv/bin/python benchmarks/perplexity_llamacpp.py \\
        --chunks 20 --threads 1
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np
import torch

from pyxllm.benchmarks.perplexity import load_text, text_windows
from pyxllm.benchmarks.ppl_stats import Perplexity
from pyxllm.benchmarks.prompts import load_tokenizer
from pyxllm.weights.source import default_gguf_path


def llamacpp_perplexity(path, windows: list[list[int]], threads: int) -> tuple[float, float]:
    """``(PPL, uncertainty)`` of llama.cpp on ``windows`` (equal lengths), printing the running
    value after each as ``llama-perplexity`` does."""
    from llama_cpp import Llama

    ctx = len(windows[0])
    llm = Llama(
        model_path=str(path),
        n_ctx=ctx,
        n_batch=ctx,
        n_ubatch=ctx,
        n_threads=threads,
        n_threads_batch=threads,
        logits_all=True,
        verbose=False,
    )
    ppl, first = Perplexity(), ctx // 2
    for i, window in enumerate(windows):
        llm.reset()  # n_tokens = 0: eval() clears the KV cache from there
        llm.eval(window)
        logits = torch.from_numpy(np.array(llm.scores[first : ctx - 1], dtype=np.float64))
        ppl.add_window(logits.log_softmax(dim=-1), torch.tensor(window[first + 1 :]))
        print(f"[{i + 1}]{ppl.value()[0]:.4f},", end="", flush=True)
    print()
    return ppl.value()


def same_tokens(path, text: str, tokens: list[int]) -> str:
    """Whether llama.cpp's tokenizer gives ``tokens`` for ``text`` (with special tokens)."""
    from llama_cpp import Llama

    vocab = Llama(model_path=str(path), vocab_only=True, verbose=False)
    theirs = vocab.tokenize(text.encode("utf-8"), add_bos=True, special=False)
    if theirs == tokens:
        return f"llama.cpp's tokenizer gives the same {len(tokens)} tokens"
    at = next((i for i, (a, b) in enumerate(zip(theirs, tokens)) if a != b), len(tokens))
    return f"llama.cpp's tokenizer differs from token {at} ({len(theirs)} vs {len(tokens)} tokens)"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="a .gguf file (default: the embedded one)")
    parser.add_argument("--file", default=None, help="the text (default: GSM8K's train answers)")
    parser.add_argument("--ctx", type=int, default=512, help="tokens per window")
    parser.add_argument("--chunks", type=int, default=None, help="the first N windows")
    parser.add_argument("--threads", type=int, default=1, help="llama.cpp's threads")
    parser.add_argument("--result-file", default=None, help="write the figures as JSON here")
    args = parser.parse_args()
    path = args.model or default_gguf_path()
    tokenizer, text = load_tokenizer(args.model), load_text(args.file)
    windows, num_tokens, bos = text_windows(tokenizer, text, args.ctx, args.chunks)
    print(same_tokens(path, text, list(tokenizer.encode(text))))
    print(
        f"{num_tokens} tokens, {len(windows)} windows of {args.ctx}, BOS first: {bos is not None}"
    )
    start = time.perf_counter()
    value, error = llamacpp_perplexity(path, windows, args.threads)
    elapsed = time.perf_counter() - start
    print(f"Final estimate: PPL = {value:.4f} +/- {error:.5f} ({elapsed:.1f} s)")
    if args.result_file:
        report = {"model": str(path), "ctx": args.ctx, "chunks": len(windows), "ppl": value}
        with open(args.result_file, "w") as f:
            json.dump(report | {"ppl_unc": error, "elapsed_s": elapsed}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
