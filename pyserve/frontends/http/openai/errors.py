"""OpenAI's error object: ``{"error": {"message", "type", "param", "code"}}`` with an HTTP status.

Every failure of a ``/v1`` route is answered in this shape, which the ``openai`` client turns
into its exception classes (400 ``BadRequestError``, 404 ``NotFoundError``, 5xx
``InternalServerError`` ...). Errors of the server core (``InferError``) are mapped with the
same status codes as the KServe routes.
"""

from __future__ import annotations

from typing import Any

import orjson
from starlette.responses import Response

from pyserve.api.errors import InferError
from pyserve.frontends.http.errors import HTTP_STATUS


class OpenAIError(Exception):
    """A ``/v1`` request failed; ``response()`` is its answer.

    :param status: the HTTP status (4xx for the client's mistakes, 5xx for the server's).
    :param message: what went wrong, written for the client.
    :param param: the request field at fault, if one is.
    :param code: a short machine-readable reason (``model_not_found``,
        ``context_length_exceeded`` ...), if there is one.
    """

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code

    @property
    def type(self) -> str:
        """OpenAI's error ``type``: ``invalid_request_error`` for 4xx, ``server_error`` for 5xx."""
        return "invalid_request_error" if self.status < 500 else "server_error"

    def payload(self) -> dict[str, Any]:
        """The error object (what a response body or a stream event carries)."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> Response:
        """The JSON answer with this error's status."""
        return Response(orjson.dumps(self.payload()), self.status, media_type="application/json")


def invalid(message: str, param: str | None = None, code: str | None = None) -> OpenAIError:
    """A 400 error about the request's content."""
    return OpenAIError(400, message, param=param, code=code)


def model_not_found(name: str) -> OpenAIError:
    """The 404 OpenAI answers for a model it does not serve."""
    return OpenAIError(404, f"The model '{name}' does not exist", param="model", code="model_not_found")


def from_infer_error(error: InferError, param: str | None = None) -> OpenAIError:
    """An error of the server core or of a model, with the status the KServe routes give it."""
    return OpenAIError(HTTP_STATUS[error.code], error.message, param=param)
