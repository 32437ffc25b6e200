"""The bodies of the pooling routes: ``POST /v1/embeddings`` (OpenAI's fields with vLLM's
extensions ``truncate_prompt_tokens`` and ``normalize``); vLLM's ``POST /v1/score`` and
``POST /v1/rerank`` (Jina's and Cohere's shape), which an embedding model answers with the
cosine similarity of two embeddings and a cross-encoder with its output for the pair; vLLM's
``POST /classify`` (a classifier's class probabilities) and ``POST /pooling`` (the model's
pooled output, as ``LLM.encode``)."""

from __future__ import annotations

import time
from typing import Literal

from pydantic import Field

from pyxllm.entrypoints.openai.protocol import OpenAIBaseModel, RequestModel

# Most inputs one request may embed (OpenAI's limit for an embeddings array)
MAX_EMBEDDING_INPUTS = 2048


class EmbeddingRequest(RequestModel):
    """``POST /v1/embeddings``: ``input`` is one text, several, one token-id list or several.

    ``encoding_format``: ``float`` (a list of numbers) or ``base64`` (the float32
    little-endian bytes, base64-encoded: OpenAI's format, which its client asks for by default).
    ``dimensions``: keep the first ones, renormalized (see ``PoolingParams``).
    ``truncate_prompt_tokens`` (vLLM's): keep at most this many tokens of each input (``-1``:
    ``max_model_len``) instead of refusing a longer one; ``normalize`` (vLLM's): override
    the model's normalization.
    """

    input: str | list[str] | list[int] | list[list[int]]
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None
    truncate_prompt_tokens: int | None = None
    normalize: bool | None = None


class EmbeddingData(OpenAIBaseModel):
    """One input's embedding, at its ``index`` in the request's inputs."""

    index: int
    object: Literal["embedding"] = "embedding"
    embedding: list[float] | str


class EmbeddingUsage(OpenAIBaseModel):
    """Token counts of an embeddings request (prompt tokens only, as OpenAI's)."""

    prompt_tokens: int = 0
    total_tokens: int = 0


class EmbeddingResponse(OpenAIBaseModel):
    """The body of ``POST /v1/embeddings``'s answer."""

    id: str
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[EmbeddingData]
    usage: EmbeddingUsage


class ScoreRequest(RequestModel):
    """``POST /v1/score`` (vLLM's): the similarity of ``text_1`` to ``text_2``, one pair each
    (``text_1`` one text and ``text_2`` several: 1 to N; two lists of one length: pairwise)."""

    model: str | None = None
    text_1: str | list[str]
    text_2: str | list[str]
    truncate_prompt_tokens: int | None = None


class ScoreData(OpenAIBaseModel):
    """The score of pair ``index``: the cosine similarity of its two embeddings, in [-1, 1],
    or a cross-encoder's output for the pair (sigmoid of its logit, in [0, 1])."""

    index: int
    object: Literal["score"] = "score"
    score: float


class ScoreResponse(OpenAIBaseModel):
    """The body of ``POST /v1/score``'s answer."""

    id: str
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[ScoreData]
    usage: EmbeddingUsage


class RerankRequest(RequestModel):
    """``POST /v1/rerank`` (vLLM's, Jina's and Cohere's shape): ``documents`` ordered by their
    similarity to ``query``; ``top_n`` keeps the best ones (``None`` or 0: all)."""

    model: str | None = None
    query: str
    documents: list[str]
    top_n: int | None = None
    truncate_prompt_tokens: int | None = None


class RerankDocument(OpenAIBaseModel):
    """A reranked document's text."""

    text: str


class RerankResult(OpenAIBaseModel):
    """One document: its ``index`` in the request, its text and its score."""

    index: int
    document: RerankDocument
    relevance_score: float


class RerankUsage(OpenAIBaseModel):
    """Tokens of the query and every document, as vLLM counts them."""

    total_tokens: int = 0


class RerankResponse(OpenAIBaseModel):
    """The body of ``POST /v1/rerank``'s answer: results by decreasing score."""

    id: str
    model: str
    results: list[RerankResult]
    usage: RerankUsage


class ClassificationRequest(RequestModel):
    """``POST /classify`` (vLLM's): ``input`` as ``/v1/embeddings``' (texts or token ids), each
    classified by the model; ``truncate_prompt_tokens`` as there."""

    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    truncate_prompt_tokens: int | None = None
    user: str | None = None


class ClassificationData(OpenAIBaseModel):
    """Input ``index``'s class probabilities (``probs``, one per class: softmax over the
    logits for several labels), its most probable class's ``label`` (the model's
    ``id2label``) and ``num_classes``."""

    index: int
    label: str | None
    probs: list[float]
    num_classes: int


class ClassificationResponse(OpenAIBaseModel):
    """The body of ``POST /classify``'s answer."""

    id: str
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[ClassificationData]
    usage: EmbeddingUsage


class PoolingRequest(RequestModel):
    """``POST /pooling`` (vLLM's): ``input`` as ``/v1/embeddings``', each answered with the
    model's pooled output (an embedding model's embedding as ``/v1/embeddings`` gives it by
    default, a classifier's class probabilities); ``encoding_format`` and
    ``truncate_prompt_tokens`` as there."""

    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    truncate_prompt_tokens: int | None = None
    user: str | None = None


class PoolingData(OpenAIBaseModel):
    """Input ``index``'s pooled output: a list of floats, or base64 as an embedding's."""

    index: int
    object: Literal["pooling"] = "pooling"
    data: list[float] | str


class PoolingResponse(OpenAIBaseModel):
    """The body of ``POST /pooling``'s answer."""

    id: str
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[PoolingData]
    usage: EmbeddingUsage
