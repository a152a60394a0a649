"""The bearer key of the router's API.

The OpenAI API and /admin need it when one is configured (router.api_key); /health and
/metrics (block counts and latencies, no request content) do not.
"""

from __future__ import annotations

import hmac

from fastapi import Request
from fastapi.responses import Response

from blockserve.router.validation import error


class ApiKey:
    def __init__(self, key: str | None) -> None:
        self.key = key

    def denied(self, request: Request) -> Response | None:
        """The 401 for a request without the key (compared in constant time), or None."""
        supplied = request.headers.get("authorization", "")
        if self.key and not hmac.compare_digest(supplied.encode(),
                                                f"Bearer {self.key}".encode()):
            return error(401, "Missing or invalid API key (Authorization: Bearer ...).")
        return None
