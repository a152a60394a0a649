"""The router's /openapi.json: the OpenAI routes' request bodies as vLLM's own request
models (the ones router/validation.py checks with), as vLLM's api_server publishes them,
and the bearer key of the routes that need it. The routes read their bodies themselves
(validation answers in OpenAI's error format, not FastAPI's), so FastAPI cannot see the
bodies; this adds them, and client generators, docs UIs and fuzzers find them."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from blockserve.protocol.chunks import CHAT, COMPLETIONS
from blockserve.router.validation import request_models

SCHEMAS = "#/components/schemas/"
BEARER = "bearer"
# Each OpenAI route's path, by the endpoint name validation uses.
PATHS = {CHAT: "/v1/chat/completions", COMPLETIONS: "/v1/completions"}
# The routes that need the key when one is configured (router/auth.py).
KEYED = ("/v1/", "/admin/")
POLICY_SWITCH = {  # router/admin.py's body: either or both
    "type": "object", "minProperties": 1, "additionalProperties": False,
    "properties": {key: {"description": "a policy: short name, import path, or "
                                         "{cls, kwargs}",
                         "anyOf": [{"type": "string"}, {"type": "object"}]}
                   for key in ("placement", "queue_order")},
}


def _json_body(schema: dict) -> dict:
    return {"required": True, "content": {"application/json": {"schema": schema}}}


def describe(app: FastAPI, keyed: bool) -> dict[str, Any]:
    """The OpenAPI document of `app`; `keyed`: an API key is configured."""
    spec = get_openapi(title=app.title, version=app.version, routes=app.routes)
    components = spec.setdefault("components", {})
    schemas = components.setdefault("schemas", {})
    for endpoint, model in request_models().items():
        schema = model.model_json_schema(ref_template=SCHEMAS + "{model}")
        schemas.update(schema.pop("$defs", {}))
        schemas[model.__name__] = schema
        spec["paths"][PATHS[endpoint]]["post"]["requestBody"] = _json_body(
            {"$ref": SCHEMAS + model.__name__})
    spec["paths"]["/admin/policies"]["post"]["requestBody"] = _json_body(POLICY_SWITCH)
    components["securitySchemes"] = {BEARER: {
        "type": "http", "scheme": "bearer",
        "description": "router.api_key, as `Authorization: Bearer <key>`"}}
    if keyed:
        for path, operations in spec["paths"].items():
            if path.startswith(KEYED):
                for operation in operations.values():
                    operation["security"] = [{BEARER: []}]
    return spec
