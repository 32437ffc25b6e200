"""Per-request pooling parameters (an embedding, scoring or classification request's), with
vLLM's names, and the engine tasks that pool."""

from __future__ import annotations

from dataclasses import dataclass

# the engine tasks (``--task``) whose requests end with a pooled output instead of text:
# embeddings, a cross-encoder's scores, a classifier's class probabilities
POOLING_TASKS = ("embed", "score", "classify")


@dataclass(frozen=True, slots=True)
class PoolingParams:
    """How one embedding request's pooled vector is finished (vLLM's ``PoolingParams``).

    Attributes:
        dimensions: keep the first ``dimensions`` values of the pooled vector (Matryoshka
            truncation, OpenAI's ``dimensions``), then normalize again where the model
            normalizes; ``None``: the whole vector (``hidden_size`` values).
        normalize: L2-normalize the vector; ``None``: as the model says (sentence-transformers'
            ``Normalize`` module, see :mod:`pyxllm.weights.pooling_config`).
        token_type_start: the index of the prompt's first token of type 1 (BERT's
            ``token_type_ids``: a text pair's second segment starts there, after the first
            segment's ``[SEP]``); ``None``: every token has type 0. Set by the input processor
            when it tokenizes a pair for a cross-encoder (vLLM carries the same index as
            ``compressed_token_type_ids``). Why a per-request field rather than the model
            finding the first ``[SEP]`` of each sequence: the tokenizer that made the pair
            knows where its segments meet, the model's config does not know ``[SEP]``'s id,
            and a first text that itself holds ``[SEP]`` would be split in the wrong place.

    Raises:
        ValueError: ``dimensions`` below 1, or a negative ``token_type_start`` (naming the
            field).
    """

    dimensions: int | None = None
    normalize: bool | None = None
    token_type_start: int | None = None

    def __post_init__(self) -> None:
        if self.dimensions is not None and self.dimensions < 1:
            raise ValueError(f"dimensions: must be >= 1, got {self.dimensions}")
        if self.token_type_start is not None and self.token_type_start < 0:
            raise ValueError(f"token_type_start: must be >= 0, got {self.token_type_start}")
