"""What every response carries and what /openapi.json shows, apart from the routes themselves.

- `RequestIdMiddleware`: an `x-request-id` header on every response, errors and refusals of the
  gate included: the client's own when it sent a sane one, else a fresh one, so a client and the
  server's log can name the same call.
- `add_request_schemas`: the routes parse their bodies by hand (strict errors naming `param`),
  so FastAPI cannot see their models; this puts them into the OpenAPI document.
"""

from __future__ import annotations

import re
import uuid
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel
from starlette.datastructures import MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

REQUEST_ID_HEADER = "x-request-id"
# A client's id is echoed only if it is short and plain: a header value must not smuggle control
# characters into responses or logs, nor make every response kilobytes longer.
_SANE_REQUEST_ID = re.compile(rb"[A-Za-z0-9._:\-]{1,128}")


class RequestIdMiddleware:
    """Pure ASGI, outermost: it adds one header and leaves the body and its streaming alone."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        sent = dict(scope.get("headers") or []).get(REQUEST_ID_HEADER.encode(), b"")
        request_id = sent.decode() if _SANE_REQUEST_ID.fullmatch(sent) else uuid.uuid4().hex

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                MutableHeaders(scope=message)[REQUEST_ID_HEADER] = request_id
            await send(message)

        await self.app(scope, receive, send_with_id)


def request_body(model: type[BaseModel]) -> dict[str, Any]:
    """`openapi_extra` for a route whose JSON body is `model` (see `add_request_schemas`)."""
    return {"requestBody": {"required": True, "content": {
        "application/json": {"schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}}


def add_request_schemas(app: FastAPI, models: list[type[BaseModel]]) -> None:
    """Make `app.openapi()` include the JSON schemas of `models` (and the models they use) under
    components/schemas, where `request_body` refers to them."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            for model in models:
                model_schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
                components.update(model_schema.pop("$defs", {}))
                components[model.__name__] = model_schema
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
