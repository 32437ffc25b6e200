"""Multi-LoRA serving against the base model alone, in one run.

Four random LoRA adapters (rank 16 on q/k/v/o/gate/up/down, built with ``peft`` around a
transformers Llama of the embedded SmolLM2-135M's shapes, so they fit its GGUF) are served by
``pyxllm serve --enable-lora --lora-modules a=... b=... c=... d=...`` on the embedded model. The
clients send random 100-token prompts, ``--output-len`` new tokens each with ``ignore_eos``:

- ``adapters``: 8 clients, the requests naming the four adapters in turn (every step mixes
  them);
- ``base, same server``: 8 clients on the base model, on that server (``--enable-lora`` runs
  the eager runner);
- ``base, default server``: 8 clients on ``pyxllm serve`` with no flags (the graph runner).

Printed: output tok/s, median TPOT and TTFT of the adapters' load, with each base load as a peer
(the ratio is the adapters' share of the base's throughput; the target is at least 0.85).

Run from the repository root::

    .venv/bin/python benchmarks/lora.py --threads 2 --requests-per-client 2
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from harness import log, measure_server, pyxllm_serve_cmd, ratio_lines

from pyxllm.benchmarks.prompts import load_tokenizer, make_prompts

# SmolLM2-135M-Instruct's shapes (the embedded GGUF's)
SMOLLM2 = dict(
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    tie_word_embeddings=True,
)
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
NAMES = ("a", "b", "c", "d")
CLIENTS = 8
SIZING = "--max-model-len 512 --kv-cache-memory 0.5 --max-seqs-per-batch 16".split()


def build_adapters(directory: Path, rank: int) -> dict[str, Path]:
    """Four random PEFT adapters of ``rank`` for the embedded model's shapes."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    base = LlamaForCausalLM(LlamaConfig(**SMOLLM2))
    paths = {}
    for i, name in enumerate(NAMES):
        torch.manual_seed(i)
        model = get_peft_model(
            base, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=TARGETS)
        )
        with torch.no_grad():
            for param_name, param in model.named_parameters():
                if "lora_" in param_name:
                    param.copy_(torch.randn_like(param) * 0.01)
        model.save_pretrained(directory / name)
        base = model.unload()
        paths[name] = directory / name
    return paths


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--requests-per-client", type=int, default=2)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--rank", type=int, default=16)
    args = parser.parse_args()
    tokenizer = load_tokenizer(None)
    prompts = make_prompts(tokenizer, CLIENTS * args.requests_per_client, 100, "random", seed=7)
    warmup = make_prompts(tokenizer, 2, 32, "random", seed=8)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        paths = build_adapters(Path(tmp), args.rank)
        modules = ",".join(f"{name}={path}" for name, path in paths.items())
        lora_cmd = pyxllm_serve_cmd(18951, *SIZING, "--enable-lora", "--lora-modules", modules)
        loads = {
            "adapters": (prompts, args.output_len, CLIENTS, list(NAMES)),
            "base, same server": (prompts, args.output_len, CLIENTS),
        }
        results.update(measure_server("lora", lora_cmd, 18951, args.threads, loads, warmup))
        default_cmd = pyxllm_serve_cmd(18952, *SIZING)
        plain = {"base, default server": (prompts, args.output_len, CLIENTS)}
        results.update(measure_server("default", default_cmd, 18952, args.threads, plain, warmup))
    log("lora:", json.dumps(results))
    ours = results["adapters"]
    title = f"4 LoRA adapters (rank {args.rank}), {CLIENTS} clients, 100-token prompts"
    for key, what, unit, lower in (
        ("output_tok_s", "output", "tok/s", False),
        ("median_tpot_ms", "median TPOT", "ms", True),
        ("median_ttft_ms", "median TTFT", "ms", True),
    ):
        peers = {name: results[name][key] for name in ("base, same server", "base, default server")}
        for line in ratio_lines(f"{title}, {what}", ours[key], peers, unit, lower_better=lower):
            print(line)


if __name__ == "__main__":
    main()
