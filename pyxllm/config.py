"""The one engine configuration: every CLI flag maps onto a field here."""
from __future__ import annotations

from dataclasses import dataclass

DTYPES = ("auto", "float32", "bfloat16", "float16")


@dataclass(slots=True)
class EngineConfig:
    """Settings of an engine instance; ``pyxllm serve`` flags are these names with dashes.

    Units: ``kv_cache_memory`` in GiB, ``max_model_len`` / ``max_tokens_per_batch`` /
    ``block_size`` in tokens.

    - ``model``: ``None`` (the embedded SmolLM2-135M-Instruct GGUF), a ``.gguf`` file, or a
      Hugging Face directory.
    - ``max_model_len``: ``None`` takes the model's ``max_position_embeddings``.
    - ``enable_chunked_prefill``: a long prompt is prefilled over several steps, sharing each
      step's ``max_tokens_per_batch`` budget with running decodes. Off, a prompt is prefilled
      in one step and must fit the budget.

    Raises:
        ValueError: a value out of range; the message names the flag.
    """

    model: str | None = None
    served_model_name: str | None = None
    dtype: str = "auto"
    device: str = "cpu"
    max_seqs_per_batch: int = 64
    max_tokens_per_batch: int = 2048
    max_model_len: int | None = None
    block_size: int = 16
    kv_cache_memory: float = 2.0
    enable_chunked_prefill: bool = True
    seed: int = 0

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"--dtype: must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        for name in ("max_seqs_per_batch", "max_tokens_per_batch", "block_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')}: must be >= 1, got {getattr(self, name)}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"--max-model-len: must be >= 1, got {self.max_model_len}")
        if self.kv_cache_memory <= 0:
            raise ValueError(f"--kv-cache-memory: must be > 0 GiB, got {self.kv_cache_memory}")
