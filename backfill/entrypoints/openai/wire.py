"""The base of the OpenAI wire format: the error object, and strict, bounded JSON parsing.

Every request body goes through `parse_request`: a body over MAX_BODY_BYTES or with more than
MAX_JSON_CONTAINERS arrays and objects is a 413 before it is parsed; any validation problem is
one 400 whose `param` names the deepest offending field (`messages[0].content[1].type`).
"""

from __future__ import annotations

import re
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

MAX_BODY_BYTES = 32 * 1024 * 1024  # a larger body is a 413 before it is parsed
# Arrays and objects in one body. NOTE: parsing holds the event loop (and the GIL) for ~0.6 µs
# per container, so `[[1], [1], ...]` in 32 MB would stall every client for ~4 s; a legitimate
# request needs a few per prompt or message (prompts are bounded by --max-seqs-per-request).
MAX_JSON_CONTAINERS = 65_536
_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')


class APIError(Exception):
    """An error the server answers with the OpenAI error object."""

    def __init__(self, status_code: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def to_dict(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request_error", param, code)


class StrictModel(BaseModel):
    # NOTE: allow_inf_nan=False: JSON bodies may spell NaN and Infinity (pydantic reads them), and a
    # non-finite number must be refused as such, not as "greater than 2".
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)


class ResponseModel(BaseModel):
    model_config = ConfigDict(extra="allow")


def parse_request(model: type[StrictModel], body: bytes) -> Any:
    """Validate a JSON body into `model`; any problem is a 400 naming the offending `param`."""
    if len(body) > MAX_BODY_BYTES:
        raise APIError(413, f"request body larger than {MAX_BODY_BYTES} bytes", param=None)
    if count_json_containers(body) > MAX_JSON_CONTAINERS:
        raise APIError(413, f"request body has more than {MAX_JSON_CONTAINERS} JSON arrays and objects")
    try:
        return model.model_validate_json(body)
    except ValidationError as error:
        raise validation_error_to_api_error(error.errors()) from None


def count_json_containers(body: bytes) -> int:
    """How many arrays and objects `body` opens, without parsing it (a few ms for 32 MB)."""
    count = body.count(b"[") + body.count(b"{")
    if count > MAX_JSON_CONTAINERS:  # brackets inside strings count too: count again without them
        stripped = _JSON_STRING.sub(b"", body)
        count = stripped.count(b"[") + stripped.count(b"{")
    return count


def validation_error_to_api_error(errors: Any) -> APIError:
    """Turn pydantic/FastAPI validation errors into one 400; the deepest error is reported."""
    errors = list(errors)
    if not errors:
        return bad_request("invalid request")
    if any(e.get("type") == "json_invalid" for e in errors):
        detail = next(e for e in errors if e.get("type") == "json_invalid")
        return bad_request(f"We could not parse the JSON body of your request ({detail.get('msg')}).")
    error = max(errors, key=lambda e: len(loc_to_param(e.get("loc", ())) or ""))
    param = loc_to_param(error.get("loc", ()))
    if error.get("type") == "model_type" and not param:
        return bad_request("the request body must be a JSON object")
    message = str(error.get("msg", "invalid value"))
    message = message.removeprefix("Value error, ")
    return bad_request(f"{param}: {message}" if param else message, param)


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}
# Fields whose keys the client chooses: an error in one of their values names the field, not
# the key (OpenAI's `param` for a bad logit_bias entry is "logit_bias").
_KEYED_FIELDS = {"logit_bias"}


def loc_to_param(loc: Any) -> str | None:
    """('messages', 0, 'content', 'list[TextPart]', 1, 'type') -> 'messages[0].content[1].type'.

    Pydantic puts union-member tags (`str`, `list[str]`, `function-after[...]`, a tagged union's
    model names such as `InputMessage`) into error locations; they are not fields, so they are
    dropped. FastAPI's leading 'body' is dropped too.
    """
    parts: list[str] = []
    items = list(loc)
    if items and items[0] == "body":
        items = items[1:]
    for item in items:
        if parts and parts[-1] in _KEYED_FIELDS:
            break
        if isinstance(item, int):
            if parts:
                parts[-1] += f"[{item}]"
        elif isinstance(item, str) and ("[" not in item and item not in _TYPE_TAGS and not item[:1].isupper()):
            parts.append(item)
    return ".".join(parts) or None
