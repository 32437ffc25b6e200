"""The one engine configuration: every CLI flag maps onto a field here."""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import os
import re
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pyxllm.distributed.address import parse_master_addr
from pyxllm.distributed.ray_utils import PLACEMENT_STRATEGIES, import_ray
from pyxllm.flag_fields import Flag, flag, flag_of, keyword_aliases
from pyxllm.flag_types import float_value, human_readable_int, int_value
from pyxllm.speculative_config import SpeculativeConfig

# the dtypes pyxllm computes in, by torch's names (``platforms.interface.TORCH_DTYPES``)
COMPUTE_DTYPES = ("float32", "bfloat16", "float16")
DTYPES = ("auto", *COMPUTE_DTYPES)
QUANTIZATIONS = ("int8", "int4", "w8a8", "gguf")  # see pyxllm.layers.quantization
# the KV cache's element type: auto (the compute dtype) or int8 with a scale per token and head
# (see pyxllm.kernels.native.paged_attention); vLLM's fp8 has no CPU kernel
KV_CACHE_DTYPES = ("auto", "int8")
# The device platforms, each the module ``pyxllm.platforms.<name>``: the CPU first, then the
# accelerators in the order ``--device auto`` tries them (see pyxllm.platforms).
PLATFORMS = ("cpu", "cuda", "npu", "mlu")
DEVICES = ("auto", *PLATFORMS)
GRAPH_BACKENDS = ("eager", "compile", "graph")
# the KV cache's size on the CPU when --kv-cache-memory is not given (no free-memory figure
# bounds it there, as on an accelerator)
CPU_KV_CACHE_GIB = 2.0
# grammar libraries for structured outputs (pyxllm.engine.structured_output), the default first
STRUCTURED_OUTPUTS_BACKENDS = ("llguidance", "xgrammar")
# --kv-offload-max-gib's default
DEFAULT_KV_OFFLOAD_MAX_GIB = 10.0
# the per-step token budget when --max-tokens-per-batch is not given (see EngineConfig.token_budget)
DEFAULT_MAX_TOKENS_PER_BATCH = 2048
# --generation-config's words (vLLM's); anything else is a directory
GENERATION_CONFIG_MODES = ("auto", "vllm")
GIB = 2**30
# the address of a KV directory in the Ray object store (see pyxllm.engine.kv_ray), as
# --kv-transfer-push and --kv-transfer-listen take it
RAY_KV_SCHEME = "ray://"
_RAY_KV_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


def ray_kv_directory(address: str | None) -> str | None:
    """``NAME`` of a ``ray://NAME`` address (a KV directory in the Ray object store), ``None``
    for any other address (``HOST:PORT``) or none.

    Raises:
        ValueError: ``ray://`` with a name that is not 1 to 64 letters, digits, ``_``, ``.``
            or ``-``, starting with a letter or digit.
    """
    if address is None or not address.startswith(RAY_KV_SCHEME):
        return None
    name = address[len(RAY_KV_SCHEME) :]
    if not _RAY_KV_NAME.match(name):
        raise ValueError(
            f"{address!r}: must be ray://NAME, NAME 1 to 64 letters, digits, '_', '.' or '-'"
        )
    return name


# who starts and places the tensor-parallel ranks (pyxllm.executor): processes of this host
# (spawned, or started by hand with --nnodes), or Ray actors (pyxllm.executor.ray_executor)
DISTRIBUTED_EXECUTOR_BACKENDS = ("mp", "ray")
# which code runs the model (vLLM's --model-impl); xLLM's "python" is pyxllm's own
MODEL_IMPLS = ("auto", "pyxllm", "transformers")
MODEL_IMPL_ALIASES = {"python": "pyxllm"}
# what the engine serves (vLLM's --task): text (generate) or embeddings (embed: an embedding
# model and a pooler, see pyxllm.executor.pooling_executor); auto: embed for an encoder, else
# generate (pyxllm.executor.tasks)
TASKS = ("auto", "generate", "embed", "score", "classify")
# xLLM's spellings of --graph-backend, and ours, -> the runner kind
GRAPH_BACKEND_ALIASES = {
    "auto": "auto",
    "eager": "eager",
    "off": "eager",
    "none": "eager",
    "compile": "compile",
    "inductor": "compile",
    "graph": "graph",
    "cudagraphs": "graph",
    "aclgraph": "graph",
}

# The engine flags' argument groups, in --help's order, as vLLM groups its configs (ModelConfig,
# CacheConfig, SchedulerConfig, ParallelConfig, ...); a field with no flag metadata is listed
# under "other engine flags", after them.
MODEL_FLAGS, CACHE_FLAGS, SCHEDULER_FLAGS = "model flags", "cache flags", "scheduler flags"
PARALLEL_FLAGS, DEVICE_FLAGS, DECODING_FLAGS = "parallel flags", "device flags", "decoding flags"
LORA_FLAGS = "LoRA flags"
ENGINE_FLAG_GROUPS = (
    MODEL_FLAGS,
    CACHE_FLAGS,
    SCHEDULER_FLAGS,
    PARALLEL_FLAGS,
    DEVICE_FLAGS,
    DECODING_FLAGS,
    LORA_FLAGS,
)
# vLLM's --kv-cache-memory-bytes, a flag with no field: from_kwargs turns it into kv_cache_memory
KV_CACHE_MEMORY_BYTES = Flag(
    name="kv_cache_memory_bytes",
    type=human_readable_int,
    flag_default=None,
    metavar="BYTES",
    help="the KV cache's size in bytes, vLLM's form of --kv-cache-memory: a number, or one "
    "with a suffix k, m, g (powers of 1000) or K, M, G (powers of 1024), as vLLM reads it",
)


def _read_text(name: str, text: str, convert: Callable[[str], Any]) -> Any:
    """``convert(text)``; raises ValueError naming the flag ``--name`` when it cannot."""
    try:
        return convert(text)
    except (ValueError, argparse.ArgumentTypeError) as exc:
        detail = f": {exc}" if isinstance(exc, argparse.ArgumentTypeError) else ""
        raise ValueError(
            f"--{name.replace('_', '-')}: cannot read {text!r} as its value{detail}"
        ) from None


def _read_number(name: str, value: str, hint: Any, field: dataclasses.Field) -> Any:
    """A keyword's text ``value`` read as the flag of a number field reads it (its
    :attr:`Flag.type`, else ``int``/``float``); ``value`` unchanged for other fields."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        hint = next((a for a in typing.get_args(hint) if a is not type(None)), hint)
    if hint not in (int, float):
        return value
    spec = flag_of(field)
    convert = spec.type if isinstance(spec, Flag) and spec.type else None
    return _read_text(name, value, convert or {int: int_value, float: float_value}[hint])


@dataclass(slots=True)
class EngineConfig:
    """Settings of an engine instance; ``pyxllm serve`` flags are these names with dashes,
    each field's help, group and other spellings its :func:`~pyxllm.flag_fields.flag` metadata.

    Units: ``kv_cache_memory`` in GiB, ``gpu_memory_utilization`` a fraction of the card's
    memory, ``max_model_len`` / ``max_tokens_per_batch`` / ``block_size`` in tokens.

    - ``model``: ``None`` (the embedded SmolLM2-135M-Instruct GGUF), a ``.gguf`` file, a
      Hugging Face directory, or a Hugging Face model id (``ORG/NAME``, at ``revision``, from
      the cache ``download_dir`` or ``HF_HUB_CACHE``, downloaded when not there).
    - ``gguf_file``: the model is this ``.gguf`` file inside ``model`` (a directory or model id;
      from a model id only that file and the ``*.json`` files are downloaded).
    - ``tokenizer``: the tokenizer and chat template come from this directory, ``.gguf`` file or
      model id (at ``tokenizer_revision``) instead of the model (for a GGUF model: instead of
      its embedded vocabulary). ``None`` takes the model's.
    - ``task``: ``generate`` (text), ``embed`` (embeddings from an encoder such as
      all-MiniLM-L6-v2, the embedded one when ``model`` is ``None``, or a decoder; one rank,
      no chunked prefill or prefix cache, see ``pyxllm.executor.pooling_executor``) or ``auto``
      (``embed`` for an encoder, else ``generate``; resolved by ``EngineFrontend.load``).
    - ``model_impl``: ``pyxllm`` (its native model code; xLLM's ``python`` is read as this),
      ``transformers`` (transformers' model code with pyxllm's paged attention, see
      ``pyxllm.models.transformers_backend``), or ``auto``: native where pyxllm has the
      architecture, else transformers.
    - ``served_model_name``: the names clients may send as ``model`` (a string is one name);
      the first is the one responses report. ``None``: derived from ``model``.
    - ``max_model_len``: ``None`` takes the model's ``max_position_embeddings``.
    - ``max_tokens_per_batch``: ``None`` is :data:`DEFAULT_MAX_TOKENS_PER_BATCH`, raised to
      ``max_model_len`` without chunked prefill (see :meth:`token_budget`).
    - ``generation_config``: where request defaults come from (vLLM's flag): ``auto``, the
      model's ``generation_config.json``; ``vllm``, none (``SamplingParams``' defaults); or a
      directory holding a ``generation_config.json`` to read instead of the model's.
    - ``chat_template``: a file holding a Jinja chat template, or the template itself, used
      instead of the tokenizer's (vLLM's ``--chat-template``, see :func:`load_chat_template`).
    - ``speculative_config``: speculative decoding, vLLM's JSON object (text, or a dict in
      Python; stored as text), see :class:`~pyxllm.speculative_config.SpeculativeConfig`;
      ``None``: off.
    - ``enable_chunked_prefill``: a long prompt is prefilled over several steps, sharing each
      step's ``max_tokens_per_batch`` budget with running decodes. Off, a prompt is prefilled
      in one step and must fit the budget.
    - ``enable_prefix_cache``: full KV blocks stay cached (by a hash of their prefix) after
      their request ends, and a request whose prompt starts with cached blocks skips them.
    - ``batch_invariant``: kernels give a token the same bits whatever else its step holds
      (vLLM's ``VLLM_BATCH_INVARIANT``, SGLang's ``--enable-deterministic-inference``, here
      the default): attention through one kernel for every token, the int4/int8 group
      matmuls on their row-invariant integer path at any row count, and float32 and bfloat16
      matmuls on the CPU on row-wise kernels instead of MKL / oneDNN. The W8A8 ones do not
      promise it yet; the executor says at start-up what is covered.
    - ``device``: ``auto`` picks CUDA, then NPU, then MLU, else the CPU (see ``pyxllm.platforms``).
    - ``graph_backend``: ``auto`` (the default: the platform's ``default_runner`` where the
      model allows it, the graph runner on the CPU, else ``eager``; see
      ``executor.runners.resolve_runner``), ``eager``, ``compile`` (``torch.compile``) or
      ``graph`` (decode steps captured as CUDA/ACL graphs, TorchScript traces on the CPU);
      xLLM's ``off``/``none``, ``inductor`` and ``cudagraphs``/``aclgraph`` are read as these
      and stored normalized.
    - ``quantization``: ``auto`` (the default): ``gguf`` for a GGUF file, else ``None``
      (``PYXLLM_DEFAULT_QUANTIZATION`` names another choice for ``auto``; the test suite pins
      ``none``). ``None`` keeps the weights in ``dtype`` (a GGUF file's dequantized; vLLM's
      ``"none"`` is read as it). ``gguf``: a GGUF file's weights stay in the format it stores
      them in where a kernel takes it (Q4_0/Q4_1/Q4_K as int4 groups, Q8_0 and the 5-bit types
      as int8 groups; the rest dequantized), see ``pyxllm.layers.quantization.stored``.
      Weight-only ``int8`` (per output channel) / ``int4`` (groups of 32, exact for GGUF Q4_1
      weights) for the decoder's linear layers, activations staying in ``dtype``; or ``w8a8``:
      int8 weights per channel and int8 activations per token (int8 matmuls). The LM head is
      W8A8 with each of these three.
    - ``kv_cache_memory``: ``None`` sizes the cache from ``gpu_memory_utilization`` on an
      accelerator and takes ``CPU_KV_CACHE_GIB`` on the CPU.
    - ``kv_cache_dtype``: ``auto`` keeps K and V in ``dtype``; ``int8`` stores each token's K
      (and V) row of a head as int8 with its own float32 scale (``max |x| / 127``): ~half the
      bytes of bfloat16, so about twice the tokens fit in ``kv_cache_memory`` and decode
      attention reads half as much. Attention backends without it refuse it at start-up.
    - Tensor parallelism (see ``pyxllm.executor.multiproc``): ``tensor_parallel_size`` N > 1 on
      one node spawns N-1 worker processes here. ``nnodes`` N > 1 runs one rank per node, started
      by hand with ``node_rank`` 0..N-1 and the same ``master_addr`` (``host:port`` of node 0,
      where rank 0 serves HTTP); ``tensor_parallel_size`` is then 1 or N. ``dist_init_timeout``
      (seconds) bounds how long a rank waits for the master address and the other ranks.
      ``kv_cache_memory`` is per rank.
    - ``distributed_executor_backend``: ``mp`` places the ranks as above; ``ray`` places them as
      Ray actors on the cluster at ``ray_address`` (``None``: ``RAY_ADDRESS``, else the cluster
      ``ray start`` started on this node, else a new local one), one placement-group bundle per
      rank placed with ``ray_placement_strategy`` (``None``: ``PACK``); see
      ``pyxllm.executor.ray_executor``. ``dist_init_timeout`` then bounds the whole start-up.

    Raises:
        ValueError: a value out of range; the message names the flag.
    """

    model: str | None = flag(
        None,
        help="a .gguf file, a Hugging Face directory (config.json, *.safetensors, tokenizer "
        "files) or a Hugging Face model id ORG/NAME, taken from the Hugging Face cache when it is "
        "there, else downloaded into it (with HF_HUB_OFFLINE=1, the cache only); `pyxllm serve "
        "MODEL` gives it too (default: the embedded SmolLM2-135M-Instruct GGUF; with --task embed, "
        "the embedded all-MiniLM-L6-v2)",
        group=MODEL_FLAGS,
        metavar="PATH|ID",
    )
    revision: str | None = flag(
        None,
        help="branch, tag or commit of a Hugging Face model id (default: main)",
        group=MODEL_FLAGS,
        metavar="REV",
    )
    download_dir: str | None = flag(
        None,
        help="the Hugging Face cache model ids are read from and downloaded into "
        "(default: $HF_HUB_CACHE)",
        group=MODEL_FLAGS,
        metavar="DIR",
    )
    gguf_file: str | None = flag(
        None,
        help="the model is this .gguf file inside --model, a directory or model id (from an "
        "id, only this file and the repository's *.json files are downloaded); served as the id, "
        "from a directory as the file's name without .gguf; a file not there fails naming the "
        ".gguf files that are (--model path/to/file.gguf works too)",
        group=MODEL_FLAGS,
        metavar="FILE.gguf",
    )
    tokenizer: str | None = flag(
        None,
        help="load the tokenizer and chat template from this directory, .gguf file or model "
        "id (its tokenizer files only) instead of the model's; for a GGUF model, instead of its "
        "embedded vocabulary; generation stops on the model's end-of-sequence ids and this "
        "tokenizer's (default: the model's)",
        group=MODEL_FLAGS,
        metavar="PATH|ID",
    )
    tokenizer_revision: str | None = flag(
        None,
        help="branch, tag or commit of a --tokenizer model id (default: main)",
        group=MODEL_FLAGS,
        metavar="REV",
    )
    served_model_name: tuple[str, ...] | None = flag(
        None,
        help="the names clients send as `model`, one or several (`--served-model-name "
        "a b`: both are accepted, responses report the first; it takes every word up to the next "
        "flag, so a positional MODEL goes before it) (default: the model id, else the model file's "
        "or directory's name)",
        group=MODEL_FLAGS,
        metavar="NAME",
    )
    task: str = flag(
        "auto",
        help="what the server makes: generate, text (the completion, chat and responses "
        "routes); embed, embeddings (/v1/embeddings, /pooling; /v1/score and /v1/rerank as cosine "
        "similarities) from an embedding model: a BERT encoder such as "
        "sentence-transformers/all-MiniLM-L6-v2, embedded in pyxllm's install and served when no "
        "model is given, or a decoder such as Qwen3-Embedding (see docs/models.md, Embedding "
        "models); score, a cross-encoder's scores of text pairs (/v1/score, /v1/rerank) from a "
        "BertForSequenceClassification with one label such as "
        "cross-encoder/ms-marco-MiniLM-L-6-v2; classify, class probabilities (/classify) from a "
        "*ForSequenceClassification model with several labels; auto: score or classify for a "
        "classifier (by its label count), embed for another encoder, else generate "
        "(default: auto)",
        group=MODEL_FLAGS,
        choices=TASKS,
    )
    model_impl: str = flag(
        "auto",
        help="which code runs the model: pyxllm's own (also: python), transformers' (any "
        "causal LM transformers has, on pyxllm's paged attention), or auto: pyxllm's where it has "
        "the architecture, else transformers' (see docs/models.md)",
        group=MODEL_FLAGS,
        choices=(*MODEL_IMPLS, *MODEL_IMPL_ALIASES),
    )
    dtype: str = flag(
        "auto",
        help="weight and activation dtype; auto: on the CPU bfloat16 where it has avx512_bf16 "
        "or amx_bf16, else float32, elsewhere the checkpoint's declared dtype (on the CPU float16 "
        "runs as bfloat16, with a warning)",
        group=MODEL_FLAGS,
        choices=DTYPES,
    )
    quantization: str | None = flag(
        "auto",
        help="how the linear layers' weights are held: auto: a GGUF file's as it stores "
        "them (gguf), other checkpoints' in --dtype (none); gguf: Q4_0/Q4_1/Q4_K as int4 groups, "
        "Q2_K/Q3_K/Q5/Q6_K/Q8_0/IQ4 as int8 groups, exactly, the rest dequantized; none: every "
        "weight in --dtype; weight-only int8 (per channel) or int4 (groups of 32; the fastest "
        "single stream on a float checkpoint), or w8a8 (int8 weights and per-token int8 "
        "activations, int8 matmuls: the fastest from a few concurrent requests up and for long "
        "prompts), each with a w8a8 LM head; int4 and int8 keep the layers a GGUF file stores in "
        "their own grouped format as stored; see docs/performance.md (default: auto)",
        group=MODEL_FLAGS,
        choices=("auto", *QUANTIZATIONS, "none"),
    )
    device: str = flag(
        "auto",
        help="device to run on; auto picks cuda, then npu (torch_npu), then mlu (torch_mlu), "
        "else cpu (see docs/devices.md)",
        group=DEVICE_FLAGS,
        choices=DEVICES,
    )
    graph_backend: str = flag(
        "auto",
        help="how the model runs: auto (graph on the CPU for a model it can capture on "
        "one rank, else eager), eager, compile (torch.compile) or graph (decode steps captured "
        "once: CUDA/ACL graphs, TorchScript traces on the CPU; prefill eager); also off/none, "
        "inductor, cudagraphs/aclgraph (see docs/devices.md) (default: auto)",
        group=DEVICE_FLAGS,
        metavar="KIND",
    )
    max_seqs_per_batch: int = flag(
        64,
        help="most sequences running at once (in one engine step)",
        group=SCHEDULER_FLAGS,
        aliases=("max_num_seqs",),
    )
    max_tokens_per_batch: int | None = flag(
        None,
        help="most tokens (decodes and prefill chunks) computed in one engine "
        "step (default: 2048; without chunked prefill --max-model-len when that is more, as vLLM)",
        group=SCHEDULER_FLAGS,
        aliases=("max_num_batched_tokens",),
    )
    max_model_len: int | None = flag(
        None,
        help="context limit: the longest prompt plus completion, in tokens; auto: the "
        "model's (default: the model's max_position_embeddings)",
        group=MODEL_FLAGS,
    )
    block_size: int = flag(16, help="tokens per KV-cache block", group=CACHE_FLAGS)
    kv_cache_memory: float | None = flag(
        None,
        help="memory for the KV cache, in GiB, per tensor-parallel rank (default: 2 "
        "on the CPU; on an accelerator what --gpu-memory-utilization leaves after the weights)",
        group=CACHE_FLAGS,
        metavar="GIB",
        also=(KV_CACHE_MEMORY_BYTES,),
    )
    kv_cache_dtype: str = flag(
        "auto",
        help="element type of the KV cache: auto (--dtype) or int8 (a float32 scale per "
        "token and head: about half bfloat16's bytes, so ~2x the tokens fit; CPU attention only; "
        "see docs/performance.md, KV cache)",
        group=CACHE_FLAGS,
        choices=KV_CACHE_DTYPES,
    )
    gpu_memory_utilization: float = flag(
        0.9,
        help="fraction of an accelerator's memory this engine may use in all; "
        "the KV cache gets what the weights leave of it",
        group=CACHE_FLAGS,
        metavar="FRACTION",
    )
    enable_chunked_prefill: bool = flag(
        True,
        help="split long prompts across steps, sharing each step's token "
        "budget with running decodes; off, a whole prompt is computed in one step",
        group=SCHEDULER_FLAGS,
    )
    enable_prefix_cache: bool = flag(
        True,
        help="reuse the KV blocks of a prompt prefix computed before (by any "
        "request); outputs are the same either way",
        group=CACHE_FLAGS,
        aliases=("enable_prefix_caching",),
    )
    batch_invariant: bool = flag(
        True,
        help="give a request the same tokens whatever else runs beside it (other "
        "requests, prefix-cache hits, prefill chunks): attention through one kernel for every "
        "token, the GGUF/int4 matmuls on their row-invariant integer path and float32 and "
        "bfloat16 ones on row-wise kernels at any batch size; off, prefills take the "
        "BLAS and prefill-attention paths, which "
        "prefilled a 1000-token prompt 2x faster on an AVX2 CPU (see docs/defaults.md)",
        group=SCHEDULER_FLAGS,
    )
    seed: int = flag(
        0,
        help="seed of the random draws of requests that give no seed of their own (one generator "
        "they share, so their samples also depend on what else runs; a request's own seed gives "
        "the same text whatever else runs)",
        group=MODEL_FLAGS,
    )
    tensor_parallel_size: int = flag(
        1,
        help="split the model over N ranks (tensor parallelism); on one node, "
        "N-1 worker processes are spawned here; on a CPU host they share its cores (see "
        "docs/parallelism.md)",
        group=PARALLEL_FLAGS,
        aliases=("--tp",),
    )
    nnodes: int = flag(
        1,
        help="number of nodes, one rank each, started by hand (xLLM's --nnodes)",
        group=PARALLEL_FLAGS,
    )
    node_rank: int = flag(
        0,
        help="this node's rank in [0, nnodes); rank 0 serves HTTP, the others only compute",
        group=PARALLEL_FLAGS,
    )
    master_addr: str | None = flag(
        None,
        help="host:port of node 0, where the ranks meet (xLLM's --master_node_addr) "
        "(default: with one node, 127.0.0.1 and a free port)",
        group=PARALLEL_FLAGS,
        aliases=("master_node_addr",),
        metavar="HOST:PORT",
    )
    dist_init_timeout: float = flag(
        120.0,
        help="seconds a rank waits at start-up for the master address and the "
        "other ranks before giving up; with Ray, the whole start-up (placement group, actors)",
        group=PARALLEL_FLAGS,
        metavar="SECONDS",
    )
    distributed_executor_backend: str = flag(
        "mp",
        help="who starts the tensor-parallel ranks: mp, processes "
        "(spawned on this host, or one per node started by hand with --nnodes), or ray, actors "
        "placed on a Ray cluster (.venv/bin/pip install 'pyxllm[ray]'; see docs/parallelism.md, "
        "Ray)",
        group=PARALLEL_FLAGS,
        choices=DISTRIBUTED_EXECUTOR_BACKENDS,
    )
    ray_address: str | None = flag(
        None,
        help="host:port of the Ray cluster's head to join, for --distributed-executor-backend "
        "ray or a ray://NAME --kv-transfer-push/--kv-transfer-listen (default: $RAY_ADDRESS, "
        "else the cluster `ray start` started on this node, else, for the executor only, a new "
        "local one)",
        group=PARALLEL_FLAGS,
        metavar="HOST:PORT",
    )
    ray_placement_strategy: str | None = flag(
        None,
        help="how Ray places the ranks' bundles (one per rank, rank 0's on "
        "this node): PACK, as few nodes as possible; STRICT_SPREAD, one rank per node; or SPREAD, "
        "STRICT_PACK (default: PACK)",
        group=PARALLEL_FLAGS,
        choices=PLACEMENT_STRATEGIES,
    )
    structured_outputs_backend: str = flag(
        "llguidance",
        help="grammar library enforcing response_format, structured_outputs and tool calls",
        group=DECODING_FLAGS,
        choices=STRUCTURED_OUTPUTS_BACKENDS,
    )
    speculative_config: str | None = flag(
        None,
        help="speculative decoding as a JSON object (vLLM's keys): "
        '\'{"method": "ngram", "num_speculative_tokens": 4}\' (prompt lookup; prompt_lookup_min '
        'and prompt_lookup_max, default 3 and 5) or \'{"method": "draft_model", "model": PATH, '
        '"num_speculative_tokens": 4}\'; "disable_by_batch_size": N (default 4) turns it off for '
        "steps with more running sequences; see docs/speculative.md (default: off)",
        group=DECODING_FLAGS,
        metavar="JSON",
    )
    generation_config: str = flag(
        "auto",
        help="where request defaults (temperature, top_p, top_k, min_p, "
        "repetition_penalty, max_tokens from max_new_tokens) come from, as vLLM's flag: auto, the "
        "model's generation_config.json; vllm, none of it (SamplingParams' defaults); or DIR, the "
        "generation_config.json in that directory",
        group=MODEL_FLAGS,
        metavar="auto|vllm|DIR",
    )
    chat_template: str | None = flag(
        None,
        help="the chat template, instead of the tokenizer's: a file holding a Jinja "
        "template, or the template text itself (vLLM's flag) (default: the tokenizer's)",
        group=MODEL_FLAGS,
        metavar="FILE|TEMPLATE",
    )
    # images in prompts (vision-language models, see docs/multimodal.md)
    limit_mm_per_prompt: str | None = flag(
        None,
        help='most images one prompt may hold, vLLM\'s image=N (or its JSON {"image": N}); '
        "a request with more gets a 400 (default: image=999)",
        group=MODEL_FLAGS,
        metavar="image=N",
    )
    allowed_local_media_path: str | None = flag(
        None,
        help="file:// image URLs in chat messages are read from this directory and below "
        "(default: none, file:// URLs are refused)",
        group=MODEL_FLAGS,
        metavar="DIR",
    )
    fetch_media: bool = flag(
        True,
        help="http(s):// image URLs in chat messages are fetched (at most 20 MiB, within 10 s); "
        "--no-fetch-media refuses them with a 400",
        group=MODEL_FLAGS,
    )
    allowed_media_domains: tuple[str, ...] = flag(
        (),
        help="the only hosts http(s):// image URLs (and their redirects) may name, as vLLM's "
        "flag; others get a 400 (default: any host)",
        group=MODEL_FLAGS,
        metavar="HOST",
    )
    kv_offload_dir: str | None = flag(
        None,
        help="also keep every full KV block in files in this directory, read back for a "
        "prompt prefix the RAM prefix cache lacks: prefixes survive a restart and are shared by "
        "engines on the same directory (data-parallel replicas); one rank (see docs/serving.md, "
        "KV cache on disk) (default: off)",
        group=CACHE_FLAGS,
        metavar="DIR",
    )
    kv_offload_max_gib: float = flag(
        DEFAULT_KV_OFFLOAD_MAX_GIB,
        help="most GiB --kv-offload-dir's files take for this model; the least recently used "
        "are deleted first",
        group=CACHE_FLAGS,
        metavar="GIB",
    )
    kv_role: str = flag(
        "both",
        help="what this engine does with --kv-offload-dir: both reads and writes blocks; "
        "prefill (the prefill instance of prefill/decode disaggregation) reads and writes; "
        "decode reads only (see docs/serving.md, Prefill/decode disaggregation)",
        group=CACHE_FLAGS,
        choices=("both", "prefill", "decode"),
    )
    kv_transfer_push: tuple[str, ...] = flag(
        (),
        help="also send each prompt's full KV blocks over TCP to this decode instance's "
        "--kv-transfer-listen, for instances that do not share --kv-offload-dir, on a thread "
        "per peer; answers wait for them, steps do not (several: list them); or, given "
        "ray://NAME (alone), put them into the Ray object store under the cluster's KV "
        "directory NAME (see docs/serving.md, Prefill/decode disaggregation)",
        group=CACHE_FLAGS,
        metavar="HOST:PORT|ray://NAME",
    )
    kv_transfer_listen: str | None = flag(
        None,
        help="receive the KV blocks a prefill instance's --kv-transfer-push sends into "
        "--kv-offload-dir, listening on this address (a private interface; with "
        "$PYXLLM_KV_TRANSFER_TOKEN, only pushes signed with that secret); or, given "
        "ray://NAME, fetch a prompt's blocks from the Ray cluster's KV directory NAME (default: "
        "off)",
        group=CACHE_FLAGS,
        metavar="HOST:PORT|ray://NAME",
    )
    enable_lora: bool = flag(
        False,
        help="serve LoRA adapters (PEFT directories) on the model: requests name one as their "
        "`model` (--lora-modules, POST /v1/load_lora_adapter) or pass a LoRARequest to LLM; "
        "requests on different adapters and on the base model share every step; eager or graph "
        "runner, one rank, no speculative decoding (see docs/lora.md)",
        group=LORA_FLAGS,
    )
    max_loras: int = flag(
        4,
        help="most distinct adapters in one engine step (requests on others wait for a later "
        "step; vLLM's default is 1)",
        group=LORA_FLAGS,
    )
    max_lora_rank: int = flag(
        64,
        help="the largest adapter rank accepted; an adapter above it is refused when loaded",
        group=LORA_FLAGS,
    )
    max_cpu_loras: int | None = flag(
        None,
        help="adapters kept loaded at once; the least recently used one is dropped for a new "
        "one and read again from its directory when needed (default: --max-loras, at least)",
        group=LORA_FLAGS,
    )

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineConfig:
        """The config of keyword arguments in pyxllm's or vLLM's names (the fields' bare-name
        flag aliases, and ``kv_cache_memory_bytes``, vLLM's KV cache size in bytes), as
        ``LLM(...)`` takes them.

        A number field's value may be given as its flag's text (``max_model_len="4k"``,
        ``kv_cache_memory_bytes="1G"``): it is read as the flag reads it.

        Raises:
            TypeError: an unknown keyword (naming the closest one), or one field given under
                two names.
            ValueError: a value out of range or text its flag does not read (naming the flag).
        """
        aliases = keyword_aliases(cls)
        fields = {f.name: f for f in dataclasses.fields(cls)}
        for key in kwargs:
            if key not in fields and key not in aliases and key != KV_CACHE_MEMORY_BYTES.name:
                known = [*fields, *aliases, KV_CACHE_MEMORY_BYTES.name]
                close = difflib.get_close_matches(key, known, n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                raise TypeError(f"unexpected keyword argument {key!r}{hint}")
        for alias, name in aliases.items():
            if alias in kwargs:
                if name in kwargs:
                    raise TypeError(f"got both {alias!r} and {name!r}; give one of them")
                kwargs[name] = kwargs.pop(alias)
        hints = typing.get_type_hints(cls)
        for name, value in kwargs.items():
            if isinstance(value, str) and name in fields:
                kwargs[name] = _read_number(name, value, hints[name], fields[name])
        nbytes = kwargs.pop(KV_CACHE_MEMORY_BYTES.name, None)
        if isinstance(nbytes, str):
            nbytes = _read_text(KV_CACHE_MEMORY_BYTES.name, nbytes, human_readable_int)
        if nbytes is not None:
            if kwargs.get("kv_cache_memory") is not None:
                raise ValueError(
                    "--kv-cache-memory-bytes: give it or --kv-cache-memory (GiB), not both"
                )
            if nbytes <= 0:
                raise ValueError(f"--kv-cache-memory-bytes: must be > 0, got {nbytes}")
            kwargs["kv_cache_memory"] = nbytes / GIB
        return cls(**kwargs)

    @property
    def served_model_names(self) -> tuple[str, ...]:
        """Every ``served_model_name`` (empty when none was given)."""
        return self.served_model_name or ()

    def token_budget(self, max_model_len: int | None = None) -> int:
        """Tokens one engine step may compute: ``max_tokens_per_batch`` when given, else
        :data:`DEFAULT_MAX_TOKENS_PER_BATCH`, raised to ``max_model_len`` without chunked
        prefill (a whole prompt must then fit one step; vLLM's rule)."""
        if self.max_tokens_per_batch is not None:
            return self.max_tokens_per_batch
        if self.enable_chunked_prefill or max_model_len is None:
            return DEFAULT_MAX_TOKENS_PER_BATCH
        return max(DEFAULT_MAX_TOKENS_PER_BATCH, max_model_len)

    @property
    def speculative(self) -> SpeculativeConfig | None:
        """The parsed ``speculative_config`` (``None``: no speculative decoding)."""
        if self.speculative_config is None:
            return None
        return SpeculativeConfig.parse(self.speculative_config)

    @property
    def world_size(self) -> int:
        """Number of tensor-parallel ranks in all (processes, over every node)."""
        return max(self.tensor_parallel_size, self.nnodes)

    def _check_parallel(self) -> None:
        for name in ("tensor_parallel_size", "nnodes"):
            if getattr(self, name) < 1:
                raise ValueError(
                    f"--{name.replace('_', '-')}: must be >= 1, got {getattr(self, name)}"
                )
        self._check_ray()
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(
                f"--node-rank: must be in [0, {self.nnodes}) for --nnodes {self.nnodes}, got "
                f"{self.node_rank}"
            )
        if self.nnodes > 1 and self.tensor_parallel_size not in (1, self.nnodes):
            raise ValueError(
                f"--tensor-parallel-size: with --nnodes {self.nnodes} (one rank per node) it must "
                "be "
                f"1 or {self.nnodes}, got {self.tensor_parallel_size}"
            )
        if self.nnodes > 1 and not self.master_addr:
            raise ValueError(
                "--master-addr: --nnodes > 1 needs the host:port of node 0 (e.g. 10.0.0.1:19888)"
            )
        if self.master_addr:
            parse_master_addr(self.master_addr)
        if self.dist_init_timeout <= 0:
            raise ValueError(
                f"--dist-init-timeout: must be > 0 seconds, got {self.dist_init_timeout}"
            )

    def _check_ray(self) -> None:
        backend = self.distributed_executor_backend
        if backend not in DISTRIBUTED_EXECUTOR_BACKENDS:
            raise ValueError(
                "--distributed-executor-backend: must be one of "
                f"{', '.join(DISTRIBUTED_EXECUTOR_BACKENDS)}, got {backend!r}"
            )
        strategy = self.ray_placement_strategy
        if strategy is not None and strategy not in PLACEMENT_STRATEGIES:
            raise ValueError(
                f"--ray-placement-strategy: must be one of {', '.join(PLACEMENT_STRATEGIES)}, "
                f"got {strategy!r}"
            )
        if backend != "ray":
            if self.ray_placement_strategy is not None:
                raise ValueError(
                    "--ray-placement-strategy: applies to --distributed-executor-backend ray only"
                )
            if self.ray_address is not None and not self.ray_kv_transfer:
                raise ValueError(
                    "--ray-address: applies to --distributed-executor-backend ray, or to a "
                    "ray://NAME --kv-transfer-push or --kv-transfer-listen, only"
                )
            return
        for name, given in (("nnodes", self.nnodes > 1), ("master_addr", self.master_addr)):
            if given:
                raise ValueError(
                    f"--{name.replace('_', '-')}: not with --distributed-executor-backend ray, "
                    "which places the ranks and finds their address itself (give --tp N only)"
                )
        import_ray()

    def _check_sources(self) -> None:
        if self.gguf_file is not None and self.model is None:
            raise ValueError(
                "--gguf-file: names a file inside --model (a directory or Hugging Face model id), "
                "so it needs --model"
            )
        if self.tokenizer_revision is not None and self.tokenizer is None:
            raise ValueError(
                "--tokenizer-revision: applies to --tokenizer, which is not given (the model's own "
                "tokenizer follows --revision)"
            )

    def _check_task(self) -> None:
        if self.task not in TASKS:
            raise ValueError(f"--task: must be one of {', '.join(TASKS)}, got {self.task!r}")
        if self.task in ("auto", "generate"):
            return
        for name, given in (
            ("tensor_parallel_size", self.world_size > 1),
            ("speculative_config", self.speculative_config is not None),
            ("gguf_file", self.gguf_file is not None),
            ("quantization", self.quantization not in (None, "auto")),
            ("kv_cache_dtype", self.kv_cache_dtype != "auto"),
            ("graph_backend", self.graph_backend not in ("auto", "eager")),
            ("model_impl", self.model_impl == "transformers"),
        ):
            if given:
                raise ValueError(
                    f"--{name.replace('_', '-')}: not with --task {self.task} (a pooling model "
                    "runs pyxllm's own code eagerly on one rank, unquantized, from a Hugging Face "
                    "directory, with no KV cache)"
                )

    @property
    def ray_kv_transfer(self) -> bool:
        """Whether ``--kv-transfer-push`` or ``--kv-transfer-listen`` names a KV directory in
        the Ray object store (``ray://NAME``)."""
        push = self.kv_transfer_push
        addresses = [push] if isinstance(push, str) else list(push)
        return any(
            isinstance(a, str) and a.startswith(RAY_KV_SCHEME)
            for a in (*addresses, self.kv_transfer_listen)
        )

    def _check_kv_offload(self) -> None:
        if self.kv_offload_max_gib <= 0:
            raise ValueError(f"--kv-offload-max-gib: must be > 0, got {self.kv_offload_max_gib}")
        push = self.kv_transfer_push  # a tuple, as the flags give a list
        self.kv_transfer_push = (push,) if isinstance(push, str) else tuple(push)
        for address in (*self.kv_transfer_push, self.kv_transfer_listen):
            flag = "listen" if address == self.kv_transfer_listen else "push"
            try:
                if ray_kv_directory(address) is not None:
                    continue
            except ValueError as exc:
                raise ValueError(f"--kv-transfer-{flag} {exc}") from None
            host, sep, port = (address or "h:1").rpartition(":")
            if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ValueError(
                    f"--kv-transfer-{flag} {address!r}: must be HOST:PORT or ray://NAME"
                )
        rays = [a for a in self.kv_transfer_push if ray_kv_directory(a) is not None]
        if rays and len(self.kv_transfer_push) > 1:
            raise ValueError(
                f"--kv-transfer-push {rays[0]}: give it alone (a prefill instance puts its blocks "
                "into one Ray directory, or pushes them to HOST:PORT listeners)"
            )
        if self.kv_transfer_push and self.kv_role == "decode":
            raise ValueError("--kv-transfer-push: not with --kv-role decode (it writes nothing)")
        if self.kv_offload_dir is None:
            for flag, given in (
                ("--kv-role " + self.kv_role, self.kv_role != "both"),
                ("--kv-transfer-push", bool(self.kv_transfer_push)),
                ("--kv-transfer-listen", self.kv_transfer_listen is not None),
                ("--kv-offload-max-gib", self.kv_offload_max_gib != DEFAULT_KV_OFFLOAD_MAX_GIB),
            ):
                if given:
                    raise ValueError(
                        f"{flag}: needs --kv-offload-dir (the directory the instances share, "
                        "or each instance's own)"
                    )
            return
        if os.path.exists(self.kv_offload_dir) and not os.path.isdir(self.kv_offload_dir):
            raise ValueError(f"--kv-offload-dir {self.kv_offload_dir}: not a directory")
        if self.ray_kv_transfer:
            import_ray("--kv-transfer-push/--kv-transfer-listen ray://")
        for name, given in (
            ("tensor_parallel_size", self.world_size > 1),
            ("enable_prefix_cache", not self.enable_prefix_cache),
            ("task", self.task not in ("auto", "generate")),
        ):
            if given:
                raise ValueError(
                    f"--{name.replace('_', '-')}: not with --kv-offload-dir (the disk tier "
                    "extends the prefix cache of a one-rank generating engine)"
                )

    def _check_lora(self) -> None:
        for name, value in (("max_loras", self.max_loras), ("max_lora_rank", self.max_lora_rank)):
            if value < 1:
                raise ValueError(f"--{name.replace('_', '-')}: must be >= 1, got {value}")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(
                f"--max-cpu-loras: must be >= --max-loras ({self.max_loras}), got "
                f"{self.max_cpu_loras}"
            )
        if not self.enable_lora:
            return
        for name, given in (
            ("tensor_parallel_size", self.world_size > 1),
            ("speculative_config", self.speculative_config is not None),
            ("graph_backend", self.graph_backend == "compile"),
            ("task", self.task not in ("auto", "generate")),
            ("model_impl", self.model_impl == "transformers"),
        ):
            if given:
                raise ValueError(
                    f"--{name.replace('_', '-')}: not with --enable-lora (adapters run on "
                    "pyxllm's own model code, on the eager or the graph runner, on one rank, "
                    "without speculative decoding, for generation)"
                )

    @property
    def lora_slots(self) -> int:
        """Adapters kept loaded at once: ``max_cpu_loras``, else ``max_loras``."""
        return self.max_cpu_loras or self.max_loras

    def __post_init__(self) -> None:
        self._check_parallel()
        self._check_sources()
        if self.structured_outputs_backend not in STRUCTURED_OUTPUTS_BACKENDS:
            raise ValueError(
                "--structured-outputs-backend: must be one of "
                f"{', '.join(STRUCTURED_OUTPUTS_BACKENDS)}, got {self.structured_outputs_backend!r}"
            )
        if self.dtype not in DTYPES:
            raise ValueError(f"--dtype: must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.quantization == "none":  # vLLM's spelling of no quantization
            self.quantization = None
        if self.quantization not in (None, "auto", *QUANTIZATIONS):
            raise ValueError(
                f"--quantization: must be one of auto, none, {', '.join(QUANTIZATIONS)}, got "
                f"{self.quantization!r}"
            )
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            fp8 = " (fp8 has no CPU kernel in pyxllm; int8 halves the cache as fp8 does)"
            raise ValueError(
                f"--kv-cache-dtype: must be one of {', '.join(KV_CACHE_DTYPES)}, got "
                f"{self.kv_cache_dtype!r}" + (fp8 if "fp8" in str(self.kv_cache_dtype) else "")
            )
        for name in ("max_seqs_per_batch", "max_tokens_per_batch", "block_size"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(
                    f"--{name.replace('_', '-')}: must be >= 1, got {getattr(self, name)}"
                )
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"--max-model-len: must be >= 1, got {self.max_model_len}")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ValueError(f"--kv-cache-memory: must be > 0 GiB, got {self.kv_cache_memory}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(
                f"--gpu-memory-utilization: must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        if self.device not in DEVICES:
            raise ValueError(f"--device: must be one of {', '.join(DEVICES)}, got {self.device!r}")
        kind = GRAPH_BACKEND_ALIASES.get(str(self.graph_backend).strip().lower())
        if kind is None:
            xllm = (a for a in GRAPH_BACKEND_ALIASES if a not in (*GRAPH_BACKENDS, "auto"))
            raise ValueError(
                f"--graph-backend: must be one of auto, {', '.join(GRAPH_BACKENDS)} (or xLLM's "
                f"{', '.join(xllm)}), "
                f"got {self.graph_backend!r}"
            )
        self.graph_backend = kind
        impl = MODEL_IMPL_ALIASES.get(self.model_impl, self.model_impl)
        if impl not in MODEL_IMPLS:
            raise ValueError(
                f"--model-impl: must be one of {', '.join(MODEL_IMPLS)} (or xLLM's python), got "
                f"{self.model_impl!r}"
            )
        self.model_impl = impl
        if self.speculative_config is not None:  # checked now, one line naming the key
            self.speculative_config = SpeculativeConfig.parse(self.speculative_config).to_json()
        self._check_task()
        self._check_lora()
        self._check_kv_offload()
        self._check_frontend()

    def _check_frontend(self) -> None:
        """Normalize ``served_model_name`` and ``allowed_media_domains`` to tuples (a host
        name in lower case); check ``generation_config`` and ``chat_template`` before any model
        loads."""
        domains = self.allowed_media_domains
        domains = (domains,) if isinstance(domains, str) else domains
        self.allowed_media_domains = tuple(d.lower() for d in domains)
        names = self.served_model_name
        if isinstance(names, str):
            names = (names,)
        if names is not None:
            names = tuple(names)
            if not names or not all(isinstance(n, str) and n.strip() for n in names):
                raise ValueError(
                    f"--served-model-name: names must be non-empty strings, got {names!r}"
                )
        self.served_model_name = names
        mode = self.generation_config
        if mode not in GENERATION_CONFIG_MODES:
            path = os.path.join(os.path.expanduser(mode), "generation_config.json")
            if not os.path.isfile(path):
                raise ValueError(
                    f"--generation-config: {mode!r} is neither auto, vllm nor a directory "
                    "holding a generation_config.json"
                )
        load_chat_template(self.chat_template)


def load_chat_template(value: str | None) -> str | None:
    """The chat template ``--chat-template`` gives (vLLM's rule): the text of the file ``value``
    names, else ``value`` itself when it looks like a template (it has ``{``, ``}`` or a
    newline; backslash escapes such as ``\\n`` are decoded, as a shell passes them); ``None``
    for ``None``.

    Raises:
        ValueError: ``value`` looks like a path (no template characters) but cannot be read.
    """
    if value is None:
        return None
    try:
        with open(os.path.expanduser(value), encoding="utf-8") as file:
            return file.read()
    except OSError as exc:
        if not any(c in value for c in "{}\n"):
            raise ValueError(
                f"--chat-template: {value!r} looks like a file path but cannot be read "
                f"({exc.strerror or exc}); give a file or the template text"
            ) from None
    # non-Latin-1 characters pass through as escapes, so only the backslash escapes change
    return value.encode("latin-1", "backslashreplace").decode("unicode_escape")
