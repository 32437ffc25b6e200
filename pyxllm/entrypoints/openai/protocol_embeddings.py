"""``POST /v1/embeddings``'s request and response bodies, OpenAI's fields with vLLM's
extensions (``truncate_prompt_tokens``, ``normalize``)."""

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
