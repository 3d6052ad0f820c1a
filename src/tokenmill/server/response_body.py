"""Non-streamed response bodies, which can be large (n=128 with 20 logprobs, 1,024 sequences,
2,048 embeddings): built and JSON-encoded on the prep pool, never on the event loop, and encoded a
piece at a time, so that the encoding thread gives the GIL back between pieces and the loop keeps
answering other requests (/health included) meanwhile; and bounded before generation starts, by
--max-response-values, since a response is built whole in memory."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from fastapi.responses import Response

from tokenmill.server.context import ServerContext
from tokenmill.server.errors import APIError

# Lists at most this long are encoded in one call (top_logprobs, a choice's few fields): splitting
# them would cost more in Python calls than their encoding holds the GIL for.
_WHOLE_LIST = 32


async def json_response(ctx: ServerContext, build: Callable[..., Any], *args: Any) -> Response:
    """The JSON response of build(*args) (a dict of plain values), built and encoded on the prep pool."""
    return Response(await ctx.offload(_build_and_encode, build, args), media_type="application/json")


def _build_and_encode(build: Callable[..., Any], args: tuple) -> bytes:
    return encode_json(build(*args))


def encode_json(obj: Any) -> bytes:
    """obj as compact JSON, as JSONResponse writes it (UTF-8, no NaN), but a piece at a time: one
    json.dumps call holds the GIL for its whole run (100s of ms for a large body), so long lists of
    objects are encoded element by element. A list of numbers or strings (an embedding, a sequence's
    logprob tokens) is one piece: encoding thousands of them takes about a millisecond."""
    pieces: list[str] = []
    _encode(obj, pieces)
    return "".join(pieces).encode("utf-8")


def _dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, allow_nan=False, separators=(",", ":"))


def _splits(obj: Any) -> bool:
    """Whether obj is, or holds, a long list of objects (and so is encoded in pieces). A short list
    is judged by its first element: a response's lists hold objects of one shape (choices, logprob
    entries), and looking at one keeps this check cheap beside the encoding; a misjudged list is
    still encoded right, only in one piece."""
    if isinstance(obj, list):
        if not obj or not isinstance(obj[0], (dict, list)):
            return False
        return len(obj) > _WHOLE_LIST or _splits(obj[0])
    return isinstance(obj, dict) and any(_splits(v) for v in obj.values() if isinstance(v, (dict, list)))


def _encode(obj: Any, out: list[str]) -> None:
    if not _splits(obj):
        out.append(_dumps(obj))
    elif isinstance(obj, list):
        out.append("[")
        for i, item in enumerate(obj):
            if i:
                out.append(",")
            _encode(item, out)
        out.append("]")
    else:
        out.append("{")
        for i, (key, value) in enumerate(obj.items()):
            out.append(("," if i else "") + _dumps(str(key)) + ":")
            _encode(value, out)
        out.append("}")


# ---- the bound --------------------------------------------------------------------------------
def sequence_values(max_tokens: int, logprobs: int | None) -> int:
    """Values one returned sequence may hold: a value per token of text, and with logprobs, per
    token, the sampled token's entry and the top `logprobs` ones."""
    return max_tokens * (1 + (logprobs + 1 if logprobs is not None else 0))


def prompt_values(prompt_tokens: int, logprobs: int | None) -> int:
    """Values of a prompt's logprobs (echo with logprobs, or prompt_logprobs): as sequence_values'."""
    return 0 if logprobs is None else prompt_tokens * (logprobs + 1)


def check_response_values(ctx: ServerContext, values: int, param: str, instead: str = "or stream it") -> None:
    """A 400 naming `param` (in the route's own error body) when a response could hold more than
    --max-response-values values; checked before anything is generated."""
    limit = ctx.max_response_values
    if limit and values > limit:
        raise APIError(
            f"The response to this request could hold {values:,} values (tokens of text, logprob "
            f"entries, embedding numbers), more than this server's limit of {limit:,} "
            f"(--max-response-values). Ask for less (lower {param}), {instead}.",
            param=param,
        )
