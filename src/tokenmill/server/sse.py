"""HTTP plumbing of the generation routes: cancelling a handler whose client went away, the SSE
response (its body generator always closed) and framing, and errors after a stream started."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable
from contextlib import suppress
from typing import Any

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from tokenmill.server.engine_streams import as_api_error
from tokenmill.server.errors import APIError, internal_error_message, openai_error_body

logger = logging.getLogger("tokenmill.server")


async def _wait_disconnect(raw: Request) -> None:
    while True:
        message = await raw.receive()
        if message["type"] == "http.disconnect":
            return


async def run_cancellable(raw: Request, work: Awaitable):
    """Run a handler, cancelling it (which aborts its engine requests) if the client goes away
    before it returns (vLLM's with_cancellation). Streaming responses are watched by Starlette
    once they start."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_disconnect(raw))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        watcher.cancel()
        raise
    if task.done():
        watcher.cancel()
        return task.result()
    task.cancel()
    with suppress(asyncio.CancelledError, Exception):
        await task
    logger.info("client disconnected before the response; request cancelled")
    return Response(status_code=499)  # nginx's "client closed request"; nobody reads it


class SSEResponse(StreamingResponse):
    """text/event-stream whose body generator is always closed, so a client that disconnects
    mid-stream aborts its engine request right away (not when the generator is collected)."""

    media_type = "text/event-stream"

    def __init__(self, content, **kw):
        kw.setdefault("headers", {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        super().__init__(content, **kw)

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with suppress(Exception):
                await self.body_iterator.aclose()  # type: ignore[union-attr]


def sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


def stream_error(e: BaseException, request_id: str) -> APIError:
    """An error after a stream started, as the APIError its client is sent (unexpected ones: a
    generic 500 naming `request_id`; the exception is logged under it, as errors.py's 500s)."""
    err = as_api_error(e)
    if isinstance(err, APIError):
        return err
    logger.error("error while streaming (request id %s)", request_id, exc_info=e)
    return APIError(internal_error_message(request_id), 500)


def stream_error_chunk(e: BaseException, request_id: str) -> bytes:
    """An error after the stream started: vLLM sends it as a data chunk, then [DONE]."""
    err = stream_error(e, request_id)
    return sse(openai_error_body(err.message, err.status, err.param))
