"""Errors as OpenAI's body `{"error": {"message", "type", "param", "code"}}` (vLLM's types and
integer codes); on the TGI routes as TGI's body `{"error": "...", "error_type": "..."}`, which
TGI clients parse; on Anthropic's /v1/messages routes as Anthropic's
`{"type": "error", "error": {"type": "invalid_request_error", "message": "..."}}`.

An unexpected exception is a 500 whose message is generic and carries a request id; the
exception, under that id, goes to the log only (a message built from it could hold a server file,
a path or a secret). ServerMiddleware (app.py) answers it, not an exception handler: Starlette
re-raises an exception after its handler ran, and uvicorn then drops the keep-alive connection.

Every route's JSON body is checked once for lone UTF-16 surrogates before validation (CheckedRoute):
JSON may carry "\\ud800", UTF-8 cannot, so any field echoed back (an unknown `model` in a 404,
`user` or `metadata` in a response) would fail while its answer is encoded."""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable, Coroutine
from http import HTTPStatus
from types import UnionType
from typing import Annotated, Any, Union, get_args, get_origin

from fastapi import FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from pydantic import BaseModel
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
_SAMPLING_FIELDS = frozenset(
    {
        "n",
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "seed",
        "repetition_penalty",
        "presence_penalty",
        "frequency_penalty",
        "max_tokens",
        "min_tokens",
        "stop",
        "stop_token_ids",
        "logprobs",
        "top_logprobs",
        "best_of",
        "logit_bias",
        "bad_words",
        "prompt_logprobs",
    }
)


class APIError(Exception):
    """Raised by route code; turned into an error response by the app's handler."""

    def __init__(
        self,
        message: str,
        status: int = 400,
        param: str | None = None,
        headers: dict[str, str] | None = None,
        tgi_type: str = "validation",
    ):
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.headers = headers
        self.tgi_type = tgi_type

    @classmethod
    def from_value_error(cls, e: ValueError, param: str | None = None) -> APIError:
        msg = str(e)
        if param is None:
            m = _PARAM_RE.match(msg)
            param = m.group(1) if m and m.group(1) in _SAMPLING_FIELDS else None
        return cls(msg, 400, param)


def openai_error_body(message: str, status: int, param: str | None = None) -> dict:
    err_type = _TYPES.get(status) or HTTPStatus(status).phrase.replace(" ", "") + "Error"
    return {"error": {"message": message, "type": err_type, "param": param, "code": status}}


# Anthropic's error types by status (https://docs.anthropic.com/en/api/errors); 503 (our full queue,
# dead or draining engine) is its overloaded_error.
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
    529: "overloaded_error",
}


def is_anthropic_path(path: str) -> bool:
    return path == ANTHROPIC_PATH or path.startswith(ANTHROPIC_PATH + "/")


ANTHROPIC_PATH = "/v1/messages"


def anthropic_error_body(message: str, status: int) -> dict:
    kind = _ANTHROPIC_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


class ErrorJSONResponse(JSONResponse):
    """An error body that always renders: a message quoting a client's text with a lone surrogate
    (which UTF-8 cannot encode) is written with JSON's \\u escapes instead of failing."""

    def render(self, content: Any) -> bytes:
        try:
            return super().render(content)
        except UnicodeEncodeError:
            return json.dumps(content, ensure_ascii=True, allow_nan=False, separators=(",", ":")).encode("ascii")


def error_response(
    path: str,
    message: str,
    status: int,
    param: str | None = None,
    headers: dict[str, str] | None = None,
    tgi_type: str = "validation",
) -> JSONResponse:
    if is_anthropic_path(path):
        body = anthropic_error_body(message, status)
    elif path in TGI_PATHS:
        body = {"error": message, "error_type": tgi_type}
        if status == 400 and tgi_type == "validation":
            status = 422  # TGI answers validation errors (malformed JSON included) with 422
    else:
        body = openai_error_body(message, status, param)
    return ErrorJSONResponse(body, status_code=status, headers=headers)


def internal_error_message(request_id: str) -> str:
    return f"internal server error (request id {request_id}); the details are in the server's log"


def internal_error_response(method: str, path: str, exc: BaseException, request_id: str) -> JSONResponse:
    """The 500 for an unexpected exception: logged with its traceback under `request_id`, which
    the client is given instead of the exception (whose text may quote files, paths or secrets)."""
    logger.error("unhandled error on %s %s (request id %s)", method, path, request_id, exc_info=exc)
    return error_response(path, internal_error_message(request_id), 500, tgi_type="generation")


# Where a lone surrogate can come from in a JSON body: a \\uD800-\\uDFFF escape, or (json.loads reads
# bytes with surrogatepass) UTF-8-style bytes of one. A body with neither is not walked.
_MAYBE_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F]|\xed[\xa0-\xbf]")
_KEY = "[key]"  # a location's last part when the surrogate is in a dict key (the key itself is not quoted)


def _has_surrogate(s: str) -> bool:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def lone_surrogate_at(data: Any) -> tuple | None:
    """The location (keys and list indexes) of the first string of parsed JSON holding a lone
    UTF-16 surrogate, or None. Iterative, in document order: a deeply nested body cannot overflow
    the stack here."""
    stack: list[tuple[tuple, Any]] = [((), data)]
    while stack:
        loc, x = stack.pop()
        if isinstance(x, str):
            if _has_surrogate(x):
                return loc
        elif isinstance(x, dict):
            for k in x:
                if isinstance(k, str) and _has_surrogate(k):
                    return (*loc, _KEY)
            stack.extend(((*loc, k), v) for k, v in reversed(x.items()))
        elif isinstance(x, list):
            stack.extend(((*loc, i), v) for i, v in reversed(list(enumerate(x))))
    return None


class CheckedRoute(APIRoute):
    """A route whose JSON body is refused (400, or TGI's 422, in the route's error shape) when any
    string in it, keys included, holds a lone surrogate: checked once here, before the body is
    validated, so no route can fail later while echoing such a string. FastAPI then reads the
    body parsed here (Starlette's Request keeps it)."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def checked(request: Request) -> Response:
            try:
                raw = await request.body()
            except StarletteHTTPException:  # a body over --max-request-body-bytes: its 413
                raise
            except Exception:  # noqa: BLE001 - the client went away mid-body: FastAPI answers it as before
                return await handler(request)
            if raw and _MAYBE_SURROGATE.search(raw):
                try:
                    data = await request.json()
                except (ValueError, RecursionError):  # not JSON, or nested too deeply: FastAPI's parse says so
                    data = None
                where = lone_surrogate_at(data) if data is not None else None
                if where is not None:
                    raise RequestValidationError(
                        [
                            {
                                "type": "string_unicode",
                                "loc": ("body", *where),
                                "msg": "not valid Unicode text",
                                "input": None,
                            }
                        ]
                    )
            return await handler(request)

        return checked


# Fields typed as a Union: pydantic reports one error per arm; say what is accepted instead. A request
# model whose field of the same name takes other things says so in its own UNION_FIELDS class attribute.
_UNION_FIELDS = {
    "prompt": "a string, a list of strings, a list of token ids (integers >= 0) or a list of token id lists",
    "input": "a non-empty string, a list of non-empty strings, a list of token ids (integers >= 0) or a list of "
    "token id lists",
    "stop": "a non-empty string or a list of at most 64 non-empty strings",
    "content": "a string or a list of content parts ({'type': 'text', 'text': ...})",
    "tool_choice": "a string or an object",
}


_BOUND_ERRORS = {"greater_than": "gt", "greater_than_equal": "ge", "less_than": "lt", "less_than_equal": "le"}
_OPS = {"gt": ">", "ge": ">=", "lt": "<", "le": "<="}


def _num(x) -> str:
    return f"{x:g}" if isinstance(x, float) else str(x)


def _field_info(model, loc: list):
    """The pydantic FieldInfo at `loc` (field names through nested models), or None."""
    info = None
    for part in loc:
        if get_origin(model) in (Union, UnionType):  # X | None
            args = [a for a in get_args(model) if a is not type(None)]
            model = args[0] if len(args) == 1 else None
        if not (isinstance(model, type) and issubclass(model, BaseModel)) or part not in model.model_fields:
            return None
        info = model.model_fields[part]
        model = info.annotation
    return info


def _bounds(info) -> dict:
    """{'ge' | 'gt': lower, 'le' | 'lt': upper} stated by a Field."""
    out = {}
    for m in getattr(info, "metadata", ()):
        for k in _OPS:
            if getattr(m, k, None) is not None:
                out[k] = getattr(m, k)
    return out


def _dict_value_bounds(info) -> dict:
    """The bounds a dict field states for its values (dict[str, Annotated[float, Field(ge=...)]])."""
    ann = getattr(info, "annotation", None)
    while get_origin(ann) in (Union, UnionType, Annotated):
        args = [a for a in get_args(ann) if a is not type(None)]
        ann = args[0] if args else None
    if get_origin(ann) is not dict:
        return {}
    value = get_args(ann)[1]
    return {k: v for m in getattr(value, "__metadata__", ()) for k, v in _bounds(m).items()}


def _range_message(e: dict, loc: list, body_model, tgi: bool) -> str | None:
    """A range error in the words of SamplingParams (OpenAI routes: 'top_p must be in (0, 1], got 2')
    or of TGI ('`top_p` must be > 0 and <= 1. Given: 2'), with both ends of the field's range."""
    kind, ctx, inp = e.get("type"), e.get("ctx") or {}, e.get("input")
    name = ".".join(str(x) for x in loc)
    tname = str(next((x for x in reversed(loc) if isinstance(x, str)), name))
    got = json.dumps(inp, default=str)[:60]
    if kind == "finite_number":
        return (
            f"`{tname}` must be a finite number. Given: {got}" if tgi else f"{name} must be a finite number, got {got}"
        )
    if kind in _BOUND_ERRORS:
        bounds = {}
        if all(isinstance(x, str) for x in loc):  # a field, not a list item or a dict value
            info = _field_info(body_model, loc)
            if info is None and len(loc) >= 2:  # a dict's value (logit_bias.7268): the values' range
                bounds = _dict_value_bounds(_field_info(body_model, loc[:-1]))
                name = f"{'.'.join(loc[:-1])} values" if bounds else name
            else:
                bounds = _bounds(info)
        bounds.setdefault(_BOUND_ERRORS[kind], ctx.get(_BOUND_ERRORS[kind]))
        lo = next(((k, bounds[k]) for k in ("ge", "gt") if bounds.get(k) is not None), None)
        hi = next(((k, bounds[k]) for k in ("le", "lt") if bounds.get(k) is not None), None)
        if tgi:
            if kind == "greater_than" and ctx.get("gt") == 0:
                return f"`{tname}` must be strictly positive"
            rule = " and ".join(f"{_OPS[k]} {_num(v)}" for k, v in (lo, hi) if k)
            return f"`{tname}` must be {rule}. Given: {got}"
        if lo and hi:
            return (
                f"{name} must be in {'[' if lo[0] == 'ge' else '('}{_num(lo[1])}, {_num(hi[1])}"
                f"{']' if hi[0] == 'le' else ')'}, got {got}"
            )
        k, v = lo or hi
        return f"{name} must be {_OPS[k]} {_num(v)}, got {got}"
    if tgi and kind in ("too_short", "string_too_short") and ctx.get("min_length") == 1:
        return f"`{tname}` sequences must not be empty" if tname == "stop" else f"`{tname}` cannot be empty"
    if tgi and kind == "too_long" and tname == "stop":
        return f"`stop` supports up to {ctx.get('max_length')} stop sequences. Given: {ctx.get('actual_length')}"
    if kind == "string_pattern_mismatch" and len(loc) >= 2 and loc[-1] == "[key]":
        return f"{'.'.join(str(x) for x in loc[:-2])} keys must be token ids (strings of digits), got {got}"
    return None


_ARM_RE = re.compile(r"^(list|str|int|float|dict|bool|function|tagged|constrained)\b")


def _clean_loc(e: dict) -> list:
    """An error's location without 'body' and without the Union arms pydantic names (e.g.
    'list[int]', 'constrained-str', 'function-after[...]'): noise to a client."""
    return [x for x in e.get("loc", ()) if x != "body" and not _ARM_RE.match(str(x))]


def _union_field(e: dict, fields: dict[str, str]) -> str | None:
    """The union field whose value matched none of its arms: the error is at the field itself
    or inside one of its arms (not deeper in a value that was accepted as one, e.g. a content block)."""
    loc = [str(x) for x in e.get("loc", ()) if x != "body"]
    for k in range(len(loc) - 1, -1, -1):
        if loc[k] in fields:
            return loc[k] if k + 1 == len(loc) or _ARM_RE.match(loc[k + 1]) else None
    return None


def _validation_message(exc: RequestValidationError, body_model=None, tgi: bool = False) -> tuple[str, str | None]:
    """The message and param of a 400 (422 on TGI routes) for what pydantic refused. `body_model`,
    the route's request model, gives the whole range of a field for range errors."""
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
        if e.get("type") == "string_unicode":  # JSON can carry "\ud800"; no tokenizer can take it
            where = ".".join(str(x) for x in _clean_loc(e)) or "body"
            return f"{where}: not valid Unicode text (it contains a lone surrogate)", (_clean_loc(e) or [None])[0]
    parts, param, seen, plain = [], None, set(), False
    unions = {**_UNION_FIELDS, **getattr(body_model, "UNION_FIELDS", {})}
    for e in errors:
        raw_loc = _clean_loc(e)
        loc = [str(x) for x in raw_loc]
        if param is None and loc:
            param = loc[0]
        union = None if tgi else _union_field(e, unions)
        ranged = None if union is not None else _range_message(e, raw_loc, body_model, tgi)
        if union is not None:
            where_loc = loc[: len(loc) - loc[::-1].index(union)]
            where = ".".join(where_loc)
            values = [x.get("input") for x in errors if [str(y) for y in _clean_loc(x)] == where_loc]
            if values and all(v in ("", []) for v in values):  # every arm refused an empty value
                msg = f"{where}: must not be empty"
            else:
                msg = f"{where}: must be {unions[union]}"
            plain = True
        elif ranged is not None:
            msg = ranged
        else:
            plain = True
            inp = e.get("input")
            got = "" if isinstance(inp, (dict, list, bytes)) else f" (got {json.dumps(inp, default=str)[:60]})"
            msg = f"{'.'.join(loc) or 'body'}: {e.get('msg')}{got}"
        if msg not in seen:
            seen.add(msg)
            parts.append(msg)
    if len(parts) > 5:
        parts = parts[:5] + [f"... {len(parts) - 5} more"]
    if tgi and not plain:  # TGI's own words, as its router writes them
        return "; ".join(parts), param
    return "invalid request: " + "; ".join(parts), param


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return error_response(request.url.path, exc.message, exc.status, exc.param, exc.headers, exc.tgi_type)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):
        route = request.scope.get("route")
        body_field = getattr(route, "body_field", None)
        model = getattr(getattr(body_field, "field_info", None), "annotation", None)
        message, param = _validation_message(exc, model, tgi=request.url.path in TGI_PATHS)
        return error_response(request.url.path, message, 400, param)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        detail = exc.detail if isinstance(exc.detail, str) else json.dumps(exc.detail)
        if exc.status_code == 404 and detail == "Not Found":
            detail = f"no route {request.method} {request.url.path}"
        return error_response(request.url.path, detail, exc.status_code, headers=getattr(exc, "headers", None))
