"""Errors as OpenAI's body `{"error": {"message", "type", "param", "code"}}` (vLLM's types and
integer codes); on the TGI routes as TGI's body `{"error": "...", "error_type": "..."}`, which
TGI clients parse."""

from __future__ import annotations

import json
import logging
import re
from http import HTTPStatus

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger("tokenmill.server")

TGI_PATHS = frozenset({"/generate", "/generate_stream"})

_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    413: "RequestEntityTooLargeError",
    415: "UnsupportedMediaTypeError",
    422: "UnprocessableEntityError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}
# SamplingParams messages start with the field name ("top_p must be in (0, 1], got 2.0").
_PARAM_RE = re.compile(r"^`?([a-z_]+)")
_SAMPLING_FIELDS = frozenset({
    "n", "temperature", "top_p", "top_k", "min_p", "seed", "repetition_penalty", "presence_penalty",
    "frequency_penalty", "max_tokens", "min_tokens", "stop", "stop_token_ids", "logprobs", "top_logprobs",
    "best_of", "logit_bias", "bad_words", "prompt_logprobs",
})


class APIError(Exception):
    """Raised by route code; turned into an error response by the app's handler."""

    def __init__(self, message: str, status: int = 400, param: str | None = None,
                 headers: dict[str, str] | None = None, tgi_type: str = "validation"):
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.headers = headers
        self.tgi_type = tgi_type

    @classmethod
    def from_value_error(cls, e: ValueError, param: str | None = None) -> "APIError":
        msg = str(e)
        if param is None:
            m = _PARAM_RE.match(msg)
            param = m.group(1) if m and m.group(1) in _SAMPLING_FIELDS else None
        return cls(msg, 400, param)


def openai_error_body(message: str, status: int, param: str | None = None) -> dict:
    err_type = _TYPES.get(status) or HTTPStatus(status).phrase.replace(" ", "") + "Error"
    return {"error": {"message": message, "type": err_type, "param": param, "code": status}}


def error_response(path: str, message: str, status: int, param: str | None = None,
                   headers: dict[str, str] | None = None, tgi_type: str = "validation") -> JSONResponse:
    if path in TGI_PATHS:
        body = {"error": message, "error_type": tgi_type}
        if status == 400 and tgi_type == "validation" and not message.startswith("Malformed JSON"):
            status = 422  # TGI answers validation errors with 422
    else:
        body = openai_error_body(message, status, param)
    return JSONResponse(body, status_code=status, headers=headers)


# Fields typed as a Union: pydantic reports one error per arm; say what is accepted instead.
_UNION_FIELDS = {
    "prompt": "a string, a list of strings, a list of token ids or a list of token id lists",
    "stop": "a string or a list of at most 64 strings",
    "content": "a string or a list of content parts ({'type': 'text', 'text': ...})",
    "tool_choice": "a string or an object",
}


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    for e in errors:
        if e.get("type") == "json_invalid":
            ctx = e.get("ctx") or {}
            return f"Malformed JSON body: {ctx.get('error', 'invalid JSON')}", None
        if tuple(e.get("loc", ())) == ("body",) and isinstance(e.get("input"), bytes):
            try:  # a body FastAPI did not parse: not JSON, or JSON without a JSON content type
                json.loads(e["input"])
            except ValueError as je:
                return f"Malformed JSON body: {je}", None
            return "the body must be JSON, sent with 'Content-Type: application/json'", None
    parts, param, seen = [], None, set()
    for e in errors:
        loc = [str(x) for x in e.get("loc", ()) if x != "body"]
        # pydantic names the arm of a Union it tried (e.g. 'list[int]', 'function-after[...]'): noise
        loc = [x for x in loc if not re.match(r"^(list|str|int|float|dict|bool|function|tagged)\b", x)]
        if param is None and loc:
            param = loc[0]
        union = next((x for x in reversed(loc) if x in _UNION_FIELDS), None)
        if union is not None:
            where = ".".join(loc[: len(loc) - loc[::-1].index(union)])
            msg = f"{where}: must be {_UNION_FIELDS[union]}"
        else:
            inp = e.get("input")
            got = "" if isinstance(inp, (dict, list, bytes)) else f" (got {json.dumps(inp, default=str)[:60]})"
            msg = f"{'.'.join(loc) or 'body'}: {e.get('msg')}{got}"
        if msg not in seen:
            seen.add(msg)
            parts.append(msg)
    if len(parts) > 5:
        parts = parts[:5] + [f"... {len(parts) - 5} more"]
    return "invalid request: " + "; ".join(parts), param


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return error_response(request.url.path, exc.message, exc.status, exc.param, exc.headers, exc.tgi_type)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):
        message, param = _validation_message(exc)
        return error_response(request.url.path, message, 400, param)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        detail = exc.detail if isinstance(exc.detail, str) else json.dumps(exc.detail)
        if exc.status_code == 404 and detail == "Not Found":
            detail = f"no route {request.method} {request.url.path}"
        return error_response(request.url.path, detail, exc.status_code, headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception):
        logger.exception("unhandled error on %s %s", request.method, request.url.path)
        return error_response(request.url.path, f"internal server error: {exc!r}", 500, tgi_type="generation")
