"""One error shape for every endpoint: ``{"error": {"message", "type", "param", "code"}}``.

``code`` is the HTTP status and ``type`` its OpenAI SDK class name (``BadRequestError``...).
Request validation errors, which FastAPI answers with 422, are answered with 400 here, as
OpenAI and vLLM do; so are the input processor's refusals (``InvalidRequestError``, naming the
field).

Anthropic's routes (``/v1/messages``...) answer every error in Anthropic's shape instead
(:mod:`pyxllm.entrypoints.anthropic.errors`): :func:`error_response` chooses by the path.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable, Coroutine, Iterator
from contextlib import contextmanager
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Scope

from pyxllm.engine.errors import InvalidRequestError
from pyxllm.entrypoints.anthropic.errors import ANTHROPIC_PATHS, anthropic_error_body
from pyxllm.entrypoints.openai.exceptions import OpenAIError
from pyxllm.entrypoints.openai.protocol import ErrorInfo, ErrorResponse

logger = logging.getLogger(__name__)

ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    403: "PermissionDeniedError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    409: "ConflictError",
    413: "RequestTooLargeError",
    422: "UnprocessableEntityError",
    429: "RateLimitError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}


def _encodable(text: str | None) -> str | None:
    """``text`` with anything UTF-8 cannot encode (a lone surrogate echoed from a request)
    written as a ``\\udfff`` escape, so that an error message always encodes."""
    if text is None or text.isascii():
        return text
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def error_body(message: str, status_code: int = 400, param: str | None = None) -> ErrorResponse:
    """The :class:`ErrorResponse` for ``status_code`` (also sent as an SSE event mid-stream)."""
    err_type = ERROR_TYPES.get(status_code)
    if err_type is None:
        try:
            err_type = HTTPStatus(status_code).phrase.replace(" ", "") + "Error"
        except ValueError:
            err_type = "APIError"
    return ErrorResponse(
        error=ErrorInfo(
            message=_encodable(message), type=err_type, param=_encodable(param), code=status_code
        )
    )


def route_path(scope: Scope) -> str:
    """The path a route matches: ``scope["path"]`` without the app's ``root_path`` prefix
    (``--root-path``; a proxy may pass the prefix on or strip it), as Starlette's router
    matches it."""
    path, root = scope["path"], scope.get("root_path", "")
    if root and path.startswith(root) and path[len(root) : len(root) + 1] in ("", "/"):
        return path[len(root) :] or "/"
    return path


def error_response(
    message: str,
    status_code: int = 400,
    param: str | None = None,
    headers: dict[str, str] | None = None,
    path: str | None = None,
) -> JSONResponse:
    """A JSON error response in the one shape, or in Anthropic's when ``path`` (the route's,
    :func:`route_path`) is one of Anthropic's routes (which have no ``param``: their messages
    name the field)."""
    if path in ANTHROPIC_PATHS:
        content = anthropic_error_body(_encodable(message), status_code)
    else:
        content = error_body(message, status_code, param).model_dump(mode="json")
    return JSONResponse(content, status_code=status_code, headers=headers)


def param_from_message(message: str) -> str | None:
    """The field a ``"field: problem"`` message (``SamplingParams``' style) is about, if any."""
    name, sep, _ = message.partition(":")
    return name if sep and name.isidentifier() else None


# pydantic's names of the members of a union, as they appear in an error's location
_SCALAR_MEMBERS = ("str", "int", "float", "bool", "bytes", "none", "list", "dict")


def _is_member(part) -> bool:
    """Whether ``part`` of an error's location names a union member (``"str"``,
    ``"list[ChatContentPart]"``, a model's class name), not a field (our fields, as OpenAI's,
    are lower case)."""
    return isinstance(part, str) and (
        part in _SCALAR_MEMBERS or "[" in part or (part[:1].isupper() and part.isidentifier())
    )


def _field_path(loc: list) -> str:
    """``["messages", 0, "content", "list[ChatContentPart]", 0, "text"]`` ->
    ``"messages[0].content[0].text"`` (union members left out)."""
    path = ""
    for part in loc:
        if _is_member(part):
            continue
        path += f"[{part}]" if isinstance(part, int) else (f".{part}" if path else str(part))
    return path


def _field_problem(errs: list[dict]) -> str:
    """``"path: problem"`` for the errors of one top-level field: the first error, or, where
    it failed every member of a union, the member that matched deepest (a list of content parts
    whose part is wrong), else that the value is none of the members."""
    first = errs[0]
    at = next((i for i, part in enumerate(first["loc"]) if _is_member(part)), None)
    if at is None:
        return f"{_field_path(first['loc'])}: {first.get('msg', 'invalid value')}"
    prefix = first["loc"][:at]
    members = [e for e in errs if e["loc"][:at] == prefix and len(e["loc"]) > at]
    deepest = max(members, key=lambda e: len(e["loc"]))
    if len(deepest["loc"]) > at + 1:
        return f"{_field_path(deepest['loc'])}: {deepest.get('msg', 'invalid value')}"
    got = repr(first.get("input"))
    got = got if len(got) <= 60 else got[:57] + "..."
    accepted = ", ".join(dict.fromkeys(e["loc"][at] for e in members))
    return f"{_field_path(prefix)}: {got} is none of the accepted types ({accepted})"


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """A readable message and the first offending field of a request validation error.

    Errors of one field that failed every member of a union (``prompt``: str, list[str]...)
    are reported once (see :func:`_field_problem`).
    """
    parts: list[str] = []
    param = None
    by_field: dict[str, list[dict]] = {}
    for err in exc.errors():
        loc = [x for x in err.get("loc", ()) if x != "body"]
        if err.get("type") == "json_invalid":
            detail = (err.get("ctx") or {}).get("error", err.get("msg", "invalid JSON"))
            if loc and isinstance(loc[0], int):  # FastAPI's location: the error's offset
                detail = f"{detail} (character {loc[0]})"
            parts.append(f"the request body is not valid JSON: {detail}")
        elif not loc:
            parts.append(f"the request body must be a JSON object: {err.get('msg', 'invalid')}")
        else:
            by_field.setdefault(str(loc[0]), []).append({**err, "loc": loc})
    for field, errs in by_field.items():
        param = param or field
        parts.append(_field_problem(errs))
    return "; ".join(parts) or "invalid request", param


async def _on_openai_error(request: Request, exc: OpenAIError) -> JSONResponse:
    path = route_path(request.scope)
    return error_response(exc.message, exc.status_code, exc.param, exc.headers, path)


async def _on_invalid_request(request: Request, exc: InvalidRequestError) -> JSONResponse:
    return error_response(str(exc), 400, exc.param, path=route_path(request.scope))


async def _on_validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    message, param = _validation_message(exc)
    return error_response(message, 400, param, path=route_path(request.scope))


# routes a flag adds, named in the 404 of a server started without it
_ROUTES_OF_FLAGS = {
    "/v1/load_lora_adapter": "--enable-lora --allow-runtime-lora-updating",
    "/v1/unload_lora_adapter": "--enable-lora --allow-runtime-lora-updating",
}


async def _on_http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    if exc.status_code == 404 and exc.detail == "Not Found":
        message = f"no route for {request.method} {request.url.path}"
        flags = _ROUTES_OF_FLAGS.get(route_path(request.scope))
        if flags is not None:
            message += f" (a server started with {flags} answers it)"
    else:
        message = str(exc.detail)
    response = error_response(message, exc.status_code, path=route_path(request.scope))
    if exc.headers:
        response.headers.update(exc.headers)
    return response


def unexpected_error_response(request: Request, exc: Exception) -> JSONResponse:
    """The 500 of an exception nothing expected. The body says no more than "internal error"
    (an exception's text can hold paths, prompts or keys) and a request id, the client's
    ``X-Request-Id`` if it sent a plain one, else a new one; the log line carries the same id
    with the exception and its traceback. The id is also the response's ``X-Request-Id``."""
    given = request.headers.get("x-request-id", "")
    plain = 0 < len(given) <= 64 and all(c.isalnum() or c in "-_." for c in given)
    request_id = given if plain else uuid.uuid4().hex
    logger.error(
        "unexpected error serving %s %s (request id %s): %s: %s",
        request.method,
        request.url.path,
        request_id,
        type(exc).__name__,
        exc,
        exc_info=exc,
    )
    return error_response(
        f"internal error (request id {request_id}; the server's log has the details)",
        500,
        headers={"X-Request-Id": request_id},
        path=route_path(request.scope),
    )


_ANSWERED = (OpenAIError, InvalidRequestError, RequestValidationError, StarletteHTTPException)


class OpenAIRoute(APIRoute):
    """A route whose unexpected exceptions become the 500 response right there.

    Starlette answers an exception that reaches its outermost middleware and then re-raises it,
    so uvicorn drops the connection without ``Connection: close`` and a client's next request
    on it fails; answered here, the connection stays usable. Expected errors go on to their
    handlers (:func:`install_exception_handlers`).
    """

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def answer(request: Request) -> Response:
            try:
                return await handler(request)
            except _ANSWERED:
                raise
            except Exception as exc:  # noqa: BLE001 - any other failure is this request's 500
                return unexpected_error_response(request, exc)

        return answer


async def _on_unexpected_error(request: Request, exc: Exception) -> JSONResponse:
    # Outside a route (a middleware): Starlette re-raises after this response is sent.
    return unexpected_error_response(request, exc)


def install_exception_handlers(app: FastAPI) -> None:
    """Make ``app`` answer every error, including unexpected ones, in the one shape."""
    app.add_exception_handler(OpenAIError, _on_openai_error)
    app.add_exception_handler(InvalidRequestError, _on_invalid_request)
    app.add_exception_handler(RequestValidationError, _on_validation_error)
    app.add_exception_handler(StarletteHTTPException, _on_http_error)
    app.add_exception_handler(Exception, _on_unexpected_error)


@contextmanager
def renamed_fields(rename: Callable[[str | None], str | None]) -> Iterator[None]:
    """Re-raise a chat request's errors (:class:`OpenAIError`, ``InvalidRequestError``) with
    another API's field names, ``rename`` mapping a message or a param (the Responses and
    Messages APIs run through the chat handler)."""
    try:
        yield
    except OpenAIError as exc:
        raise OpenAIError(
            rename(exc.message), exc.status_code, rename(exc.param), exc.headers
        ) from exc
    except InvalidRequestError as exc:
        raise OpenAIError(rename(str(exc)), 400, rename(exc.param)) from exc
