"""Per-request pooling parameters (an embedding request's), with vLLM's names."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class PoolingParams:
    """How one embedding request's pooled vector is finished (vLLM's ``PoolingParams``).

    Attributes:
        dimensions: keep the first ``dimensions`` values of the pooled vector (Matryoshka
            truncation, OpenAI's ``dimensions``), then normalize again where the model
            normalizes; ``None``: the whole vector (``hidden_size`` values).
        normalize: L2-normalize the vector; ``None``: as the model says (sentence-transformers'
            ``Normalize`` module, see :mod:`pyxllm.weights.pooling_config`).

    Raises:
        ValueError: ``dimensions`` below 1 (naming the field).
    """

    dimensions: int | None = None
    normalize: bool | None = None

    def __post_init__(self) -> None:
        if self.dimensions is not None and self.dimensions < 1:
            raise ValueError(f"dimensions: must be >= 1, got {self.dimensions}")
