"""Image prompts: pyxllm against transformers on the same vision-language checkpoint, in one run.

The checkpoint is a random LLaVA built once in a cache directory (``--cache-dir``): LLaVA-1.5's
vision tower shape (CLIP ViT-L/14 at 336 pixels: 24 layers, width 1024, 576 image tokens) and a
language model of SmolLM2-135M's shape with its tokenizer, saved in bfloat16. Speed depends on
shapes, not values. Two figures, each engine in this process one after the other:

1. time to first token of one prompt holding one image and ~64 text tokens (``max_tokens=1``),
   the median of ``--runs`` runs, each on a new image (so the encoder always runs; no cache hit);
2. eight prompts of one new image each at once, ``--output-len`` new tokens each (EOS ignored):
   output tok/s over the whole batch (pyxllm: ``LLM.chat`` of the eight; transformers:
   ``generate`` of the eight, left-padded).

It prints each engine's figures and pyxllm's ratios. llama.cpp's ``mtmd`` server is not a peer
here: its converter does not take this random checkpoint. Run from the repository root::

    .venv/bin/python benchmarks/multimodal.py --threads 2
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from pyxllm.weights.source import default_gguf_path

QUESTION = (
    "Describe this picture in detail: the colours, the shapes, where each thing is, what the "
    "light is like, and what it might be a photograph of. Then say what you would title it."
)
TEMPLATE = (
    "{%- for message in messages %}{{- message['role'].upper() + ': ' + message['content'] + "
    "'\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{- 'ASSISTANT:' }}{%- endif %}"
)


def build_checkpoint(directory: Path) -> Path:
    """Write the random LLaVA (see the module docstring) into ``directory`` unless it is there."""
    if (directory / "config.json").exists():
        return directory
    from transformers import (
        AutoTokenizer,
        CLIPImageProcessor,
        CLIPVisionConfig,
        LlamaConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
        LlavaProcessor,
    )

    gguf = default_gguf_path()
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tok.add_tokens(["<image>"], special_tokens=True)
    tok.chat_template = TEMPLATE
    vision = dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24)
    text = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30)
    config = LlavaConfig(
        vision_config=CLIPVisionConfig(
            **vision, num_attention_heads=16, image_size=336, patch_size=14, projection_dim=768
        ),
        text_config=LlamaConfig(
            **text, vocab_size=len(tok), num_attention_heads=9, num_key_value_heads=3
        ),
        image_token_id=tok.convert_tokens_to_ids("<image>"),
        vision_feature_layer=-2,
        vision_feature_select_strategy="default",
    )
    torch.manual_seed(0)
    model = LlavaForConditionalGeneration(config).to(torch.bfloat16).eval()
    pixels = CLIPImageProcessor(size={"shortest_edge": 336}, crop_size=336)
    processor = LlavaProcessor(
        image_processor=pixels,
        tokenizer=tok,
        patch_size=14,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,
        chat_template=TEMPLATE,
    )
    model.save_pretrained(directory)
    processor.save_pretrained(directory)
    return directory


def image(seed: int) -> Image.Image:
    rng = np.random.RandomState(seed)
    return Image.fromarray((rng.rand(480, 640, 3) * 255).astype("uint8"))


def pyxllm_figures(path: Path, runs: int, output_len: int) -> dict:
    from pyxllm import LLM, SamplingParams

    llm = LLM(str(path), max_model_len=2048, kv_cache_memory=1.0)

    def chat(seed: int) -> list[dict]:
        part = {"type": "image_pil", "image_pil": image(seed)}
        return [{"role": "user", "content": [part, {"type": "text", "text": QUESTION}]}]

    first = SamplingParams(max_tokens=1, temperature=0)
    llm.chat(chat(1000), first)  # warm-up
    ttft = []
    for seed in range(runs):
        start = time.perf_counter()
        llm.chat(chat(seed), first)
        ttft.append(time.perf_counter() - start)
    batch = [chat(100 + i) for i in range(8)]
    params = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.chat(batch, params)
    elapsed = time.perf_counter() - start
    produced = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"ttft_s": statistics.median(ttft), "batch8_tok_s": produced / elapsed}


def transformers_figures(path: Path, runs: int, output_len: int) -> dict:
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    processor = AutoProcessor.from_pretrained(path)
    processor.tokenizer.padding_side = "left"
    model = LlavaForConditionalGeneration.from_pretrained(path, dtype=torch.bfloat16).eval()
    text = f"USER: <image>\n{QUESTION}\nASSISTANT:"

    def generate(seeds: list[int], new: int):
        inputs = processor(
            images=[image(s) for s in seeds], text=[text] * len(seeds), return_tensors="pt"
        )
        with torch.inference_mode():
            return (
                model.generate(
                    **inputs, max_new_tokens=new, min_new_tokens=new, do_sample=False
                ).shape[0]
                * new
            )

    generate([1000], 1)  # warm-up
    ttft = []
    for seed in range(runs):
        start = time.perf_counter()
        generate([seed], 1)
        ttft.append(time.perf_counter() - start)
    start = time.perf_counter()
    produced = generate([100 + i for i in range(8)], output_len)
    return {
        "ttft_s": statistics.median(ttft),
        "batch8_tok_s": produced / (time.perf_counter() - start),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cache-dir", default=str(Path.home() / ".cache/pyxllm/llava-bench"))
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--threads", type=int, default=None, help="default: torch's")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    path = build_checkpoint(Path(args.cache_dir))
    ours = pyxllm_figures(path, args.runs, args.output_len)
    print(f"pyxllm: {ours}", flush=True)
    theirs = transformers_figures(path, args.runs, args.output_len)
    print(f"transformers: {theirs}", flush=True)
    print(
        f"time to first token, one image + ~64 text tokens: pyxllm {ours['ttft_s']:.2f} s, "
        f"transformers {theirs['ttft_s']:.2f} s (pyxllm {theirs['ttft_s'] / ours['ttft_s']:.2f}x "
        "as fast)"
    )
    print(
        f"eight image prompts at once, {args.output_len} new tokens each: pyxllm "
        f"{ours['batch8_tok_s']:.1f} output tok/s, transformers {theirs['batch8_tok_s']:.1f} "
        f"({ours['batch8_tok_s'] / theirs['batch8_tok_s']:.2f}x)"
    )


if __name__ == "__main__":
    main()
