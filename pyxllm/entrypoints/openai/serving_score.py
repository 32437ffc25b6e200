"""vLLM's ``POST /v1/score`` and ``POST /v1/rerank`` on an embedding model (``--task embed``):
each text is embedded (in the engine's steps, as ``/v1/embeddings`` does) and a pair scores
the cosine similarity of its two embeddings, as vLLM scores with an embedding model."""

from __future__ import annotations

import uuid

import torch
import torch.nn.functional as F
from fastapi import Request
from fastapi.responses import Response

from pyxllm.entrypoints.openai.errors import OpenAIError
from pyxllm.entrypoints.openai.protocol_embeddings import (
    MAX_EMBEDDING_INPUTS,
    EmbeddingUsage,
    RerankDocument,
    RerankRequest,
    RerankResponse,
    RerankResult,
    RerankUsage,
    ScoreData,
    ScoreRequest,
    ScoreResponse,
)
from pyxllm.entrypoints.openai.serving_embedding import OpenAIServingEmbedding
from pyxllm.entrypoints.openai.serving_engine import ClientDisconnected
from pyxllm.pooling_params import PoolingParams


def score_pairs(
    text_1: str | list[str], text_2: str | list[str], names: tuple[str, str] = ("text_1", "text_2")
) -> list[tuple[str, str]]:
    """The ``(text_1, text_2)`` pairs of a score request: one text against each of several
    (1 to N, either side), or two lists of one length pairwise; ``names`` are the request's
    fields for the two sides (a rerank's ``query`` and ``documents``).

    Raises:
        OpenAIError: 400 naming the field: an empty list or text, lists of different lengths,
            or more than :data:`MAX_EMBEDDING_INPUTS` pairs.
    """
    left = [text_1] if isinstance(text_1, str) else list(text_1)
    right = [text_2] if isinstance(text_2, str) else list(text_2)
    for name, texts in zip(names, (left, right)):
        if not texts or "" in texts:
            raise OpenAIError(f"{name}: must not be empty", 400, name)
    if len(left) == 1:
        left = left * len(right)
    elif len(right) == 1:
        right = right * len(left)
    elif len(left) != len(right):
        raise OpenAIError(
            f"{names[1]}: {len(right)} texts for {len(left)} in {names[0]}; give one text on a "
            "side, or lists of one length",
            400,
            names[1],
        )
    if len(left) > MAX_EMBEDDING_INPUTS:
        raise OpenAIError(
            f"{names[1]}: at most {MAX_EMBEDDING_INPUTS} pairs per request, got {len(left)}",
            400,
            names[1],
        )
    return list(zip(left, right))


class OpenAIServingScore(OpenAIServingEmbedding):
    """Serves ``/v1/score`` and ``/v1/rerank`` from an engine running ``--task embed``."""

    async def _similarities(
        self,
        pairs: list[tuple[str, str]],
        truncate: int | None,
        request_id: str,
        raw_request: Request,
    ) -> tuple[list[float], int]:
        """The cosine similarity of each pair's embeddings (each distinct text embedded once),
        and the prompt tokens of every text of the pairs, as vLLM counts them."""
        texts = list(dict.fromkeys(text for pair in pairs for text in pair))
        outputs, _ = await self.embed(
            texts, PoolingParams(normalize=True), truncate, request_id, raw_request
        )
        vectors = {text: out.outputs.data for text, out in zip(texts, outputs)}
        lengths = {text: len(out.prompt_token_ids) for text, out in zip(texts, outputs)}
        left = torch.stack([vectors[a] for a, _ in pairs])
        right = torch.stack([vectors[b] for _, b in pairs])
        scores = F.cosine_similarity(left, right, dim=-1).tolist()
        return scores, sum(lengths[a] + lengths[b] for a, b in pairs)

    async def create_score(self, request: ScoreRequest, raw_request: Request) -> Response:
        """Answer one score request (raises :class:`OpenAIError` for a bad request)."""
        self.check_embeds(request.model, "/v1/score")
        pairs = score_pairs(request.text_1, request.text_2)
        request_id = f"score-{uuid.uuid4().hex}"
        try:
            scores, num_tokens = await self._similarities(
                pairs, request.truncate_prompt_tokens, request_id, raw_request
            )
        except ClientDisconnected:
            return Response(status_code=499)
        response = ScoreResponse(
            id=request_id,
            model=self.model_name,
            data=[ScoreData(index=i, score=score) for i, score in enumerate(scores)],
            usage=EmbeddingUsage(prompt_tokens=num_tokens, total_tokens=num_tokens),
        )
        return Response(response.model_dump_json(), media_type="application/json")

    async def create_rerank(self, request: RerankRequest, raw_request: Request) -> Response:
        """Answer one rerank request (raises :class:`OpenAIError` for a bad request)."""
        self.check_embeds(request.model, raw_request.url.path)
        if request.top_n is not None and request.top_n < 0:
            raise OpenAIError(f"top_n: must be >= 0, got {request.top_n}", 400, "top_n")
        pairs = score_pairs(request.query, request.documents, ("query", "documents"))
        request_id = f"rerank-{uuid.uuid4().hex}"
        try:
            scores, num_tokens = await self._similarities(
                pairs, request.truncate_prompt_tokens, request_id, raw_request
            )
        except ClientDisconnected:
            return Response(status_code=499)
        order = sorted(range(len(scores)), key=lambda i: -scores[i])
        if request.top_n:
            order = order[: request.top_n]
        response = RerankResponse(
            id=request_id,
            model=self.model_name,
            results=[
                RerankResult(
                    index=i,
                    document=RerankDocument(text=request.documents[i]),
                    relevance_score=scores[i],
                )
                for i in order
            ],
            usage=RerankUsage(total_tokens=num_tokens),
        )
        return Response(response.model_dump_json(), media_type="application/json")
