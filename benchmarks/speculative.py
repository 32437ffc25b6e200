"""Speculative decoding (n-gram prompt lookup) against decoding without it, in one run.

Three workloads on the default model (``--dtype auto``, the eager runner, ``LLM.generate``,
greedy, exactly ``--output-len`` new tokens):

1. input-grounded, batch 1: rewrite or continue a passage or a code file this repository ships
   (pyxllm's own README and sources), one request at a time;
2. free-form chat prompts, batch 1;
3. 32 requests at once (the grounded and free-form prompts mixed): above
   ``disable_by_batch_size`` running sequences speculation is off, so this should not be slower.

For each: output tok/s without and with ``--speculative-config '{"method": "ngram",
"num_speculative_tokens": K}'``, the ratio, the acceptance rate (accepted / proposed draft
tokens) and the mean accepted length (tokens emitted per verifying step of a sequence). Run
from the repository root::

    .venv/bin/python benchmarks/speculative.py                 # ~4 min on 2 cores
    .venv/bin/python benchmarks/speculative.py --num-speculative-tokens 6 --result-file spec.json
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
from compare import log

ROOT = Path(__file__).resolve().parent.parent
FREE = [
    "What are three good habits for staying healthy?",
    "Write a short story about a robot who learns to paint.",
    "Explain how a rainbow forms.",
]


def grounded_prompts() -> list[str]:
    """Rewrite and continuation prompts over text this repository ships."""
    readme = (ROOT / "README.md").read_text()
    passage = readme[readme.index("pyxllm is a Python-native") :][:1200]
    code = (ROOT / "pyxllm" / "engine" / "proposers.py").read_text()[-1400:]
    return [
        f"Rewrite the following text, keeping every sentence:\n\n{passage}\n\nRewritten text:\n",
        f"Here is a Python file:\n\n{code}\n\nRepeat the file exactly, with the same code:\n",
        f"{passage}\n\nThe same text again, word for word:\n\n{passage[:200]}",
    ]


def run(prompts: list[str], output_len: int, spec: dict | None, concurrent: bool) -> dict:
    """Output tok/s of ``prompts`` (one at a time, or all at once) and the speculation counts."""
    from pyxllm import LLM, SamplingParams

    llm = LLM(speculative_config=spec, max_model_len=2048, kv_cache_memory=1.0)
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    llm.generate(["warm-up"], SamplingParams(max_tokens=4, ignore_eos=True))
    start = time.perf_counter()
    if concurrent:
        outs = llm.generate(prompts, params)
    else:
        outs = [llm.generate([p], params)[0] for p in prompts]
    elapsed = time.perf_counter() - start
    metrics = llm.llm_engine.metrics
    drafts, proposed = metrics.num_spec_drafts, metrics.num_spec_draft_tokens
    return {
        "output_tok_s": sum(len(o.outputs[0].token_ids) for o in outs) / elapsed,
        "acceptance_rate": metrics.num_spec_accepted / proposed if proposed else None,
        "mean_accepted_length": 1 + metrics.num_spec_accepted / drafts if drafts else None,
        "tokens": [list(o.outputs[0].token_ids) for o in outs],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--num-speculative-tokens", type=int, default=4)
    parser.add_argument("--prompt-lookup-min", type=int, default=None, help="default: pyxllm's")
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--result-file", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    spec = {"method": "ngram", "num_speculative_tokens": args.num_speculative_tokens}
    if args.prompt_lookup_min is not None:
        spec["prompt_lookup_min"] = args.prompt_lookup_min
        spec["prompt_lookup_max"] = max(args.prompt_lookup_min, 5)
    grounded = grounded_prompts()
    mixed = (grounded + FREE) * 6
    workloads = {
        "input-grounded, batch 1": (grounded, False, args.output_len),
        "free-form chat, batch 1": (FREE, False, args.output_len),
        f"{len(mixed[:32])} requests at once": (mixed[:32], True, args.output_len // 2),
    }
    results, lines = {}, ["", "=== output tok/s, n-gram speculation against none ==="]
    for name, (prompts, concurrent, output_len) in workloads.items():
        off = run(prompts, output_len, None, concurrent)
        on = run(prompts, output_len, spec, concurrent)
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
    log("\n".join(lines))
    if args.result_file:
        Path(args.result_file).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
