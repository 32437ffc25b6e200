"""vLLM's ``POST /v1/score`` and ``POST /v1/rerank``, as vLLM answers them: on an embedding
model (``--task embed``) each text is embedded (in the engine's steps, as ``/v1/embeddings``
does) and a pair scores the cosine similarity of its two embeddings; on a cross-encoder
(``--task score``, or ``classify`` with one label) each pair is one request, tokenized as a
pair, and scores the model's output for it."""

from __future__ import annotations

import uuid

from fastapi import Request
from fastapi.responses import Response

from pyxllm.entrypoints.openai.errors import OpenAIError
from pyxllm.entrypoints.openai.pooling.embedding import OpenAIServingEmbedding
from pyxllm.entrypoints.openai.pooling.protocol import (
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
from pyxllm.entrypoints.openai.serving_engine import ClientDisconnected
from pyxllm.entrypoints.score_utils import (
    check_cross_encoder,
    cosine_scores,
    distinct_texts,
    score_pairs,
)
from pyxllm.pooling_params import POOLING_TASKS, PoolingParams

# what a server that cannot score lacks
_SCORES_NEED = (
    "scores need a server started with --task embed and an embedding model (cosine "
    "similarity) or --task score and a cross-encoder"
)


class OpenAIServingScore(OpenAIServingEmbedding):
    """Serves ``/v1/score`` and ``/v1/rerank`` from an engine running a pooling task."""

    def check_scores(self, model: str | None, route: str) -> None:
        """:meth:`check_pooling` for a scoring route, and 400 naming ``model`` for a classifier
        of several labels."""
        self.check_pooling(model, route, POOLING_TASKS, _SCORES_NEED)
        if self.engine.task != "embed":
            check_cross_encoder(self.processor.class_labels, route)

    async def _similarities(
        self,
        pairs: list[tuple[str, str]],
        truncate: int | None,
        request_id: str,
        raw_request: Request,
        param: str,
    ) -> tuple[list[float], int]:
        """Each pair's score, and the prompt tokens the scores took, as vLLM counts them: a
        cross-encoder's output for each pair (its tokens as a pair); or the cosine similarity
        of the pair's embeddings (each distinct text embedded once; every text of every pair
        counted); errors about a pair's text name ``param``."""
        if self.engine.task != "embed":
            outputs, num_tokens = await self.embed(
                pairs, None, truncate, request_id, raw_request, param=param
            )
            return [float(out.outputs.data[0]) for out in outputs], num_tokens
        texts = distinct_texts(pairs)
        outputs, _ = await self.embed(texts, PoolingParams(), truncate, request_id, raw_request)
        vectors = {text: out.outputs.data for text, out in zip(texts, outputs)}
        lengths = {text: len(out.prompt_token_ids) for text, out in zip(texts, outputs)}
        return cosine_scores(pairs, vectors), sum(lengths[a] + lengths[b] for a, b in pairs)

    async def create_score(self, request: ScoreRequest, raw_request: Request) -> Response:
        """Answer one score request (raises :class:`OpenAIError` for a bad request)."""
        self.check_scores(request.model, "/v1/score")
        pairs = score_pairs(request.text_1, request.text_2)
        request_id = f"score-{uuid.uuid4().hex}"
        try:
            scores, num_tokens = await self._similarities(
                pairs, request.truncate_prompt_tokens, request_id, raw_request, "text_2"
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
        self.check_scores(request.model, raw_request.url.path)
        if request.top_n is not None and request.top_n < 0:
            raise OpenAIError(f"top_n: must be >= 0, got {request.top_n}", 400, "top_n")
        pairs = score_pairs(request.query, request.documents, ("query", "documents"))
        request_id = f"rerank-{uuid.uuid4().hex}"
        try:
            scores, num_tokens = await self._similarities(
                pairs, request.truncate_prompt_tokens, request_id, raw_request, "documents"
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
