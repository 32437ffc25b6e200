"""compare.py's ``--model-shape 1b`` sections: pyxllm against llama.cpp on a model of
Llama-3.2-1B's shapes, from the files a user downloads.

Speed depends on shapes, not values, so the model is random: Llama-3.2-1B's shapes (16 layers,
hidden 2048, 32 query and 8 KV heads, MLP 8192, tied embeddings, RoPE base 500000) with SmolLM2's
tokenizer (49152 tokens, from the embedded model), normal(0, 0.02) weights from a fixed seed.
It is built once in a cache directory (``--model-1b-dir``; about 5 GB) as

- ``safetensors/``: a transformers checkpoint in bfloat16 (``config.json``, ``model.safetensors``,
  the tokenizer), and
- ``model-F16.gguf``: the same tensors as llama.cpp's converter writes them (float16; the query
  and key rows permuted to GGUF's rotary layout, the tokenizer's metadata copied from the
  embedded model's GGUF), then ``model-Q4_0.gguf``, ``model-Q8_0.gguf`` and ``model-Q4_K_M.gguf``
  by llama.cpp's ``llama-quantize`` (``benchmarks/build_llama_server.sh`` builds it).

Sections (``--only`` / ``--skip`` names), each on every ``--model-1b-types`` file:

- ``batch-1``: decode tok/s of one sequence (``pyxllm bench latency``, a 32-token prompt) with no
  flags, against llama-bench ``tg`` on the same file; and on the safetensors checkpoint with no
  flags and with the fastest flags (``--quantization int4 --graph-backend graph``).
- ``llama-server``: ``pyxllm serve FILE`` with no flags against ``llama-server`` on the same file
  (``--llama-server-workloads``, by default 100-token prompts with 8 and 32 clients and
  1000-token prompts with 8), with pyxllm's resident memory after start-up (measured by
  ``harness.measure_server``) against the file's size and the KV budget.
- ``busy-core``: batch-1 decode quiet and with one core kept busy by another process, pyxllm
  with no flags against llama-bench (``busy_core.py``), on the first file.

Run from the repository root (a long run on 2 cores: ``--requests-per-client 1`` shortens it)::

    benchmarks/build_llama_server.sh
    .venv/bin/python benchmarks/compare.py --model-shape 1b --threads 2 --requests-per-client 1
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import numpy as np

SECTIONS = ("batch-1", "llama-server", "busy-core")
FILE_TYPES = ("Q4_0", "Q8_0", "Q4_K_M")
DEFAULT_TYPES = "Q4_0,Q4_K_M"
DEFAULT_DIR = (
    Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "pyxllm" / "model-1b"
)
# Llama-3.2-1B's shapes (its config.json) with SmolLM2's vocabulary
SHAPE = {
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_hidden_layers": 16,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "rope_theta": 500000.0,
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 8192,
    "tie_word_embeddings": True,
}
# the fastest flags on a float checkpoint at batch 1 (docs/performance.md)
FASTEST_FLAGS = ("--quantization", "int4", "--graph-backend", "graph")
SEED = 1234
# repetitions of each batch-1 measurement (pyxllm bench latency --num-iters, llama-bench -r)
ITERS = 3


def parse_types(text: str) -> list[str]:
    """``"Q4_0,Q4_K_M"`` -> ``["Q4_0", "Q4_K_M"]``.

    Raises:
        ValueError: naming ``--model-1b-types``, for a type not in :data:`FILE_TYPES`.
    """
    types = [t for t in text.split(",") if t]
    unknown = sorted(set(types) - set(FILE_TYPES))
    if unknown or not types:
        raise ValueError(f"--model-1b-types: choose from {', '.join(FILE_TYPES)}, got {text!r}")
    return types


def _tensors(vocab: int):
    """``(HF name, GGUF name, float32 array, to_gguf)`` of every weight, from :data:`SEED`;
    ``to_gguf`` (None: the array as it is) permutes the query and key rows for the GGUF as
    llama.cpp's converter does (``LlamaModel.permute``: each head's two rotary halves
    interleaved), so both files hold one model."""
    rng = np.random.default_rng(SEED)
    hidden, inter = SHAPE["hidden_size"], SHAPE["intermediate_size"]
    heads, kv_heads = SHAPE["num_attention_heads"], SHAPE["num_key_value_heads"]
    head_dim = hidden // heads

    def normal(*shape):
        return (rng.standard_normal(shape, dtype=np.float32) * 0.02).astype(np.float32)

    def rotary_rows(w, n_head):
        return w.reshape(n_head, 2, head_dim // 2, -1).swapaxes(1, 2).reshape(w.shape)

    yield "model.embed_tokens.weight", "token_embd.weight", normal(vocab, hidden), None
    for i in range(SHAPE["num_hidden_layers"]):
        hf, gg = f"model.layers.{i}.", f"blk.{i}."
        ones = np.ones(hidden, dtype=np.float32)
        yield hf + "input_layernorm.weight", gg + "attn_norm.weight", ones, None
        yield (
            hf + "self_attn.q_proj.weight",
            gg + "attn_q.weight",
            normal(hidden, hidden),
            lambda w: rotary_rows(w, heads),
        )
        yield (
            hf + "self_attn.k_proj.weight",
            gg + "attn_k.weight",
            normal(kv_heads * head_dim, hidden),
            lambda w: rotary_rows(w, kv_heads),
        )
        yield (
            hf + "self_attn.v_proj.weight",
            gg + "attn_v.weight",
            normal(kv_heads * head_dim, hidden),
            None,
        )
        yield (
            hf + "self_attn.o_proj.weight",
            gg + "attn_output.weight",
            normal(hidden, hidden),
            None,
        )
        yield hf + "post_attention_layernorm.weight", gg + "ffn_norm.weight", ones, None
        yield hf + "mlp.gate_proj.weight", gg + "ffn_gate.weight", normal(inter, hidden), None
        yield hf + "mlp.up_proj.weight", gg + "ffn_up.weight", normal(inter, hidden), None
        yield hf + "mlp.down_proj.weight", gg + "ffn_down.weight", normal(hidden, inter), None
    yield "model.norm.weight", "output_norm.weight", np.ones(hidden, dtype=np.float32), None


def _write_checkpoints(directory: Path) -> None:
    """The safetensors checkpoint and ``model-F16.gguf`` in ``directory``."""
    import gguf
    import torch
    from safetensors.torch import save_file
    from transformers import LlamaConfig

    from pyxllm.benchmarks.prompts import load_tokenizer
    from pyxllm.weights.source import default_gguf_path

    tokenizer = load_tokenizer(None)
    vocab = len(tokenizer)
    hf_dir = directory / "safetensors"
    hf_dir.mkdir(parents=True, exist_ok=True)
    config = LlamaConfig(
        vocab_size=vocab,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        torch_dtype="bfloat16",
        **SHAPE,
    )
    config.save_pretrained(hf_dir)
    tokenizer.save_pretrained(hf_dir)

    reader = gguf.GGUFReader(str(default_gguf_path()))
    writer = gguf.GGUFWriter(str(directory / "model-F16.gguf.part"), "llama")
    writer.add_name("random Llama-3.2-1B shapes")
    writer.add_block_count(SHAPE["num_hidden_layers"])
    writer.add_context_length(SHAPE["max_position_embeddings"])
    writer.add_embedding_length(SHAPE["hidden_size"])
    writer.add_feed_forward_length(SHAPE["intermediate_size"])
    writer.add_head_count(SHAPE["num_attention_heads"])
    writer.add_head_count_kv(SHAPE["num_key_value_heads"])
    writer.add_rope_freq_base(SHAPE["rope_theta"])
    writer.add_layer_norm_rms_eps(SHAPE["rms_norm_eps"])
    writer.add_rope_dimension_count(SHAPE["hidden_size"] // SHAPE["num_attention_heads"])
    writer.add_vocab_size(vocab)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    for key, field in reader.fields.items():  # SmolLM2's tokenizer, as the embedded GGUF has it
        if key.startswith("tokenizer."):
            sub_type = field.types[1] if len(field.types) > 1 else None
            writer.add_key_value(key, field.contents(), field.types[0], sub_type)

    hf_tensors = {}
    for hf_name, gguf_name, array, to_gguf in _tensors(vocab):
        hf_tensors[hf_name] = torch.from_numpy(array).to(torch.bfloat16)
        # the GGUF from the bfloat16 values, so both files hold the same numbers
        values = hf_tensors[hf_name].float().numpy()
        values = to_gguf(values) if to_gguf else values
        writer.add_tensor(gguf_name, values if values.ndim == 1 else values.astype(np.float16))
    save_file(hf_tensors, str(hf_dir / "model.safetensors"), metadata={"format": "pt"})
    del hf_tensors
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    (directory / "model-F16.gguf.part").rename(directory / "model-F16.gguf")


def build(directory: Path, quantize: Path, types: list[str], log) -> dict[str, Path]:
    """The checkpoints in ``directory`` (built where missing): ``{"safetensors": dir, "Q4_0":
    file, ...}`` for ``types``.

    Raises:
        RuntimeError: ``llama-quantize`` failed (its output's tail in the message).
    """
    directory.mkdir(parents=True, exist_ok=True)
    f16 = directory / "model-F16.gguf"
    if not (f16.is_file() and (directory / "safetensors" / "model.safetensors").is_file()):
        log(f"building the random 1B-shaped checkpoint in {directory} (minutes) ...")
        _write_checkpoints(directory)
    paths = {"safetensors": directory / "safetensors"}
    for qtype in types:
        path = directory / f"model-{qtype}.gguf"
        if not path.is_file():
            log(f"llama-quantize {f16.name} -> {path.name} ...")
            done = subprocess.run(
                [str(quantize), str(f16), str(path) + ".part", qtype],
                capture_output=True,
                text=True,
                check=False,
            )
            if done.returncode != 0:
                raise RuntimeError(
                    f"llama-quantize {qtype} exited with status {done.returncode}: "
                    f"{(done.stderr or done.stdout)[-2000:]}"
                )
            Path(str(path) + ".part").rename(path)
        paths[qtype] = path
    return paths


def batch1(paths: dict[str, Path], binaries: dict, types, output_len, iters, threads, log):
    """The ``batch-1`` section: ``{row name: decode tok/s}``."""
    from busy_core import llama_bench_decode, pyxllm_decode

    rows = {}
    for qtype in types:
        model = str(paths[qtype])
        rows[f"pyxllm {qtype} (no flags)"] = pyxllm_decode(model, output_len, iters, threads, {})
        rows[f"llama-bench {qtype}"] = llama_bench_decode(
            binaries["llama-bench"], model, output_len, iters, threads
        )
        log("batch-1:", json.dumps(rows))
    model = str(paths["safetensors"])
    rows["pyxllm safetensors (no flags)"] = pyxllm_decode(model, output_len, iters, threads, {})
    rows["pyxllm safetensors (int4 + graph)"] = pyxllm_decode(
        model, output_len, iters, threads, {}, FASTEST_FLAGS
    )
    log("batch-1:", json.dumps(rows))
    return rows


def busy(path: Path, binaries: dict, output_len, iters, threads, log) -> dict:
    """The ``busy-core`` section: ``{"pyxllm": {"quiet": tok/s, "busy": tok/s}, "llama-bench":
    ...}`` on ``path``."""
    from busy_core import busy_core, llama_bench_decode, pyxllm_decode

    rows = {"pyxllm": {}, "llama-bench": {}}
    for state in ("quiet", "busy"):
        with busy_core(state == "busy"):
            rows["pyxllm"][state] = pyxllm_decode(str(path), output_len, iters, threads, {})
            rows["llama-bench"][state] = llama_bench_decode(
                binaries["llama-bench"], str(path), output_len, iters, threads
            )
        log(f"busy-core {state}:", json.dumps(rows))
    return rows


def ratio_rows(results: dict, types, output_len: int, ratio_lines) -> list[str]:
    """The summary lines of the three sections, with pyxllm's ratios."""
    lines = []
    b1 = results.get("batch-1", {})
    for qtype in types:
        if f"pyxllm {qtype} (no flags)" in b1:
            lines += ratio_lines(
                f"1B batch-1 decode, {qtype}, no flags",
                b1[f"pyxllm {qtype} (no flags)"],
                {f"llama-bench {qtype} tg{output_len}": b1.get(f"llama-bench {qtype}")},
                "tok/s",
            )
    if "pyxllm safetensors (int4 + graph)" in b1:
        lines += ratio_lines(
            "1B batch-1 decode, safetensors, int4 + graph",
            b1["pyxllm safetensors (int4 + graph)"],
            {
                "pyxllm safetensors, no flags": b1.get("pyxllm safetensors (no flags)"),
                **{f"llama-bench {t}": b1.get(f"llama-bench {t}") for t in types},
            },
            "tok/s",
        )
    for qtype, servers in results.get("llama-server", {}).items():
        for label, figures in servers.items():
            ours, peer = figures.get("pyxllm", {}), figures.get("llama-server", {})
            input_len, clients = label.split("x")
            title = f"1B serving, {qtype}, no flags, {input_len}-token prompts, {clients} clients"
            lines += ratio_lines(
                f"{title}, output",
                ours.get("output_tok_s"),
                {"llama-server": peer.get("output_tok_s")},
                "tok/s",
            )
            lines += ratio_lines(
                f"{title}, median TTFT",
                ours.get("median_ttft_ms"),
                {"llama-server": peer.get("median_ttft_ms")},
                "ms",
                lower_better=True,
            )
        memory = results.get("memory", {}).get(qtype)
        if memory and memory["resident_mib"] is not None:
            # the target: 1.15 x the file + the KV budget (the CPU's KV cache becomes resident
            # as its blocks are used, so after start-up little of the budget is)
            bound = 1.15 * memory["file_mib"] + memory["kv_mib"]
            lines.append(
                f"1B memory, {qtype}: pyxllm serve resident {memory['resident_mib']:.0f} MiB "
                f"after start-up, KV budget {memory['kv_mib']:.0f} MiB, file "
                f"{memory['file_mib']:.0f} MiB -> resident / (1.15 file + KV) = "
                f"{memory['resident_mib'] / bound:.2f} (target <= 1)"
            )
    busy_rows = results.get("busy-core")
    if busy_rows:
        ours, peer = busy_rows["pyxllm"], busy_rows["llama-bench"]
        for state in ("quiet", "busy"):
            lines += ratio_lines(
                f"1B batch-1 decode, {state} machine, no flags",
                ours.get(state),
                {"llama-bench": peer.get(state)},
                "tok/s",
            )
        lines.append(
            f"    busy / quiet: pyxllm {ours['busy'] / ours['quiet']:.0%}, llama-bench "
            f"{peer['busy'] / peer['quiet']:.0%}"
        )
    return lines


def run(args, binaries: dict, log, ratio_lines) -> list[str]:
    """Build the files (where missing), run the chosen sections and return the summary lines;
    the figures go into ``args.result_file`` when given.

    Raises:
        ValueError: a bad ``--model-1b-types``.
    """
    import llama_server

    from pyxllm.benchmarks.prompts import load_tokenizer

    types = parse_types(args.model_1b_types)
    paths = build(Path(args.model_1b_dir), binaries["llama-quantize"], types, log)
    results: dict = {"files": {name: str(path) for name, path in paths.items()}}
    if "batch-1" in args.sections:
        results["batch-1"] = batch1(
            paths, binaries, types, args.output_len, ITERS, args.threads, log
        )
    if "llama-server" in args.sections:
        workloads = llama_server.parse_workloads(args.llama_server_workloads)
        tokenizer = load_tokenizer(str(paths["safetensors"]))
        results["llama-server"], results["memory"] = {}, {}
        for qtype in types:
            figures = llama_server.serving(
                binaries["llama-server"],
                tokenizer,
                workloads,
                args.output_len,
                args.requests_per_client,
                args.threads,
                model=paths[qtype],
            )
            results["llama-server"][qtype] = figures
            first = next(iter(figures.values())).get("pyxllm", {})
            results["memory"][qtype] = {
                "resident_mib": first.get("resident_mib_after_start"),
                "kv_mib": llama_server.KV_CACHE_GIB * 1024,
                "file_mib": paths[qtype].stat().st_size / 2**20,
            }
    if "busy-core" in args.sections:
        results["busy-core"] = busy(
            paths[types[0]], binaries, args.output_len, ITERS, args.threads, log
        )
    if args.result_file:
        with open(args.result_file, "w") as f:
            json.dump(results, f, indent=2)
    return ratio_rows(results, types, args.output_len, ratio_lines)
