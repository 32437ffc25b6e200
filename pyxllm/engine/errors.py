"""The errors a request can end with: refused at the front door, or failed in the engine."""

from __future__ import annotations


class InvalidRequestError(ValueError):
    """A request that breaks a rule; ``param`` names the request field at fault (the HTTP
    server answers 400 with it)."""

    def __init__(self, message: str, param: str | None) -> None:
        super().__init__(message)
        self.param = param


class RequestFailedError(RuntimeError):
    """One request's own processing failed in the engine (its detokenizer, its constraint
    ...); the request was aborted, the engine serves on (the HTTP server answers 500 for it)."""


class ConstraintFailedError(RequestFailedError):
    """A request's structured-output constraint failed while it generated: the grammar library
    raised computing the allowed tokens, or a sampled token broke the constraint (a bug of
    ours or the library's, never the model's). The output so far may not match the constraint,
    so the request fails rather than ending as a ``stop``; the message names the cause and
    holds nothing from the request (the HTTP server shows it with the 500)."""


class EngineDeadError(RuntimeError):
    """The engine that ran (or would run) a request is gone: a data-parallel replica died, or
    none is left. The request is lost; another replica may serve it again (the HTTP server
    answers 503)."""
