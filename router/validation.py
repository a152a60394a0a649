"""HTTP validation of OpenAI API requests, and the OpenAI-format errors the router answers.

A bad request gets a clear 4xx here, checked with vLLM's own protocol models (so the
router refuses what vLLM's api_server would), before it costs a tokenizer call or a
place in the admission queue. The router also runs vLLM's own conversion of the request
into the engine's sampling parameters: a value vLLM's model accepts but that conversion
trips over is the request's fault, so it is a 400 that names the field, never a 500.
"""

from __future__ import annotations

import json
import logging
from http import HTTPStatus
from typing import Any, Callable

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import TypeAdapter, ValidationError

from blockserve.protocol.chunks import CHAT, COMPLETIONS
from blockserve.protocol.config import describe_errors, error_path

logger = logging.getLogger("blockserve.router")


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


def request_models() -> dict[str, type]:
    """vLLM's request model of each endpoint: what the router validates with and what
    /openapi.json publishes (router/openapi.py)."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest

    return {CHAT: ChatCompletionRequest, COMPLETIONS: CompletionRequest}


# The cap vLLM's conversion gets for a request without one: larger than any context.
UNCAPPED = 2**31 - 1


def sampling_params(request: Any) -> Any:
    """vLLM's own conversion of a validated request into the engine's parameters, as
    vLLM's serving layer calls it. The serving layer passes the client's cap lowered to
    the context the prompt leaves; the prompt's length is not known here, so the cap
    itself (or, without one, no cap: `UNCAPPED`) stands in for it. The router reads no
    field that tells an output's length (tests/test_length_blind.py)."""
    cap = getattr(request, "max_completion_tokens", None)
    if cap is None:
        cap = request.max_tokens
    if cap is None:
        cap = UNCAPPED
    convert = (request.to_beam_search_params if request.use_beam_search
               else request.to_sampling_params)
    return convert(cap, {})


def _culprit(check: Callable[[dict], Any], body: dict, model: type) -> str | None:
    """The request field without which `check` passes: the one vLLM tripped over."""
    for name in [key for key in body if key in model.model_fields]:
        try:
            check({key: value for key, value in body.items() if key != name})
        except Exception:
            continue
        return name
    return None


def _field_problem(model: type, name: str, value: Any, exc: Exception) -> str:
    """Why `value` is wrong for field `name`: pydantic's reason when the value does not
    fit the field's type on its own (vLLM's checks looked at it before pydantic could),
    else what vLLM raised."""
    try:
        TypeAdapter(model.model_fields[name].annotation).validate_python(value)
    except ValidationError as invalid:
        first = invalid.errors()[0]
        return f"{'.'.join(filter(None, [name, error_path(first)]))}: {first['msg']}"
    except Exception:  # a type pydantic cannot check on its own: vLLM's reason stands
        pass
    return f"{name}: {type(exc).__name__}: {exc}"


def vllm_check(check: Callable[[dict], Any], body: dict, model: type) -> Any:
    """`check(body)` (a pure function of the request: vLLM's model or its conversion);
    raises `Invalid` with the request's 4xx when it fails. An error vLLM means for the
    client keeps vLLM's status and message; any other exception is vLLM tripping over a
    value it let through, a 400 that names the field (logged: vLLM could say it better)."""
    try:
        return check(body)
    except ValidationError as exc:
        raise Invalid(error(400, *_validation_message(exc))) from None
    except Exception as exc:
        mapped = error_from(exc)
        if mapped.status_code < 500:  # vLLM's own request checks raise their own errors
            raise Invalid(mapped) from None
        name = _culprit(check, body, model)
        logger.warning("vLLM tripped over a request%s: %r",
                       f" (field {name!r})" if name else "", exc)
        if name is None:
            raise Invalid(error(400, f"vLLM could not process the request: "
                                     f"{type(exc).__name__}: {exc}")) from None
        raise Invalid(error(400, "Invalid value for "
                                 f"{_field_problem(model, name, body[name], exc)}",
                            name)) from None


class RequestValidator:
    """Parses a request body into vLLM's request model for its endpoint."""

    def __init__(self, model_name: str, max_body_bytes: int) -> None:
        self.model_name, self.max_body_bytes = model_name, max_body_bytes
        self.protocols = request_models()

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
        return body, self.check(body, endpoint)

    def check(self, body: dict, endpoint: str) -> Any:
        """vLLM's model of a JSON object body; raises `Invalid` with the 4xx to send."""
        model = self.protocols[endpoint]
        request = vllm_check(model.model_validate, body, model)
        if request.model_extra:
            unknown = ", ".join(sorted(request.model_extra))
            raise Invalid(error(400, f"Unrecognized request argument supplied: {unknown}",
                                sorted(request.model_extra)[0]))
        if endpoint == CHAT and not request.messages:
            raise Invalid(error(400, "'messages' must contain at least one message.",
                                "messages"))
        if request.model is not None and request.model != self.model_name:
            raise Invalid(error(404, f"The model `{request.model}` does not exist.", "model"))
        # The request as validated above; `_culprit`'s probes (other dicts) validate anew.
        vllm_check(lambda checked: sampling_params(
            request if checked is body else model.model_validate(checked)), body, model)
        return request
