"""Anthropic's error shape, ``{"type": "error", "error": {"type", "message"}}``: what the
server answers on Anthropic's routes (:data:`ANTHROPIC_PATHS`), for every error, those of the
middleware (401, 413, 503) included (see :func:`pyxllm.entrypoints.openai.errors.error_response`).

A leaf module: the OpenAI layer's error rendering imports it, and it imports nothing of pyxllm.
"""

from __future__ import annotations

from typing import Any

# The routes whose errors take Anthropic's shape (as the app matches them, without --root-path).
ANTHROPIC_PATHS = frozenset({"/v1/messages", "/v1/messages/count_tokens"})

# Anthropic's error type of each HTTP status (a 503 is pyxllm's "busy" or "shutting down":
# Anthropic's word for it is overloaded, which it sends with 529).
ANTHROPIC_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
    504: "timeout_error",
    529: "overloaded_error",
}


def anthropic_error_type(status_code: int) -> str:
    """Anthropic's error ``type`` for ``status_code`` (another 4xx is an
    ``invalid_request_error``, another 5xx an ``api_error``)."""
    default = "invalid_request_error" if status_code < 500 else "api_error"
    return ANTHROPIC_ERROR_TYPES.get(status_code, default)


def anthropic_error_body(message: str, status_code: int) -> dict[str, Any]:
    """The JSON body of an error in Anthropic's shape (also a stream's ``error`` event).

    Args:
        message: what went wrong; pyxllm's messages start with the field at fault
            (``"max_tokens: Field required"``), as Anthropic has no ``param``.
        status_code: the HTTP status, which chooses the error ``type``.
    """
    return {
        "type": "error",
        "error": {"type": anthropic_error_type(status_code), "message": message},
    }
