"""Benchmark prompts of a given length in tokens, the same for every engine compared.

- ``random``: token ids drawn uniformly (seeded) from the ordinary vocabulary (special and
  added tokens excluded), decoded to text and re-encoded, then cut to ``input_len`` tokens
  (vLLM's random dataset does the same round trip, so a text API sees what was measured).
- ``fixed``: one English passage repeated to ``input_len`` tokens; each prompt starts with its
  own number, so no prompt shares a first KV block with another (the prefix cache does not
  turn the benchmark into a cache test) while every run sends the same texts.
"""

from __future__ import annotations

import random

PASSAGE = (
    "The history of the printing press begins long before Gutenberg. Carved wooden blocks were "
    "used "
    "to print text and images on cloth and paper for centuries, and movable type made of clay, "
    "wood "
    "and metal was tried in several places. What changed in the fifteenth century was the "
    "combination of a hand mould that cast uniform metal type, an oil-based ink that held to "
    "metal, "
    "and a screw press adapted from those used to make wine. Books became cheaper, spelling became "
    "more regular, and ideas travelled faster than ever before. "
)
DATASETS = ("random", "fixed")


def load_tokenizer(model: str | None = None):
    """The transformers tokenizer of ``model`` (a .gguf file or HF directory; ``None`` for the
    embedded SmolLM2), as ``pyxllm serve`` would load it."""
    # here, not at the top: `pyxllm bench --help` loads this module, and the loader loads
    # transformers
    from pyxllm.weights import load_hf_tokenizer, resolve_model_source

    return load_hf_tokenizer(resolve_model_source(model))


def _fit(tokenizer, ids: list[int], input_len: int) -> tuple[str, list[int]]:
    text = tokenizer.decode(ids[:input_len], skip_special_tokens=True)
    ids = tokenizer.encode(text, add_special_tokens=False)[:input_len]
    return tokenizer.decode(ids, skip_special_tokens=True), ids


def make_prompts(
    tokenizer, num_prompts: int, input_len: int, dataset: str = "random", seed: int = 0
) -> list[tuple[str, list[int]]]:
    """``num_prompts`` prompts of about ``input_len`` tokens each, as ``(text, token_ids)``.

    The token ids are the text re-encoded (without special tokens), at most ``input_len`` long.

    Raises:
        ValueError: an unknown dataset or a length below 1.
    """
    if dataset not in DATASETS:
        raise ValueError(f"--dataset: must be one of {', '.join(DATASETS)}, got {dataset!r}")
    if input_len < 1 or num_prompts < 1:
        raise ValueError(
            f"--input-len and --num-prompts must be >= 1, got {input_len} and {num_prompts}"
        )
    prompts = []
    if dataset == "random":
        rng = random.Random(seed)
        special = set(getattr(tokenizer, "all_special_ids", []))
        base = getattr(tokenizer, "vocab_size", None) or len(tokenizer)
        pool = [i for i in range(base) if i not in special]
        for _ in range(num_prompts):
            prompts.append(
                _fit(tokenizer, [rng.choice(pool) for _ in range(input_len + 8)], input_len)
            )
        return prompts
    passage = tokenizer.encode(PASSAGE, add_special_tokens=False)
    body = passage * (input_len // len(passage) + 2)
    for i in range(num_prompts):
        head = tokenizer.encode(f"Request {i}. ", add_special_tokens=False)
        prompts.append(_fit(tokenizer, head + body, input_len))
    return prompts
