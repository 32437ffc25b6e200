"""Multi-LoRA serving against the base model alone, in one run.

Four random LoRA adapters (rank 16 on q/k/v/o/gate/up/down, built with ``peft`` around a
transformers Llama of the base model's shapes, so they fit its GGUF) are served by ``pyxllm
serve --enable-lora --lora-modules a=... b=... c=... d=...``. The base model is the embedded
SmolLM2-135M (``--model-shape 135m``) or the random model of Llama-3.2-1B's shapes as Q4_0
(``--model-shape 1b``, :mod:`model_1b`'s file, built by ``compare.py --model-shape 1b``). The
clients send random 100-token prompts, ``--output-len`` new tokens each with ``ignore_eos``:

- ``adapters``: 8 clients, the requests naming the four adapters in turn (every step mixes
  them);
- ``base, same server``: 8 clients on the base model, on that server;
- ``base, default server``: 8 clients on ``pyxllm serve`` without ``--enable-lora``;
- ``llama-server --lora``: 8 clients on llama.cpp's server with adapter ``a`` (converted to
  llama.cpp's LoRA GGUF here, see :func:`to_llama_cpp_lora`) applied to every request; skipped
  with a message when its binary is not built (``benchmarks/build_llama_server.sh``).

Printed: output tok/s, median TPOT and TTFT of the adapters' load, with each other load as a
peer (against the base loads the ratio is the adapters' share of the base's throughput; the
target is at least 0.85). Each pyxllm server first serves a warm-up load of the measured
shape (8 clients, 16 new tokens; on the LoRA server once over the adapters and once on the
base model), not reported: without it, the base model's load gave 97 tok/s as the LoRA
server's second load and 40-53 tok/s as the default server's first, in two runs of the same
code, so whichever load came first looked slow.

With ``--in-process`` it serves nothing and measures CPU time instead: one ``LLM`` (one
thread, the prefix cache off) generates for 8 prompts on the base model, then on the four
adapters in turn, ``--reps`` times after a warm-up pair, and prints the median process CPU
seconds of each and their ratio. On a machine others share, CPU time moves far less than wall
time with what else runs (a busy core stretches a step's wall time, not its instructions).
``--graph-backend`` (``auto``: the graph runner on the CPU) picks the runner of the pyxllm
engines in both modes.

The share a decode step's adapters take depends on the base's size: four rank-16 adapters of the
135M model are ~39 MB of bfloat16 a step beside ~90 MB of base weights, of the 1B model ~90 MB
beside ~630 MB, so the smallest model is the hardest case for the 0.85 target.

Run from the repository root::

    .venv/bin/python benchmarks/lora.py --threads 2 --requests-per-client 2
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/lora.py --in-process --reps 3
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/lora.py --in-process --reps 3 --model-shape 1b
"""

from __future__ import annotations

import argparse
import json
import re
import tempfile
from pathlib import Path

import model_1b
from harness import log, measure_server, pyxllm_serve_cmd, ratio_lines
from llama_server import CONTEXT_MARGIN, DEFAULT_BIN_DIR, find_binaries

from pyxllm.benchmarks.prompts import load_tokenizer, make_prompts
from pyxllm.weights.source import default_gguf_path

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
# llama.cpp's tensor names for the Llama projections (its convert_hf_to_gguf.py's mapping)
LLAMA_CPP_NAMES = {
    "q_proj": "attn_q",
    "k_proj": "attn_k",
    "v_proj": "attn_v",
    "o_proj": "attn_output",
    "gate_proj": "ffn_gate",
    "up_proj": "ffn_up",
    "down_proj": "ffn_down",
}


# Llama-3.2-1B's shapes with SmolLM2's vocabulary, as model_1b.py builds its checkpoint
LLAMA_1B = dict(model_1b.SHAPE, vocab_size=SMOLLM2["vocab_size"])


def base_model(shape: str) -> tuple[dict, Path]:
    """The base model's transformers config fields and GGUF file for ``--model-shape``.

    Raises:
        FileNotFoundError: the 1B-shaped file is not built (``compare.py --model-shape 1b``
            builds it).
    """
    if shape == "135m":
        return SMOLLM2, default_gguf_path()
    path = model_1b.DEFAULT_DIR / "model-Q4_0.gguf"
    if not path.is_file():
        raise FileNotFoundError(
            f"{path}: build it with benchmarks/compare.py --model-shape 1b --only batch-1"
        )
    return LLAMA_1B, path


def build_adapters(directory: Path, rank: int, shape: dict) -> dict[str, Path]:
    """Four random PEFT adapters of ``rank`` for a Llama of ``shape`` (config fields)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    # bfloat16: the adapters' shapes are all that is kept; the 1B base is then 2.5 GB
    base = LlamaForCausalLM._from_config(LlamaConfig(**shape), dtype=torch.bfloat16)
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


def _rope_rows(b, heads: int):
    """``b``'s rows (a q/k projection's outputs) in llama.cpp's order: its GGUF converter
    stores each head's rotary halves interleaved (``convert_hf_to_gguf.py``'s ``permute``), so
    the base model's q/k weights there are, and an adapter's B must match them."""
    out, rank = b.shape
    return b.reshape(heads, 2, out // heads // 2, rank).transpose(1, 2).reshape(out, rank)


def to_llama_cpp_lora(peft_dir: Path, path: Path, shape: dict) -> Path:
    """The PEFT adapter in ``peft_dir`` (on a Llama of ``shape``) written to ``path`` as
    llama.cpp's LoRA GGUF (what its ``convert_lora_to_gguf.py`` writes for a Llama adapter:
    ``general.type`` ``adapter``, ``adapter.type`` ``lora``, ``adapter.lora.alpha``, and per
    projection ``blk.N.<name>.weight.lora_a`` ``[r, in]`` and ``.lora_b`` ``[out, r]`` in
    float32, q/k's B rows in llama.cpp's rotary order)."""
    import gguf
    from safetensors.torch import load_file

    config = json.loads((peft_dir / "adapter_config.json").read_text())
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_string("general.type", "adapter")
    writer.add_string("adapter.type", "lora")
    writer.add_float32("adapter.lora.alpha", float(config["lora_alpha"]))
    pattern = re.compile(r".*\.layers\.(\d+)\.\w+\.(\w+)\.lora_([AB])\.weight")
    heads = {
        "q_proj": shape["num_attention_heads"],
        "k_proj": shape["num_key_value_heads"],
    }
    for key, tensor in sorted(load_file(str(peft_dir / "adapter_model.safetensors")).items()):
        layer, module, kind = pattern.fullmatch(key).groups()
        tensor = tensor.float()
        if kind == "B" and module in heads:
            tensor = _rope_rows(tensor, heads[module])
        name = f"blk.{layer}.{LLAMA_CPP_NAMES[module]}.weight.lora_{kind.lower()}"
        writer.add_tensor(name, tensor.contiguous().numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def in_process(tokenizer, output_len: int, rank: int, reps: int, graph_backend: str, shape: str):
    """``--in-process`` (see the module docstring): prints the median CPU seconds of the base
    and the adapters' generations and the base's share of the adapters' (the throughput ratio
    when the CPU is the bottleneck)."""
    import statistics
    import time

    from pyxllm import LLM, LoRARequest, SamplingParams

    prompts = [
        {"prompt_token_ids": ids}
        for _, ids in make_prompts(tokenizer, CLIENTS, 100, "random", seed=7)
    ]
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    cpu: dict[str, list[float]] = {"base": [], "adapters": []}
    config, model = base_model(shape)
    with tempfile.TemporaryDirectory() as tmp:
        paths = build_adapters(Path(tmp), rank, config)
        llm = LLM(
            str(model),
            max_model_len=512,
            kv_cache_memory=0.5,
            max_seqs_per_batch=16,
            enable_lora=True,
            max_loras=len(NAMES),
            enable_prefix_cache=False,
            graph_backend=graph_backend,
        )
        requests = [LoRARequest(name, i + 1, str(paths[name])) for i, name in enumerate(NAMES)]
        mixed = [requests[i % len(requests)] for i in range(CLIENTS)]
        for rep in range(reps + 1):  # the first pair warms up
            for label, lora in (("base", None), ("adapters", mixed)):
                start = time.process_time()
                llm.generate(prompts, params, lora_request=lora)
                if rep:
                    cpu[label].append(time.process_time() - start)
    base, adapters = (statistics.median(cpu[label]) for label in ("base", "adapters"))
    log("lora in-process:", json.dumps(cpu))
    print(
        f"4 LoRA adapters (rank {rank}) on {model.name}, {CLIENTS} prompts x {output_len} "
        f"tokens, runner "
        f"{llm.llm_engine.executor.driver.runner.name}, CPU seconds "
        f"(median of {reps}): base {base:.2f}, adapters {adapters:.2f} -> base/adapters = "
        f"{base / adapters:.2f}x"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--requests-per-client", type=int, default=2)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument(
        "--llama-server-dir",
        default=str(DEFAULT_BIN_DIR),
        help="where llama.cpp's llama-server is built (its peer is skipped without it)",
    )
    parser.add_argument(
        "--in-process",
        action="store_true",
        help="measure CPU time in this process instead of serving (see the docstring)",
    )
    parser.add_argument("--reps", type=int, default=3, help="--in-process repetitions")
    parser.add_argument(
        "--model-shape",
        choices=("135m", "1b"),
        default="135m",
        help="the base model: the embedded SmolLM2-135M or model_1b.py's Q4_0 file",
    )
    parser.add_argument(
        "--graph-backend", default="auto", help="the pyxllm engines' runner (auto, eager, graph)"
    )
    args = parser.parse_args()
    tokenizer = load_tokenizer(None)
    if args.in_process:
        in_process(
            tokenizer, args.output_len, args.rank, args.reps, args.graph_backend, args.model_shape
        )
        return
    config, model = base_model(args.model_shape)
    prompts = make_prompts(tokenizer, CLIENTS * args.requests_per_client, 100, "random", seed=7)
    warmup = make_prompts(tokenizer, 2, 32, "random", seed=8)
    # the measured shape, on other prompts (see the module docstring)
    warm = make_prompts(tokenizer, CLIENTS, 100, "random", seed=9)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        paths = build_adapters(Path(tmp), args.rank, config)
        modules = ",".join(f"{name}={path}" for name, path in paths.items())
        runner = ("--graph-backend", args.graph_backend)
        lora_cmd = pyxllm_serve_cmd(
            18951, str(model), *SIZING, *runner, "--enable-lora", "--lora-modules", modules
        )
        loads = {
            "warm-up, adapters": (warm, 16, CLIENTS, list(NAMES)),
            "warm-up, base": (warm, 16, CLIENTS),
            "adapters": (prompts, args.output_len, CLIENTS, list(NAMES)),
            "base, same server": (prompts, args.output_len, CLIENTS),
        }
        results.update(measure_server("lora", lora_cmd, 18951, args.threads, loads, warmup))
        default_cmd = pyxllm_serve_cmd(18952, str(model), *SIZING, *runner)
        plain = {
            "warm-up, default server": (warm, 16, CLIENTS),
            "base, default server": (prompts, args.output_len, CLIENTS),
        }
        results.update(measure_server("default", default_cmd, 18952, args.threads, plain, warmup))
        binaries = find_binaries(args.llama_server_dir, ("llama-server",), "llama-server --lora")
        if binaries is not None:
            lora_gguf = to_llama_cpp_lora(paths["a"], Path(tmp) / "a.gguf", config)
            slot_len = 100 + args.output_len + CONTEXT_MARGIN
            llama_cmd = [
                str(binaries["llama-server"]),
                *("-m", str(model), "--lora", str(lora_gguf)),
                *f"--host 127.0.0.1 --port 18953 -np {CLIENTS} -cb -t {args.threads}".split(),
                *("-c", str(CLIENTS * slot_len)),
            ]
            peer = {
                "warm-up, llama-server": (warm, 16, CLIENTS),
                "llama-server --lora": (prompts, args.output_len, CLIENTS),
            }
            results.update(measure_server("llama", llama_cmd, 18953, args.threads, peer, warmup))
    log("lora:", json.dumps(results))
    ours = results["adapters"]
    title = (
        f"4 LoRA adapters (rank {args.rank}) on {model.name}, {CLIENTS} clients, 100-token prompts"
    )
    for key, what, unit, lower in (
        ("output_tok_s", "output", "tok/s", False),
        ("median_tpot_ms", "median TPOT", "ms", True),
        ("median_ttft_ms", "median TTFT", "ms", True),
    ):
        names = ("base, same server", "base, default server", "llama-server --lora")
        peers = {name: results[name][key] for name in names if name in results}
        for line in ratio_lines(f"{title}, {what}", ours[key], peers, unit, lower_better=lower):
            print(line)


if __name__ == "__main__":
    main()
