"""vLLM's ``POST /classify`` (a classifier's class probabilities, ``--task classify`` or
``score``) and ``POST /pooling`` (the model's pooled output under any pooling task, as
``LLM.encode``), beside the embedding and scoring routes of the same handler."""

from __future__ import annotations

import uuid

from fastapi import Request
from fastapi.responses import Response

from pyxllm.entrypoints.openai.pooling.embedding import embedding_inputs, encode_embedding
from pyxllm.entrypoints.openai.pooling.protocol import (
    ClassificationData,
    ClassificationRequest,
    ClassificationResponse,
    EmbeddingUsage,
    PoolingData,
    PoolingRequest,
    PoolingResponse,
)
from pyxllm.entrypoints.openai.pooling.score import OpenAIServingScore
from pyxllm.entrypoints.openai.serving_engine import ClientDisconnected
from pyxllm.pooling_params import POOLING_TASKS


class OpenAIServingPooling(OpenAIServingScore):
    """Serves every pooling route: ``/v1/embeddings``, ``/v1/score``, ``/v1/rerank`` (see the
    base classes), ``/classify`` and ``/pooling``."""

    async def create_classify(
        self, request: ClassificationRequest, raw_request: Request
    ) -> Response:
        """Answer one classification request (raises :class:`OpenAIError` for a bad request:
        400 naming the field, 404 for an unknown model, 400 naming ``model`` when the server
        does not classify)."""
        self.check_pooling(
            request.model,
            "/classify",
            ("score", "classify"),
            "classes need a server started with --task classify (or score) and a "
            "*ForSequenceClassification model",
        )
        inputs = embedding_inputs(request)
        request_id = f"classify-{uuid.uuid4().hex}"
        try:
            outputs, num_tokens = await self.embed(
                inputs, None, request.truncate_prompt_tokens, request_id, raw_request
            )
        except ClientDisconnected:
            return Response(status_code=499)
        labels = self.processor.class_labels or ()
        data = []
        for i, out in enumerate(outputs):
            probs = out.outputs.data
            best = int(probs.argmax())
            label = labels[best] if best < len(labels) else None
            data.append(
                ClassificationData(
                    index=i, label=label, probs=probs.tolist(), num_classes=len(probs)
                )
            )
        response = ClassificationResponse(
            id=request_id,
            model=self.model_name,
            data=data,
            usage=EmbeddingUsage(prompt_tokens=num_tokens, total_tokens=num_tokens),
        )
        return Response(response.model_dump_json(), media_type="application/json")

    async def create_pooling(self, request: PoolingRequest, raw_request: Request) -> Response:
        """Answer one pooling request (raises :class:`OpenAIError` for a bad request, as
        :meth:`create_classify`)."""
        self.check_pooling(
            request.model,
            "/pooling",
            POOLING_TASKS,
            "pooled outputs need a server started with --task embed, score or classify",
        )
        inputs = embedding_inputs(request)
        request_id = f"pool-{uuid.uuid4().hex}"
        try:
            outputs, num_tokens = await self.embed(
                inputs, None, request.truncate_prompt_tokens, request_id, raw_request
            )
        except ClientDisconnected:
            return Response(status_code=499)
        response = PoolingResponse(
            id=request_id,
            model=self.model_name,
            data=[
                PoolingData(
                    index=i, data=encode_embedding(out.outputs.data, request.encoding_format)
                )
                for i, out in enumerate(outputs)
            ],
            usage=EmbeddingUsage(prompt_tokens=num_tokens, total_tokens=num_tokens),
        )
        return Response(response.model_dump_json(), media_type="application/json")
