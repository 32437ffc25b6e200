"""LoRA adapters over HTTP (``--enable-lora``): the adapters of ``--lora-modules`` loaded at
start-up, listed by ``GET /v1/models`` with their ``parent``, named by requests as their
``model``, and vLLM's ``POST /v1/load_lora_adapter`` / ``POST /v1/unload_lora_adapter`` behind
``--allow-runtime-lora-updating`` (or ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=true``), answering as
vLLM does (plain-text success messages; errors as OpenAI JSON: 400, or 404 for a directory that
is not there or a name that is not served)."""

from __future__ import annotations

import os

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse, Response

from pyxllm.engine.protocol import EngineClient
from pyxllm.entrypoints.openai.errors import OpenAIError, param_from_message
from pyxllm.entrypoints.openai.protocol import RequestModel
from pyxllm.lora_request import LoRARequest

RUNTIME_UPDATING_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"


def runtime_updating_allowed(flag: bool, environ=os.environ) -> bool:
    """``--allow-runtime-lora-updating``, or vLLM's variable set to true (or 1)."""
    return flag or environ.get(RUNTIME_UPDATING_ENV, "").strip().lower() in ("1", "true")


def next_lora_id(engine: EngineClient) -> int:
    """An adapter id no served adapter has."""
    return 1 + max((r.lora_int_id for r in engine.lora_requests.values()), default=0)


async def load_lora(engine: EngineClient, name: str, path: str, base_model_name=None) -> None:
    """Load and serve an adapter as ``name``.

    Raises:
        OpenAIError: 400 for a name served already or an adapter that cannot be served, 404
            when its directory or files are not there (naming ``lora_name`` / ``lora_path``).
    """
    if name in engine.served_model_names:
        raise OpenAIError(
            f"lora_name: {name!r} is the served model's name; give the adapter another",
            400,
            "lora_name",
        )
    if name in engine.lora_requests:
        raise OpenAIError(f"The lora adapter '{name}' has already been loaded.", 400, "lora_name")
    try:
        request = LoRARequest(name, next_lora_id(engine), path, base_model_name)
        await engine.add_lora(request)
    except ValueError as exc:
        # an adapter that cannot be served (LoRAAdapterError, with not_found) is its path's
        # fault; other refusals name their field ("lora_name: ...") or a flag
        not_found = getattr(exc, "not_found", None)
        param = "lora_path" if not_found is not None else param_from_message(str(exc))
        raise OpenAIError(str(exc), 404 if not_found else 400, param) from exc


class LoadLoRAAdapterRequest(RequestModel):
    """The body of ``POST /v1/load_lora_adapter`` (vLLM's)."""

    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(RequestModel):
    """The body of ``POST /v1/unload_lora_adapter`` (vLLM's; ``lora_int_id`` is accepted and
    not needed)."""

    lora_name: str
    lora_int_id: int | None = None


router = APIRouter()


@router.post("/v1/load_lora_adapter")
async def load_lora_adapter(request: LoadLoRAAdapterRequest, raw_request: Request) -> Response:
    """Load a LoRA adapter and serve it under ``lora_name``."""
    request.check_unknown_fields(raw_request.app.state.ignore_unknown_fields)
    await load_lora(raw_request.app.state.engine, request.lora_name, request.lora_path)
    return PlainTextResponse(f"Success: LoRA adapter '{request.lora_name}' added successfully.")


@router.post("/v1/unload_lora_adapter")
async def unload_lora_adapter(request: UnloadLoRAAdapterRequest, raw_request: Request) -> Response:
    """Stop serving the adapter ``lora_name``."""
    request.check_unknown_fields(raw_request.app.state.ignore_unknown_fields)
    engine: EngineClient = raw_request.app.state.engine
    try:
        await engine.remove_lora(request.lora_name)
    except KeyError:
        raise OpenAIError(
            f"The lora adapter '{request.lora_name}' cannot be found.", 404, "lora_name"
        ) from None
    return PlainTextResponse(f"Success: LoRA adapter '{request.lora_name}' removed successfully.")
