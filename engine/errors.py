"""Errors a request can earn, light enough for the API process to import without the model."""

from __future__ import annotations


class InvalidRequestError(ValueError):
    """Bad input, with the request field it is about (``param`` in OpenAI's error envelope). A ValueError, so code
    that refuses bad input with ValueError keeps working; the server answers it with a 400 naming ``param``."""

    def __init__(self, message: str, param: str | None) -> None:
        super().__init__(message)
        self.param = param
