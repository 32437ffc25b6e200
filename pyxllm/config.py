"""The one engine configuration: every CLI flag maps onto a field here."""
from __future__ import annotations

from dataclasses import dataclass

DTYPES = ("auto", "float32", "bfloat16", "float16")
DEVICES = ("auto", "cpu", "cuda", "npu", "mlu")
GRAPH_BACKENDS = ("eager", "compile", "graph")
# xLLM's spellings of --graph-backend, and ours, -> the runner kind
GRAPH_BACKEND_ALIASES = {
    "eager": "eager", "off": "eager", "none": "eager",
    "compile": "compile", "inductor": "compile",
    "graph": "graph", "cudagraphs": "graph", "aclgraph": "graph",
}


@dataclass(slots=True)
class EngineConfig:
    """Settings of an engine instance; ``pyxllm serve`` flags are these names with dashes.

    Units: ``kv_cache_memory`` in GiB, ``gpu_memory_utilization`` a fraction of the card's
    memory, ``max_model_len`` / ``max_tokens_per_batch`` / ``block_size`` in tokens.

    - ``model``: ``None`` (the embedded SmolLM2-135M-Instruct GGUF), a ``.gguf`` file, or a
      Hugging Face directory.
    - ``max_model_len``: ``None`` takes the model's ``max_position_embeddings``.
    - ``enable_chunked_prefill``: a long prompt is prefilled over several steps, sharing each
      step's ``max_tokens_per_batch`` budget with running decodes. Off, a prompt is prefilled
      in one step and must fit the budget.
    - ``enable_prefix_cache``: full KV blocks stay cached (by a hash of their prefix) after
      their request ends, and a request whose prompt starts with cached blocks skips them.
    - ``device``: ``auto`` picks CUDA, then NPU, then MLU, else the CPU (see ``pyxllm.platforms``).
    - ``graph_backend``: ``eager``, ``compile`` (``torch.compile``) or ``graph`` (decode steps
      captured as CUDA/ACL graphs); xLLM's ``off``/``none``, ``inductor`` and
      ``cudagraphs``/``aclgraph`` are read as these and stored normalized.
    - ``kv_cache_memory``: ``None`` sizes the cache from ``gpu_memory_utilization`` on an
      accelerator and takes 2 GiB on the CPU.

    Raises:
        ValueError: a value out of range; the message names the flag.
    """

    model: str | None = None
    served_model_name: str | None = None
    dtype: str = "auto"
    device: str = "auto"
    graph_backend: str = "eager"
    max_seqs_per_batch: int = 64
    max_tokens_per_batch: int = 2048
    max_model_len: int | None = None
    block_size: int = 16
    kv_cache_memory: float | None = None
    gpu_memory_utilization: float = 0.9
    enable_chunked_prefill: bool = True
    enable_prefix_cache: bool = True
    seed: int = 0

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"--dtype: must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        for name in ("max_seqs_per_batch", "max_tokens_per_batch", "block_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')}: must be >= 1, got {getattr(self, name)}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"--max-model-len: must be >= 1, got {self.max_model_len}")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ValueError(f"--kv-cache-memory: must be > 0 GiB, got {self.kv_cache_memory}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"--gpu-memory-utilization: must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.device not in DEVICES:
            raise ValueError(f"--device: must be one of {', '.join(DEVICES)}, got {self.device!r}")
        kind = GRAPH_BACKEND_ALIASES.get(str(self.graph_backend).strip().lower())
        if kind is None:
            raise ValueError(
                f"--graph-backend: must be one of {', '.join(GRAPH_BACKENDS)} (or xLLM's "
                f"{', '.join(a for a in GRAPH_BACKEND_ALIASES if a not in GRAPH_BACKENDS)}), "
                f"got {self.graph_backend!r}"
            )
        self.graph_backend = kind
