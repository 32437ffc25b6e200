"""The exception an endpoint raises to answer with an error (:mod:`.errors` renders it): a leaf
module, so that the request models (:mod:`.protocol`) can raise it too."""

from __future__ import annotations


class OpenAIError(Exception):
    """An error to answer with ``status_code``; ``param`` names the request field at fault;
    ``headers`` go on the response (``Retry-After`` of a 503)."""

    def __init__(
        self,
        message: str,
        status_code: int = 400,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.message = message
        self.status_code = status_code
        self.param = param
        self.headers = headers
