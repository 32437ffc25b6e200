"""Time to first token with the prefix cache on and off, on a shared system prompt.

``--num-requests`` requests (32) arrive at once; each is a ``--system-tokens``-token (512)
system prompt shared by all, followed by a short question of its own. The offline engine
serves them once with ``--enable-prefix-cache`` off and once on (a fresh engine each, after one
untimed warm-up request on an unrelated prompt), and the script prints each run's median TTFT
(from the burst's arrival to the request's first token) and the ratio on / off. The issue's
target is a ratio of at most 0.3.

Run from the repository root (defaults shown)::

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/prefix_cache.py \\
        --num-requests 32 --system-tokens 512 --max-tokens 8 --max-tokens-per-batch 2048

``--model`` and ``--device`` are passed to the engine (default: the embedded SmolLM2 on CPU).
"""

from __future__ import annotations

import argparse
import statistics
import time

from pyxllm.config import EngineConfig
from pyxllm.engine.input_processor import TokensPrompt
from pyxllm.engine.llm_engine import LLMEngine
from pyxllm.sampling_params import SamplingParams

SYSTEM_TEXT = (
    "You are the assistant of a large public library. You help readers find books, explain the "
    "borrowing rules, the opening hours of every branch, the fees for late returns, the events of "
    "the month and the services of the reading rooms, the archives and the computer labs. "
)


def build_prompts(engine: LLMEngine, num_requests: int, system_tokens: int) -> list[list[int]]:
    """``num_requests`` token-id prompts: the same ``system_tokens`` tokens, then a question
    each."""
    encode = engine.tokenizer.encode
    system = []
    while len(system) < system_tokens:
        system += encode(SYSTEM_TEXT, add_special_tokens=False)
    system = system[:system_tokens]
    return [
        system
        + encode(
            f"\nQuestion {i}: which branch lends book number {i * 37}?", add_special_tokens=False
        )
        for i in range(num_requests)
    ]


def median_ttft(
    config: EngineConfig, num_requests: int, system_tokens: int, max_tokens: int
) -> float:
    """Median seconds from submitting the burst to each request's first token, on a fresh engine."""
    engine = LLMEngine(config)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    process = engine.input_processor.process
    engine.add_request(process("warmup", "A short warm-up prompt.", params))
    while engine.has_unfinished_requests():
        engine.step()
    engine.kv_cache_manager.reset_prefix_cache()

    prompts = build_prompts(engine, num_requests, system_tokens)
    start = time.perf_counter()
    for i, ids in enumerate(prompts):
        engine.add_request(process(str(i), TokensPrompt(ids), params))
    ttft: dict[str, float] = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            ttft.setdefault(output.request_id, time.perf_counter() - start)
    stats = engine.stats()
    print(
        f"  prefix cache {'on ' if config.enable_prefix_cache else 'off'}: "
        f"median TTFT {statistics.median(ttft.values()):.3f} s, max {max(ttft.values()):.3f} s, "
        f"prefix-cache hits {stats['prefix_cache_hits']} of {stats['prefix_cache_queries']} tokens"
    )
    return statistics.median(ttft.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--system-tokens", type=int, default=512)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--max-tokens-per-batch", type=int, default=2048)
    parser.add_argument("--model", default=None)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    medians = {}
    for enabled in (False, True):
        config = EngineConfig(
            model=args.model,
            device=args.device,
            max_model_len=1024,
            max_tokens_per_batch=args.max_tokens_per_batch,
            kv_cache_memory=1.0,
            enable_prefix_cache=enabled,
        )
        medians[enabled] = median_ttft(
            config, args.num_requests, args.system_tokens, args.max_tokens
        )
    print(
        f"median TTFT ratio, prefix cache on / off: {medians[True] / medians[False]:.3f} "
        f"(target <= 0.3)"
    )


if __name__ == "__main__":
    main()
