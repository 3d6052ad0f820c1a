"""Engine streams of an API request: its ids and the per-request record behind the access log
(RequestTracker), one engine stream per sample, streams started before the response (so that bad
input, a full queue or a dead engine is an HTTP status), collected or merged, and vLLM's beam search."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import aclosing, suppress
from dataclasses import dataclass, field

from fastapi import Request

from tokenmill.beam_search import BeamSearch, BeamSearchOutput, BeamSearchParams
from tokenmill.engine.async_engine import EngineDeadError, QueueFullError, ServerShutdownError
from tokenmill.lora.request import LoRARequest
from tokenmill.outputs import RequestOutput
from tokenmill.sampling_params import SamplingParams
from tokenmill.server.checks import served_name
from tokenmill.server.context import ServerContext, get_ctx
from tokenmill.server.errors import APIError
from tokenmill.server.tracing import trace_headers

RETRY_AFTER_S = 1  # seconds a client is told to wait when the waiting queue is full


def new_request_id(prefix: str, sep: str = "-") -> str:
    """Always fresh: a client's X-Request-Id is only echoed and logged (see app.py), never the
    engine's id, so two requests sending the same one cannot take each other's tokens."""
    return f"{prefix}{sep}{uuid.uuid4().hex}"


# ---- the per-request record behind the access log ------------------------------------------
@dataclass
class RequestTracker:
    """One API request: what the access log reports, and what its engine requests share (the
    scheduling priority, the prefix-cache salt, the caller's W3C trace context headers)."""

    request_id: str
    prompt_tokens: int = 0
    completion_tokens: dict[int, int] = field(default_factory=dict)
    ttft: float | None = None
    finish_reasons: list[str] = field(default_factory=list)
    priority: int = 0
    cache_salt: str | None = None
    trace_headers: dict[str, str] | None = None  # traceparent / tracestate, only while tracing

    def update(self, index: int, out: RequestOutput) -> None:
        self.completion_tokens[index] = len(out.outputs[0].token_ids)
        m = out.metrics
        if self.ttft is None and m is not None and m.first_token_time is not None:
            self.ttft = m.first_token_time - m.arrival_time
        if out.finished and out.outputs[0].finish_reason:
            self.finish_reasons.append(out.outputs[0].finish_reason)

    def log_fields(self) -> str:
        ttft = f"{self.ttft:.3f}s" if self.ttft is not None else "-"
        finish = ",".join(self.finish_reasons) or "abort"
        return (
            f"id={self.request_id} prompt_tokens={self.prompt_tokens} "
            f"completion_tokens={sum(self.completion_tokens.values())} ttft={ttft} finish={finish}"
        )


def new_tracker(request_id: str, body=None) -> RequestTracker:
    """A tracker with the vLLM extras `priority` and `cache_salt` of `body` (if it has them)."""
    return RequestTracker(
        request_id, priority=getattr(body, "priority", 0), cache_salt=getattr(body, "cache_salt", None)
    )


def track(raw: Request, request_id: str, body=None) -> RequestTracker:
    """The API request's tracker (new_tracker), read by the access log; with the caller's trace context."""
    tracker = new_tracker(request_id, body)
    if get_ctx(raw).tracer is not None:
        tracker.trace_headers = trace_headers(raw.headers)
    raw.state.tracker = tracker  # read by the access-log middleware once the response is sent
    return tracker


# ---- engine streams -----------------------------------------------------------------------
def generate(
    ctx: ServerContext,
    prompt_ids: list[int],
    params: SamplingParams,
    request_id: str,
    parent_id: str | None = None,
    lora: LoRARequest | None = None,
    tracker: RequestTracker | None = None,
) -> AsyncGenerator[RequestOutput, None]:
    """ctx.aengine.generate, with the request's adapter (its name goes to the metrics' lora_name label),
    priority and cache salt (the tracker's)."""
    extras = {"priority": tracker.priority, "cache_salt": tracker.cache_salt} if tracker is not None else {}
    if lora is None:
        return ctx.aengine.generate(prompt_ids, params, request_id, parent_id, **extras)
    ctx.metrics.set_lora(request_id, lora.lora_name)  # before the engine can send the request's outputs
    return ctx.aengine.generate(prompt_ids, params, request_id, parent_id, lora_request=lora, **extras)


async def engine_stream(
    ctx: ServerContext,
    prompt_ids: list[int],
    params: SamplingParams,
    request_id: str,
    tracker: RequestTracker,
    index: int = 0,
    parent_id: str | None = None,
    lora: LoRARequest | None = None,
) -> AsyncGenerator[RequestOutput, None]:
    """The engine's outputs for one prompt; closing it early aborts the request (counted). With
    tracing on, a finished request becomes a span (built here, on the event loop)."""
    gen = generate(ctx, prompt_ids, params, request_id, parent_id, lora, tracker)
    finished = refused = False
    try:
        async for out in gen:
            tracker.update(index, out)
            finished = out.finished
            if finished and ctx.tracer is not None:
                ctx.tracer.record(out, params, served_name(ctx, lora), tracker.trace_headers)
            yield out
    except (ValueError, QueueFullError, EngineDeadError):
        refused = True
        raise
    finally:
        await gen.aclose()
        if not finished and not refused:
            if lora is None:
                ctx.metrics.on_abort()
            else:
                ctx.metrics.on_abort(request_id)
        elif refused and lora is not None:
            ctx.metrics.forget(request_id)


def as_api_error(e: BaseException) -> BaseException:
    if isinstance(e, QueueFullError):
        return APIError(str(e), 503, headers={"Retry-After": str(RETRY_AFTER_S)}, tgi_type="overloaded")
    if isinstance(e, (EngineDeadError, ServerShutdownError)):
        return APIError(str(e), 503, tgi_type="generation")
    if isinstance(e, ValueError):
        return APIError.from_value_error(e)
    return e


async def _chain(first: RequestOutput, rest: AsyncGenerator) -> AsyncGenerator[RequestOutput, None]:
    async with aclosing(rest):
        yield first
        if not first.finished:
            async for out in rest:
                yield out


async def start_streams(streams: list[AsyncGenerator]) -> list[AsyncGenerator]:
    """Wait for every stream's first output, so that bad input, a full queue or a dead engine
    becomes an HTTP error status instead of an error inside a 200 stream."""
    try:
        firsts = await asyncio.gather(*(s.__anext__() for s in streams), return_exceptions=True)
    except BaseException:  # cancelled (client gone): the streams were cancelled and aborted with it
        for s in streams:
            with suppress(Exception):
                await s.aclose()
        raise
    failed = [f for f in firsts if isinstance(f, BaseException)]
    if failed:
        for s in streams:
            await s.aclose()
        raise as_api_error(failed[0])
    return [_chain(f, s) for f, s in zip(firsts, streams)]


async def collect(stream: AsyncGenerator[RequestOutput, None]) -> RequestOutput:
    last = None
    async with aclosing(stream):
        async for out in stream:
            last = out
    assert last is not None
    return last


async def collect_all(streams: list[AsyncGenerator]) -> list[RequestOutput]:
    try:
        return await asyncio.gather(*(collect(s) for s in streams))
    except (ValueError, QueueFullError, EngineDeadError, ServerShutdownError) as e:
        raise as_api_error(e) from None


_DONE = object()


async def merge(streams: list[AsyncGenerator]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(index, output) from several streams as they come; closing it closes them all."""
    if len(streams) == 1:
        async with aclosing(streams[0]) as s:
            async for out in s:
                yield 0, out
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, s: AsyncGenerator) -> None:
        try:
            async for out in s:
                queue.put_nowait((i, out))
        except Exception as e:  # noqa: BLE001 - handed to the consumer
            queue.put_nowait((i, e))
        finally:
            queue.put_nowait((i, _DONE))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        left = len(streams)
        while left:
            i, item = await queue.get()
            if item is _DONE:
                left -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for s in streams:
            with suppress(Exception):
                await s.aclose()


def sample_streams(
    ctx: ServerContext,
    prompt_ids: list[int],
    params: SamplingParams,
    base_id: str,
    tracker: RequestTracker,
    first_index: int,
    lora: LoRARequest | None = None,
) -> list[AsyncGenerator[RequestOutput, None]]:
    """One engine stream per sample of one prompt (n or best_of of them), sharing a parent id."""
    if params.num_samples == 1:
        return [engine_stream(ctx, prompt_ids, params, base_id, tracker, first_index, lora=lora)]
    return [
        engine_stream(ctx, prompt_ids, child, f"{base_id}-{j}", tracker, first_index + j, parent_id=base_id, lora=lora)
        for j, child in enumerate(params.children())
    ]


# ---- beam search ----------------------------------------------------------------------------
async def run_beam_search(
    ctx: ServerContext, prompt_ids: list[int], body, max_tokens: int, request_id: str, lora: LoRARequest | None = None
) -> BeamSearchOutput:
    """vLLM's use_beam_search: n beams, rounds of one-token requests on the engine (see beam_search.py)."""
    if body.stream:
        raise APIError("use_beam_search cannot be streamed", param="use_beam_search")
    try:
        params = BeamSearchParams(
            beam_width=body.n or 1,
            max_tokens=max_tokens,
            ignore_eos=body.ignore_eos,
            length_penalty=body.length_penalty,
        )
    except ValueError as e:
        raise APIError(str(e), param="n") from None
    search = BeamSearch(prompt_ids, params, ctx.engine.eos_token_ids)
    extras = new_tracker(request_id, body)  # priority and cache salt of every round
    while not search.done:
        rids = [f"{request_id}-beam{search.rounds}-{i}" for i in range(len(search.beams))]
        gens = [
            generate(ctx, b.tokens, search.round_params(), rid, lora=lora, tracker=extras)
            for rid, b in zip(rids, search.beams)
        ]
        finished: set[str] = set()
        try:
            search.advance(await asyncio.gather(*[_last_output(g, rid, finished) for rid, g in zip(rids, gens)]))
        except BaseException as e:
            # Finished rounds were counted (and forgotten) by the metrics as they finished. Cancelled
            # (the client went away): the round's unfinished requests were aborted, and count as such,
            # as engine_stream counts its own; refused: they never ran.
            for rid in rids:
                if rid in finished:
                    continue
                if not isinstance(e, Exception):
                    ctx.metrics.on_abort(rid if lora is not None else None)
                elif lora is not None:
                    ctx.metrics.forget(rid)
            raise
    return search.result(lambda t: ctx.tokenizer.decode(t, skip_special_tokens=True))


async def _last_output(gen: AsyncGenerator[RequestOutput, None], request_id: str, finished: set[str]) -> RequestOutput:
    """The last output of one beam's round; its id goes into `finished` once it finished."""
    out = None
    try:
        async with aclosing(gen):
            async for out in gen:
                if out.finished:
                    finished.add(request_id)
    except (ValueError, QueueFullError, EngineDeadError, ServerShutdownError) as e:
        raise as_api_error(e) from None
    return out
