"""HTTP validation of OpenAI API requests, and the OpenAI-format errors the router answers.

A bad request gets a clear 4xx here, checked with vLLM's own protocol models (so the
router refuses what vLLM's api_server would), before it costs a tokenizer call or a
place in the admission queue.
"""

from __future__ import annotations

import json
from http import HTTPStatus
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import ValidationError

from blockserve.protocol.chunks import CHAT, COMPLETIONS
from blockserve.protocol.config import describe_errors, error_path


def error(status: int, message: str, param: str | None = None,
          headers: dict[str, str] | None = None) -> JSONResponse:
    """An OpenAI-format error object (vLLM's own ErrorResponse)."""
    from vllm.entrypoints.serve.engine.protocol import ErrorInfo, ErrorResponse

    err_type = HTTPStatus(status).phrase.replace(" ", "") + "Error"
    body = ErrorResponse(error=ErrorInfo(message=message, type=err_type, param=param, code=status))
    return JSONResponse(body.model_dump(), status_code=status, headers=headers)


def error_from(exc: Exception) -> JSONResponse:
    """Map an exception as vLLM's api_server does (validation errors are 400s)."""
    from vllm.entrypoints.serve.exception_handling.error_response import create_error_response

    body = create_error_response(exc)
    return JSONResponse(body.model_dump(), status_code=body.error.code)


# An invalid request's error message lists this many of its problems at most: enough to
# fix a request in one round, short enough to read.
PROBLEMS_LISTED = 5


def _validation_message(exc: ValidationError) -> tuple[str, str | None]:
    """The OpenAI error's message (the first few problems) and param (the first's path)."""
    return (describe_errors(exc, "body", limit=PROBLEMS_LISTED),
            error_path(exc.errors()[0]) or None)


class Invalid(Exception):
    """A request the router refuses before admission; `response` is its error."""

    def __init__(self, response: JSONResponse) -> None:
        super().__init__(response.status_code)
        self.response = response


class RequestValidator:
    """Parses a request body into vLLM's request model for its endpoint."""

    def __init__(self, model_name: str, max_body_bytes: int) -> None:
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
        from vllm.entrypoints.openai.completion.protocol import CompletionRequest

        self.model_name, self.max_body_bytes = model_name, max_body_bytes
        self.protocols = {CHAT: ChatCompletionRequest, COMPLETIONS: CompletionRequest}

    async def parse(self, raw: Request, endpoint: str) -> tuple[dict, Any]:
        """The JSON body and vLLM's model of it; raises `Invalid` with the 4xx to send."""
        if "application/json" not in raw.headers.get("content-type", ""):
            raise Invalid(error(415, "Unsupported Media Type: Only 'application/json' is "
                                     "allowed"))
        limit = self.max_body_bytes
        if int(raw.headers.get("content-length") or 0) > limit:
            raise Invalid(error(413, f"The request body is larger than {limit} bytes."))
        data = await raw.body()
        if len(data) > limit:
            raise Invalid(error(413, f"The request body is larger than {limit} bytes."))
        try:
            body = json.loads(data)
        except (ValueError, UnicodeDecodeError) as exc:
            raise Invalid(error(400, f"The request body is not valid JSON: {exc}")) from None
        if not isinstance(body, dict):
            raise Invalid(error(400, "The request body must be a JSON object."))
        try:
            request = self.protocols[endpoint].model_validate(body)
        except ValidationError as exc:
            raise Invalid(error(400, *_validation_message(exc))) from None
        except Exception as exc:  # vLLM's own request checks raise their own errors
            raise Invalid(error_from(exc)) from None
        if request.model_extra:
            unknown = ", ".join(sorted(request.model_extra))
            raise Invalid(error(400, f"Unrecognized request argument supplied: {unknown}",
                                sorted(request.model_extra)[0]))
        if endpoint == CHAT and not request.messages:
            raise Invalid(error(400, "'messages' must contain at least one message.",
                                "messages"))
        if request.model is not None and request.model != self.model_name:
            raise Invalid(error(404, f"The model `{request.model}` does not exist.", "model"))
        return body, request
