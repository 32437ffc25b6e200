"""Speculative decoding (n-gram prompt lookup) against decoding without it, in one run.

Three workloads on the default model (``--quantization`` and ``--graph-backend`` as given,
``LLM.generate``, greedy, exactly ``--output-len`` new tokens):

1. input-grounded, batch 1: rewrite or continue a passage or a code file this repository ships
   (pyxllm's own README and sources), one request at a time;
2. free-form, batch 1: chat prompts, and an instruction to repeat a code file that the 135 M
   default model does not follow (it writes new code, so most drafts are rejected: the case
   where speculation costs the most for nothing);
3. 32 requests at once (the grounded and free-form prompts mixed, 64 new tokens), run twice
   without and twice with speculation, in the order off, on, on, off, and pooled (one run of
   each moved by ±15 %, and the first engine of a process runs slowest): above
   ``disable_by_batch_size`` running sequences speculation is off, so this should not be
   slower.

For each: output tok/s without and with ``--speculative-config '{"method": "ngram",
"num_speculative_tokens": K}'``, the ratio, the acceptance rate (accepted / proposed draft
tokens) and the mean accepted length (tokens emitted per verifying step of a sequence). With
llama-cpp-python installed (extra ``llamacpp``), the grounded workload also runs on it, on the
same GGUF and prompts, without and with its prompt-lookup decoding
(``LlamaPromptLookupDecoding``, its defaults: 2-token matches, 10 tokens proposed), its end of
sequence suppressed so that it too generates ``--output-len`` tokens; ``compare.py`` runs these
figures as its "speculative" section. Run from the repository root::

    .venv/bin/python benchmarks/speculative.py                 # ~10 min on 2 cores
    .venv/bin/python benchmarks/speculative.py --quantization none --graph-backend eager
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import os
import time
from pathlib import Path

import torch
from harness import log

ROOT = Path(__file__).resolve().parent.parent
# int4 weights (the fused W4A8 kernel reads them once for all of a verifying step's rows, and a
# row's result does not depend on the others, so verification reproduces decoding exactly) and
# decode and verification steps replayed from TorchScript traces
QUANTIZATION, GRAPH_BACKEND = "int4", "graph"
# new tokens per batch-1 request (the range is 128-256: at 256 a 450-token prompt's
# prefill is a smaller share of each request's time), and per request of the 32
OUTPUT_LEN, CONCURRENT_OUTPUT_LEN = 256, 64
# drafts per step by weights. int4 (1 + 4 = 5 rows): on the grounded prompts, 2 threads, one run
# each (2026-12-02), k = 4, 5, 7 gave 192.0, 191.5, 180.5 tok/s against 113-117 without: a
# verifying row costs ~40 % of a one-token step (int4's two-part activations double the integer
# dot products), so a longer run of drafts does not pay for its rejected tail. Unquantized
# (``--dtype auto``: bf16 here, 1 + 7 = 8 rows): k = 4, 7 gave 90.1, 105.6 tok/s against ~35
# without (a one-token step costs ~28 ms, mostly reading the weights, so each verified row is
# nearly free). In
# float32 k = 7 gave only 60.7 against 27.0: twice the bytes per weight, and its verifying
# rows cost more of a step
DRAFTS = {"int4": 4, "none": 7}
CHAT = [
    "What are three good habits for staying healthy?",
    "Write a short story about a robot who learns to paint.",
    "Explain how a rainbow forms.",
]


def passage_and_code() -> tuple[str, str]:
    """A passage of pyxllm's README and the end of one of its source files."""
    readme = (ROOT / "README.md").read_text()
    passage = readme[readme.index("pyxllm is a Python-native") :][:1200]
    return passage, (ROOT / "pyxllm" / "engine" / "proposers.py").read_text()[-1400:]


def grounded_prompts() -> list[str]:
    """Rewrite and continuation prompts whose answers copy from their text: rewrite a passage,
    continue a passage's second copy, continue a code file's second copy."""
    passage, code = passage_and_code()
    return [
        f"Rewrite the following text, keeping every sentence:\n\n{passage}\n\nRewritten text:\n",
        f"{passage}\n\nThe same text again, word for word:\n\n{passage[:200]}",
        f"{code}\n\n# The same file again:\n\n{code[:200]}",
    ]


def free_prompts() -> list[str]:
    """Chat prompts, and an instruction to repeat a code file that the 135 M default model does
    not follow (it writes new code: ungrounded output, drafts seldom accepted)."""
    code = passage_and_code()[1]
    repeat = f"Here is a Python file:\n\n{code}\n\nRepeat the file exactly, with the same code:\n"
    return [*CHAT, repeat]


def run(prompts: list[str], output_len: int, spec: dict | None, concurrent: bool, **engine) -> dict:
    """Output tok/s of ``prompts`` (one at a time, or all at once) and the speculation counts,
    on an ``LLM`` with the ``engine`` arguments (quantization, graph_backend)."""
    from pyxllm import LLM, SamplingParams

    llm = LLM(speculative_config=spec, max_model_len=2048, kv_cache_memory=1.0, **engine)
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    llm.generate(["warm-up"], SamplingParams(max_tokens=4, ignore_eos=True))
    batches = [prompts] if concurrent else [[p] for p in prompts]
    outs, seconds = [], []
    for batch in batches:
        start = time.perf_counter()
        outs += llm.generate(batch, params)
        seconds.append(time.perf_counter() - start)
    metrics = llm.llm_engine.metrics
    drafts, proposed = metrics.num_spec_drafts, metrics.num_spec_draft_tokens
    produced = [len(o.outputs[0].token_ids) for o in outs]
    return {
        "output_tok_s": sum(produced) / sum(seconds),
        "produced": sum(produced),
        "seconds": sum(seconds),
        "per_prompt_tok_s": None if concurrent else [n / t for n, t in zip(produced, seconds)],
        "acceptance_rate": metrics.num_spec_accepted / proposed if proposed else None,
        "mean_accepted_length": 1 + metrics.num_spec_accepted / drafts if drafts else None,
        "tokens": [list(o.outputs[0].token_ids) for o in outs],
    }


def run_both(
    prompts: list[str], output_len: int, spec: dict, concurrent: bool, repeats: int, **engine
) -> tuple[dict, dict]:
    """:func:`run` without and with ``spec``, ``repeats`` times each in the order off, on, on,
    off, off, on ... (so a drift over the run, or the first engine of a process starting slower,
    weighs on both sides alike); with more than one, each side's output tok/s pools its runs
    (all tokens over all seconds)."""
    sides: dict = {None: [], "spec": []}
    for r in range(repeats):
        for key in (None, "spec") if r % 2 == 0 else ("spec", None):
            sides[key].append(run(prompts, output_len, spec if key else None, concurrent, **engine))
            gc.collect()  # the engine just used frees its KV cache before the next is built
    pooled = []
    for runs in sides.values():
        first = dict(runs[0])
        first["output_tok_s"] = sum(r["produced"] for r in runs) / sum(r["seconds"] for r in runs)
        pooled.append(first)
    return pooled[0], pooled[1]


def llamacpp_grounded(prompts: list[str], output_len: int, threads: int, lookup: bool) -> dict:
    """llama-cpp-python on the default GGUF: output tok/s of ``prompts`` one at a time, greedy,
    ``output_len`` tokens each (EOS suppressed), with its prompt-lookup decoding or without."""
    import numpy as np
    from llama_cpp import Llama, LogitsProcessorList
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    from pyxllm.weights.source import default_gguf_path

    llm = Llama(
        model_path=str(default_gguf_path()),
        n_ctx=2048,
        n_threads=threads,
        n_batch=512,
        verbose=False,
        draft_model=LlamaPromptLookupDecoding() if lookup else None,
        logits_all=lookup,  # verifying drafts reads the logits of every drafted position
    )
    eos = llm.token_eos()

    def no_eos(input_ids, scores):
        scores[eos] = -np.inf
        return scores

    processors = LogitsProcessorList([no_eos])
    llm.create_completion("warm-up", max_tokens=4)
    start, produced = time.perf_counter(), 0
    for prompt in prompts:
        llm.reset()
        out = llm.create_completion(
            prompt, max_tokens=output_len, temperature=0.0, logits_processor=processors
        )
        produced += out["usage"]["completion_tokens"]
    return {"output_tok_s": produced / (time.perf_counter() - start)}


def pyxllm_figures(quantization: str = QUANTIZATION, output_len: int = OUTPUT_LEN) -> dict:
    """compare.py's speculative section, pyxllm's half: grounded batch-1 output tok/s without
    and with n-gram speculation (k = ``DRAFTS[quantization]``, pyxllm's lookup lengths), with
    ``quantization`` (``none``: unquantized weights in ``--dtype auto``) and the graph runner."""
    engine = engine_kwargs(quantization, GRAPH_BACKEND)
    off = run(grounded_prompts(), output_len, None, False, **engine)
    on = run(grounded_prompts(), output_len, spec_config(DRAFTS[quantization]), False, **engine)
    return {
        "without": off["output_tok_s"],
        "with": on["output_tok_s"],
        "acceptance_rate": on["acceptance_rate"],
        "mean_accepted_length": on["mean_accepted_length"],
        "same_tokens": on["tokens"] == off["tokens"],
    }


def llamacpp_figures(threads: int, output_len: int = OUTPUT_LEN) -> dict:
    """compare.py's speculative section, llama.cpp's half: the same prompts without and with
    its prompt-lookup decoding."""
    return {
        name: llamacpp_grounded(grounded_prompts(), output_len, threads, lookup)["output_tok_s"]
        for lookup, name in ((False, "llama.cpp"), (True, "llama.cpp prompt lookup"))
    }


def spec_config(num_speculative_tokens: int, prompt_lookup_min: int | None = None) -> dict:
    """The n-gram ``--speculative-config`` (pyxllm's lookup lengths unless given)."""
    spec = {"method": "ngram", "num_speculative_tokens": num_speculative_tokens}
    if prompt_lookup_min is not None:
        spec["prompt_lookup_min"] = prompt_lookup_min
        spec["prompt_lookup_max"] = max(prompt_lookup_min, 5)
    return spec


def engine_kwargs(quantization: str, graph_backend: str) -> dict:
    return {
        "quantization": None if quantization == "none" else quantization,
        "graph_backend": graph_backend,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output-len", type=int, default=OUTPUT_LEN, help="batch-1 requests'")
    parser.add_argument(
        "--num-speculative-tokens", type=int, default=None, help="default: 7 unquantized, else 4"
    )
    parser.add_argument("--prompt-lookup-min", type=int, default=None, help="default: pyxllm's")
    parser.add_argument("--quantization", default=QUANTIZATION, help="none, int8, int4, w8a8")
    parser.add_argument("--graph-backend", default=GRAPH_BACKEND)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--skip-llamacpp", action="store_true")
    parser.add_argument("--result-file", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    drafts = args.num_speculative_tokens or DRAFTS.get(args.quantization, DRAFTS["int4"])
    spec = spec_config(drafts, args.prompt_lookup_min)
    engine = engine_kwargs(args.quantization, args.graph_backend)
    grounded = grounded_prompts()
    mixed = (grounded + free_prompts()) * 5
    workloads = {  # prompts, all at once, new tokens, runs of each side
        "input-grounded, batch 1": (grounded, False, args.output_len, 1),
        "free-form, batch 1": (free_prompts(), False, args.output_len, 1),
        "32 requests at once": (mixed[:32], True, CONCURRENT_OUTPUT_LEN, 2),
    }
    results, lines = {}, ["", "=== output tok/s, n-gram speculation against none ==="]
    for name, (prompts, concurrent, output_len, repeats) in workloads.items():
        off, on = run_both(prompts, output_len, spec, concurrent, repeats, **engine)
        same = on.pop("tokens") == off.pop("tokens")
        results[name] = {"without": off, "with": on, "same_tokens": same}
        log(name, json.dumps(results[name]))
        rate, length = on["acceptance_rate"], on["mean_accepted_length"]
        lines.append(
            f"{name}: {off['output_tok_s']:.1f} -> {on['output_tok_s']:.1f} tok/s = "
            f"{on['output_tok_s'] / off['output_tok_s']:.2f}x; acceptance "
            f"{'n/a' if rate is None else f'{rate:.2f}'}, mean accepted length "
            f"{'n/a' if length is None else f'{length:.2f}'}; same tokens: {same}"
        )
        if not concurrent:
            lines.append(
                "  per prompt: "
                + ", ".join(
                    f"{a:.1f} -> {b:.1f} ({b / a:.2f}x)"
                    for a, b in zip(off["per_prompt_tok_s"], on["per_prompt_tok_s"])
                )
            )
    # after pyxllm's runs: llama.cpp's OpenMP runtime competes with torch's once it is loaded
    if not args.skip_llamacpp and importlib.util.find_spec("llama_cpp") is not None:
        ours = results["input-grounded, batch 1"]["with"]["output_tok_s"]
        for name, rate in llamacpp_figures(args.threads, args.output_len).items():
            results[name] = {"output_tok_s": rate}
            log(name, json.dumps(results[name]))
            lines.append(
                f"input-grounded, batch 1, {name}: {rate:.1f} tok/s -> "
                f"pyxllm with speculation / {name} = {ours / rate:.2f}x"
            )
    log("\n".join(lines))
    if args.result_file:
        Path(args.result_file).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
