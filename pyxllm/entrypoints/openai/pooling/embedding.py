"""``POST /v1/embeddings`` (served with ``--task embed``): inputs -> embedding requests, all in
the engine at once (so they share its steps) -> one JSON answer."""

from __future__ import annotations

import asyncio
import base64
import logging
import uuid

import torch
from fastapi import Request
from fastapi.responses import Response

from pyxllm.engine.input_processor import EngineRequest, TokensPrompt
from pyxllm.entrypoints.openai.errors import OpenAIError
from pyxllm.entrypoints.openai.pooling.protocol import (
    MAX_EMBEDDING_INPUTS,
    EmbeddingData,
    EmbeddingRequest,
    EmbeddingResponse,
    EmbeddingUsage,
)
from pyxllm.entrypoints.openai.serving_engine import (
    ClientDisconnected,
    OpenAIServing,
    _wait_for_disconnect,
)
from pyxllm.outputs import PoolingRequestOutput
from pyxllm.pooling_params import PoolingParams

logger = logging.getLogger(__name__)


def embedding_inputs(request: EmbeddingRequest) -> list[str | TokensPrompt]:
    """The request's inputs, each a text or token ids (a list of ints is one input).

    Raises:
        OpenAIError: 400 naming ``input`` when there is none or more than
            :data:`MAX_EMBEDDING_INPUTS`.
    """
    value = request.input
    if isinstance(value, str) or (value and isinstance(value[0], int)):
        value = [value]
    if not value:
        raise OpenAIError("input: must not be empty", 400, "input")
    if len(value) > MAX_EMBEDDING_INPUTS:
        raise OpenAIError(
            f"input: at most {MAX_EMBEDDING_INPUTS} inputs per request, got {len(value)}",
            400,
            "input",
        )
    return [item if isinstance(item, str) else TokensPrompt(item, param="input") for item in value]


def encode_embedding(vector: torch.Tensor, encoding_format: str) -> list[float] | str:
    """``vector`` (``float32``) as the response carries it: a list of floats, or for
    ``base64`` its little-endian float32 bytes in base64 (OpenAI's encoding)."""
    if encoding_format == "base64":
        data = vector.to(torch.float32).contiguous().numpy().astype("<f4").tobytes()
        return base64.b64encode(data).decode("ascii")
    return vector.tolist()


class OpenAIServingEmbedding(OpenAIServing):
    """Serves ``POST /v1/embeddings`` from an engine running ``--task embed``."""

    def check_pooling(
        self, model: str | None, route: str, tasks: tuple[str, ...], needs: str
    ) -> None:
        """The checks before any pooling route: 404 for an unknown ``model``, 400 naming
        ``route`` and the task when the server's task is not in ``tasks`` (``needs`` says what
        would serve it), 503 when the engine cannot serve or drains."""
        self.check_model(model)
        task = self.engine.task
        if task not in tasks:
            raise OpenAIError(f"{route}: this server runs --task {task}; {needs}", 400, "model")
        self.check_health()
        self.check_not_draining()

    def check_embeds(self, model: str | None, route: str) -> None:
        """:meth:`check_pooling` for a route that needs an embedding model (``--task embed``)."""
        self.check_pooling(
            model,
            route,
            ("embed",),
            "embeddings need a server started with --task embed and an embedding model",
        )

    async def embed(
        self,
        inputs: list[str | tuple[str, str] | TokensPrompt],
        params: PoolingParams | None,
        truncate_prompt_tokens: int | None,
        request_id: str,
        raw_request: Request,
        param: str = "input",
    ) -> tuple[list[PoolingRequestOutput], int]:
        """Pool ``inputs`` (texts, text pairs for a cross-encoder, or token ids; processed on
        the tokenizer thread, then run in the engine at once): their outputs in order, and
        their prompt tokens in all; errors about a text name ``param``.

        Raises:
            InvalidRequestError: an input or parameter the input processor refuses.
            ClientDisconnected: the client went away first (what ran is aborted).
            OpenAIError: the engine refused or failed a request.
        """

        def process_all() -> list[EngineRequest]:  # on the tokenizer thread, in one go
            return [
                self.processor.process_pooling(
                    f"{request_id}-{i}", item, params, truncate_prompt_tokens, param=param
                )
                for i, item in enumerate(inputs)
            ]

        requests = await self.on_tokenizer_thread(process_all)
        outputs = await self._run_all(requests, raw_request, request_id)
        return outputs, sum(len(r.prompt_token_ids) for r in requests)

    async def create_embedding(self, request: EmbeddingRequest, raw_request: Request) -> Response:
        """Answer one embeddings request (raises :class:`OpenAIError` for a bad request: 400
        naming the field, 404 for an unknown model, 400 when the server does not embed)."""
        self.check_embeds(request.model, "/v1/embeddings")
        inputs = embedding_inputs(request)
        try:
            params = PoolingParams(request.dimensions, request.normalize)
        except ValueError as exc:
            raise OpenAIError(str(exc), 400, "dimensions") from exc
        request_id = f"embd-{uuid.uuid4().hex}"
        truncate = request.truncate_prompt_tokens
        try:
            outputs, num_tokens = await self.embed(
                inputs, params, truncate, request_id, raw_request
            )
        except ClientDisconnected:
            return Response(status_code=499)
        response = EmbeddingResponse(
            id=request_id,
            model=self.model_name,
            data=[
                EmbeddingData(
                    index=i, embedding=encode_embedding(out.outputs.data, request.encoding_format)
                )
                for i, out in enumerate(outputs)
            ],
            usage=EmbeddingUsage(prompt_tokens=num_tokens, total_tokens=num_tokens),
        )
        return Response(response.model_dump_json(), media_type="application/json")

    async def _run_all(
        self, requests: list[EngineRequest], raw_request: Request, request_id: str
    ) -> list[PoolingRequestOutput]:
        """Run every request in the engine at once and return their outputs in order; raises
        :class:`ClientDisconnected` (after aborting what runs) if the client goes away first,
        :class:`OpenAIError` if the engine refuses one (the others are aborted)."""

        async def run(request: EngineRequest) -> PoolingRequestOutput:
            final = None
            async for output in self.engine.generate(request):  # aborts it when cancelled
                final = output
            return final

        tasks = [asyncio.ensure_future(run(r)) for r in requests]
        gathered = asyncio.gather(*tasks)
        watch_task = asyncio.ensure_future(_wait_for_disconnect(raw_request))
        try:
            await asyncio.wait({gathered, watch_task}, return_when=asyncio.FIRST_COMPLETED)
            if not gathered.done():
                logger.info("client disconnected; aborting %s", request_id)
                raise ClientDisconnected(request_id)
            try:
                return gathered.result()
            except (ValueError, RuntimeError) as exc:
                raise self.engine_error(exc, request_id) from exc
        finally:
            watch_task.cancel()
            for task in tasks:
                if not task.done():
                    task.cancel()
            if not gathered.done():
                gathered.cancel()
