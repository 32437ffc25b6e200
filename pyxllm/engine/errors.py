"""The error every request check raises."""

from __future__ import annotations


class InvalidRequestError(ValueError):
    """A request that breaks a rule; ``param`` names the request field at fault (the HTTP
    server answers 400 with it)."""

    def __init__(self, message: str, param: str | None) -> None:
        super().__init__(message)
        self.param = param
