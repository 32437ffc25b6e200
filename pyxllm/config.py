"""The one engine configuration: every CLI flag maps onto a field here."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from pyxllm.distributed.address import parse_master_addr
from pyxllm.distributed.ray_utils import PLACEMENT_STRATEGIES, import_ray
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
# the per-step token budget when --max-tokens-per-batch is not given (see EngineConfig.token_budget)
DEFAULT_MAX_TOKENS_PER_BATCH = 2048
# --generation-config's words (vLLM's); anything else is a directory
GENERATION_CONFIG_MODES = ("auto", "vllm")
# vLLM's (and xLLM's) names of EngineConfig fields, accepted as flags and as LLM(...) keywords
FIELD_ALIASES = {
    "max_num_seqs": "max_seqs_per_batch",
    "max_num_batched_tokens": "max_tokens_per_batch",
    "enable_prefix_caching": "enable_prefix_cache",
    "master_node_addr": "master_addr",
}
GIB = 2**30
# who starts and places the tensor-parallel ranks (pyxllm.executor): processes of this host
# (spawned, or started by hand with --nnodes), or Ray actors (pyxllm.executor.ray_executor)
DISTRIBUTED_EXECUTOR_BACKENDS = ("mp", "ray")
# which code runs the model (vLLM's --model-impl); xLLM's "python" is pyxllm's own
MODEL_IMPLS = ("auto", "pyxllm", "transformers")
MODEL_IMPL_ALIASES = {"python": "pyxllm"}
# what the engine serves (vLLM's --task): text (generate) or embeddings (embed: an embedding
# model and a pooler, see pyxllm.executor.pooling_executor); auto: embed for an encoder, else
# generate (pyxllm.executor.tasks)
TASKS = ("auto", "generate", "embed")
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


@dataclass(slots=True)
class EngineConfig:
    """Settings of an engine instance; ``pyxllm serve`` flags are these names with dashes.

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
      matmuls on their row-invariant integer path at any row count, and float32 matmuls on
      the CPU on a row-wise kernel instead of BLAS. bfloat16 matmuls (oneDNN) and the W8A8
      ones do not promise it yet; the executor says at start-up what is covered.
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

    model: str | None = None
    revision: str | None = None
    download_dir: str | None = None
    gguf_file: str | None = None
    tokenizer: str | None = None
    tokenizer_revision: str | None = None
    served_model_name: tuple[str, ...] | None = None
    task: str = "auto"
    model_impl: str = "auto"
    dtype: str = "auto"
    quantization: str | None = "auto"
    device: str = "auto"
    graph_backend: str = "auto"
    max_seqs_per_batch: int = 64
    max_tokens_per_batch: int | None = None
    max_model_len: int | None = None
    block_size: int = 16
    kv_cache_memory: float | None = None
    kv_cache_dtype: str = "auto"
    gpu_memory_utilization: float = 0.9
    enable_chunked_prefill: bool = True
    enable_prefix_cache: bool = True
    batch_invariant: bool = True
    seed: int = 0
    tensor_parallel_size: int = 1
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str | None = None
    dist_init_timeout: float = 120.0
    distributed_executor_backend: str = "mp"
    ray_address: str | None = None
    ray_placement_strategy: str | None = None
    structured_outputs_backend: str = "llguidance"
    speculative_config: str | None = None
    generation_config: str = "auto"
    chat_template: str | None = None

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineConfig:
        """The config of keyword arguments in pyxllm's or vLLM's names (:data:`FIELD_ALIASES`,
        and ``kv_cache_memory_bytes``, vLLM's KV cache size in bytes), as ``LLM(...)`` takes
        them.

        Raises:
            TypeError: an unknown keyword, or one field given under two names.
            ValueError: a value out of range (naming the flag).
        """
        for alias, name in FIELD_ALIASES.items():
            if alias in kwargs:
                if name in kwargs:
                    raise TypeError(f"got both {alias!r} and {name!r}; give one of them")
                kwargs[name] = kwargs.pop(alias)
        nbytes = kwargs.pop("kv_cache_memory_bytes", None)
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
            for name in ("ray_address", "ray_placement_strategy"):
                if getattr(self, name) is not None:
                    raise ValueError(
                        f"--{name.replace('_', '-')}: applies to --distributed-executor-backend "
                        "ray only"
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
        if self.task != "embed":
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
                    f"--{name.replace('_', '-')}: not with --task embed (an embedding model runs "
                    "pyxllm's own code eagerly on one rank, unquantized, from a Hugging Face "
                    "directory, with no KV cache)"
                )

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
        self._check_frontend()

    def _check_frontend(self) -> None:
        """Normalize ``served_model_name`` to a tuple; check ``generation_config`` and
        ``chat_template`` before any model loads."""
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
