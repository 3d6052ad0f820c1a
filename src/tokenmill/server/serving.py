"""What every generation route shares: the server context, input checks in vLLM's words,
SamplingParams from a request, engine streams that surface errors before the response starts,
disconnect handling, SSE framing and the per-request record behind the access log."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import math
import time
import uuid
from contextlib import aclosing, suppress
from dataclasses import dataclass, field
from typing import Any, AsyncGenerator, AsyncIterator, Awaitable, Callable, TypeVar

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from tokenmill.engine.async_engine import AsyncLLMEngine, EngineDeadError, QueueFullError, ServerShutdownError
from tokenmill.lora.request import LoRARequest
from tokenmill.outputs import RequestOutput
from tokenmill.beam_search import BeamSearch, BeamSearchOutput, BeamSearchParams
from tokenmill.sampling_params import SamplingParams
from tokenmill.sampling_params import GuidedDecodingParams
from tokenmill.server.errors import APIError, internal_error_message, openai_error_body
from tokenmill.server.tracing import trace_headers

logger = logging.getLogger("tokenmill.server")

RETRY_AFTER_S = 1  # seconds a client is told to wait when the waiting queue is full
DEFAULT_MAX_PROMPTS = 256  # prompts in one /v1/completions request (--max-prompts-per-request)
# Values (tokens, logprob entries, embedding numbers) one non-streamed response may hold
# (--max-response-values; response_body.py): such a response is built whole in memory.
DEFAULT_MAX_RESPONSE_VALUES = 4_000_000
T = TypeVar("T")


@dataclass
class ServerContext:
    aengine: AsyncLLMEngine
    model_name: str
    metrics: Any  # ServerMetrics
    api_key: str | None = None
    max_logprobs: int = 20
    chat_template: str | None = None
    trust_request_chat_template: bool = False
    max_request_body_bytes: int | None = None
    max_prompts_per_request: int = DEFAULT_MAX_PROMPTS
    max_response_values: int = DEFAULT_MAX_RESPONSE_VALUES  # 0: no bound
    response_store: Any = None  # openai_responses.ResponseStore: the Responses API's stored responses
    tracer: Any = None  # tracing.RequestTracer with --otlp-traces-endpoint, else None (no cost)
    started: float = field(default_factory=time.time)

    async def offload(self, fn: Callable[..., T], *args) -> T:
        """fn(*args) on the engine's prep pool: tokenizing and template rendering never block the
        event loop (nor the engine thread)."""
        return await asyncio.get_running_loop().run_in_executor(self.aengine.prep_pool, fn, *args)

    def encode(self, text: str, add_special_tokens: bool = True, param: str = "prompt") -> list[int]:
        """Token ids of request text; a 400 naming `param` for text that cannot be tokenized."""
        try:
            return self.engine.encode(text, add_special_tokens, what=param)
        except ValueError as e:
            raise APIError(str(e), param=param) from None

    @property
    def engine(self):
        return self.aengine.engine

    @property
    def tokenizer(self):
        return self.aengine.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.aengine.engine.config.model.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.aengine.engine.config.model.vocab_size

    @property
    def model_aliases(self) -> tuple[str, ...]:
        """Other names requests may give for the served model (a GGUF file's path: ModelConfig.aliases)."""
        return getattr(self.aengine.engine.config.model, "aliases", ())

    @property
    def lora(self):
        """The engine's LoRARegistry (lora/registry.py), or None without --enable-lora."""
        return getattr(self.aengine.engine, "lora", None)


def get_ctx(request: Request) -> ServerContext:
    return request.app.state.ctx


# ---- input checks -------------------------------------------------------------------------
def check_model(ctx: ServerContext, name: str | None) -> LoRARequest | None:
    """The LoRA adapter a request's `model` names: None for the base model (its served name, or no
    name), the adapter's LoRARequest for a registered adapter (--enable-lora); else a 404."""
    if not name or name == ctx.model_name or name in ctx.model_aliases:
        return None
    lora = lora_request(ctx, name)
    if lora is None:
        adapters = " and the LoRA adapters listed by GET /v1/models" if ctx.lora is not None else ""
        raise APIError(f"The model `{name}` does not exist. This server serves `{ctx.model_name}`{adapters}.", 404,
                       "model")
    return lora


def lora_request(ctx: ServerContext, name: str) -> LoRARequest | None:
    """The registered adapter of this name, as a request by name only: the prep thread takes the
    registry's loaded copy (an adapter unloaded meanwhile is a 400 there, never loaded again)."""
    registry = ctx.lora
    known = registry.lookup(name) if registry is not None else None
    return dataclasses.replace(known, lora_path="") if known is not None else None


def served_name(ctx: ServerContext, lora: LoRARequest | None) -> str:
    """The `model` of a response: the adapter's name, else the served model name (as vLLM)."""
    return lora.lora_name if lora is not None else ctx.model_name


def log_ignored_fields(body) -> None:
    extra = getattr(body, "model_extra", None)
    if extra:
        logger.warning("ignored request fields: %s", sorted(extra))


def check_sampling_fields(ctx: ServerContext, body) -> None:
    """Checks shared by completions and chat that SamplingParams does not make."""
    if body.n is not None and not 1 <= body.n <= MAX_N:
        raise APIError(f"n must be in [1, {MAX_N}], got {body.n}", param="n")
    if body.logit_bias:
        try:
            ids = [int(k) for k in body.logit_bias]
        except ValueError:
            raise APIError("logit_bias keys must be token ids", param="logit_bias") from None
        check_token_ids(ctx, ids, "logit_bias")
    if body.stream_options is not None and not body.stream:
        raise APIError("stream_options can only be given when stream is true", param="stream_options")
    if body.stop_token_ids:
        check_token_ids(ctx, body.stop_token_ids, "stop_token_ids")
    check_logprobs(ctx, body.prompt_logprobs, "prompt_logprobs")
    check_priority(ctx, body.priority)


def check_priority(ctx: ServerContext, priority: int) -> None:
    try:
        ctx.engine.check_priority(priority)
    except ValueError as e:
        raise APIError(str(e), param="priority") from None


def check_token_ids(ctx: ServerContext, ids: list[int], param: str) -> None:
    vocab = ctx.vocab_size
    if any(t < 0 or t >= vocab for t in ids):
        raise APIError(f"token ids must be integers in [0, {vocab})", param=param)


def resolve_max_tokens(ctx: ServerContext, n_prompt: int, max_tokens: int | None,
                       what: str = "prompt", param: str = "max_tokens") -> int:
    """vLLM's rule: the prompt plus max_tokens must fit the context; no max_tokens means the rest."""
    limit = ctx.max_model_len
    if n_prompt == 0:
        raise APIError(f"the {what} is empty", param=what)
    if n_prompt >= limit:
        raise APIError(
            f"This model's maximum context length is {limit} tokens. However, your request has {n_prompt} "
            f"input tokens in the {what}, which leaves no room for output (at most {limit - 1}). "
            f"Please reduce the length of the {what}.", param=what)
    if max_tokens is None:
        return limit - n_prompt
    if max_tokens < 1:
        raise APIError(f"{param} must be at least 1, got {max_tokens}", param=param)
    if n_prompt + max_tokens > limit:
        raise APIError(
            f"This model's maximum context length is {limit} tokens. However, you requested "
            f"{n_prompt + max_tokens} tokens ({n_prompt} in the {what}, {max_tokens} in the completion). "
            f"Please reduce the length of the {what} or completion.", param=param)
    return max_tokens


MAX_N = 128  # samples per prompt (n or best_of)
MAX_SEQUENCES = 1024  # engine requests one API request may start (prompts x samples)


def sample_streams(ctx: ServerContext, prompt_ids: list[int], params: SamplingParams, base_id: str,
                   tracker: RequestTracker, first_index: int,
                   lora: LoRARequest | None = None) -> list[AsyncGenerator[RequestOutput, None]]:
    """One engine stream per sample of one prompt (n or best_of of them), sharing a parent id."""
    if params.num_samples == 1:
        return [engine_stream(ctx, prompt_ids, params, base_id, tracker, first_index, lora=lora)]
    return [engine_stream(ctx, prompt_ids, child, f"{base_id}-{j}", tracker, first_index + j, parent_id=base_id,
                          lora=lora)
            for j, child in enumerate(params.children())]


def guided_params(body, response_format: dict | None = None) -> GuidedDecodingParams | None:
    """Structured output from OpenAI's response_format or vLLM's guided_* fields (one of them)."""
    given = {k: getattr(body, f"guided_{k}") for k in ("json", "regex", "choice", "grammar")
             if getattr(body, f"guided_{k}") is not None}
    kind = (response_format or {}).get("type", "text")
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
            raise APIError("response_format json_schema needs {'json_schema': {'name': ..., 'schema': {...}}}",
                           param="response_format")
    return structured_output(kind, spec["schema"] if kind == "json_schema" else None, given, "response_format")


def structured_output(kind: str, schema: dict | None, given: dict | None = None,
                      param: str = "response_format") -> GuidedDecodingParams | None:
    """GuidedDecodingParams for an output format (text, json_object, or json_schema with `schema`),
    plus vLLM's guided_* fields in `given`; None for free text. At most one kind in all."""
    given = dict(given or {})
    if kind == "json_object":
        given["json_object"] = True
    elif kind == "json_schema":
        given["json"] = schema
    elif kind != "text":
        raise APIError(f"{param} type must be text, json_object or json_schema, got {kind!r}", param=param)
    if not given:
        return None
    if len(given) > 1:
        raise APIError(f"give one kind of structured output, not {sorted(given)}", param=param)
    try:
        return GuidedDecodingParams(**given)
    except ValueError as e:
        raise APIError(str(e), param="guided_choice" if "choice" in given else param) from None


def sampling_params(body, max_tokens: int, logprobs: int | None) -> SamplingParams:
    """SamplingParams from the OpenAI / vLLM fields; its ValueErrors become 400s naming the field."""
    def opt(v, default):
        return default if v is None else v

    return build_sampling_params(
        temperature=opt(body.temperature, 1.0), top_p=opt(body.top_p, 1.0), top_k=opt(body.top_k, -1),
        min_p=opt(body.min_p, 0.0), seed=body.seed, repetition_penalty=opt(body.repetition_penalty, 1.0),
        presence_penalty=opt(body.presence_penalty, 0.0), frequency_penalty=opt(body.frequency_penalty, 0.0),
        max_tokens=max_tokens, min_tokens=body.min_tokens, stop=body.stop, stop_token_ids=body.stop_token_ids,
        ignore_eos=body.ignore_eos, include_stop_str_in_output=body.include_stop_str_in_output,
        logprobs=logprobs, skip_special_tokens=body.skip_special_tokens,
        spaces_between_special_tokens=body.spaces_between_special_tokens,
        logit_bias=body.logit_bias, bad_words=body.bad_words, watermark=body.watermark,
        n=opt(body.n, 1), best_of=getattr(body, "best_of", None),
        guided_decoding=guided_params(body, getattr(body, "response_format", None)),
        prompt_logprobs=body.prompt_logprobs,
    )


def build_sampling_params(**kw) -> SamplingParams:
    """SamplingParams(**kw); its ValueErrors (and those of the guided_* fields) become 400s naming the field."""
    try:
        return SamplingParams(**kw)
    except ValueError as e:
        raise APIError.from_value_error(e) from None


def check_logprobs(ctx: ServerContext, n: int | None, param: str) -> None:
    limit = min(ctx.max_logprobs, ctx.vocab_size)
    if n is not None and not 0 <= n <= limit:
        raise APIError(f"{param} must be in [0, {limit}], got {n}", param=param)


def new_request_id(prefix: str, sep: str = "-") -> str:
    """Always fresh: a client's X-Request-Id is only echoed and logged (see app.py), never the
    engine's id, so two requests sending the same one cannot take each other's tokens."""
    return f"{prefix}{sep}{uuid.uuid4().hex}"


def prompt_logprobs_json(out: RequestOutput) -> list[dict | None] | None:
    """vLLM's shape: per prompt token {token id: {logprob, rank, decoded_token}}, null for the first."""
    if out.prompt_logprobs is None:
        return None
    return [None if step is None else {str(t): {"logprob": clamp_logprob(lp.logprob), "rank": lp.rank,
                                                "decoded_token": lp.decoded_token} for t, lp in step.items()}
            for step in out.prompt_logprobs]


def clamp_logprob(x: float) -> float:
    """JSON has no -inf; vLLM reports -9999.0 instead."""
    return -9999.0 if (math.isinf(x) or math.isnan(x)) else max(x, -9999.0)


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
        return (f"id={self.request_id} prompt_tokens={self.prompt_tokens} "
                f"completion_tokens={sum(self.completion_tokens.values())} ttft={ttft} finish={finish}")


def new_tracker(request_id: str, body=None) -> RequestTracker:
    """A tracker with the vLLM extras `priority` and `cache_salt` of `body` (if it has them)."""
    return RequestTracker(request_id, priority=getattr(body, "priority", 0),
                          cache_salt=getattr(body, "cache_salt", None))


def track(raw: Request, request_id: str, body=None) -> RequestTracker:
    """The API request's tracker (new_tracker), read by the access log; with the caller's trace context."""
    tracker = new_tracker(request_id, body)
    if get_ctx(raw).tracer is not None:
        tracker.trace_headers = trace_headers(raw.headers)
    raw.state.tracker = tracker  # read by the access-log middleware once the response is sent
    return tracker


# ---- engine streams -----------------------------------------------------------------------
def generate(ctx: ServerContext, prompt_ids: list[int], params: SamplingParams, request_id: str,
             parent_id: str | None = None, lora: LoRARequest | None = None,
             tracker: RequestTracker | None = None) -> AsyncGenerator[RequestOutput, None]:
    """ctx.aengine.generate, with the request's adapter (its name goes to the metrics' lora_name label),
    priority and cache salt (the tracker's)."""
    extras = {"priority": tracker.priority, "cache_salt": tracker.cache_salt} if tracker is not None else {}
    if lora is None:
        return ctx.aengine.generate(prompt_ids, params, request_id, parent_id, **extras)
    ctx.metrics.set_lora(request_id, lora.lora_name)  # before the engine can send the request's outputs
    return ctx.aengine.generate(prompt_ids, params, request_id, parent_id, lora_request=lora, **extras)


async def engine_stream(ctx: ServerContext, prompt_ids: list[int], params: SamplingParams, request_id: str,
                        tracker: RequestTracker, index: int = 0, parent_id: str | None = None,
                        lora: LoRARequest | None = None) -> AsyncGenerator[RequestOutput, None]:
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


def _as_api_error(e: BaseException) -> BaseException:
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
        raise _as_api_error(failed[0])
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
        raise _as_api_error(e) from None


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


# ---- disconnects and SSE ------------------------------------------------------------------
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
    err = _as_api_error(e)
    if isinstance(err, APIError):
        return err
    logger.error("error while streaming (request id %s)", request_id, exc_info=e)
    return APIError(internal_error_message(request_id), 500)


def stream_error_chunk(e: BaseException, request_id: str) -> bytes:
    """An error after the stream started: vLLM sends it as a data chunk, then [DONE]."""
    err = stream_error(e, request_id)
    return sse(openai_error_body(err.message, err.status, err.param))


# ---- beam search ----------------------------------------------------------------------------
async def run_beam_search(ctx: ServerContext, prompt_ids: list[int], body, max_tokens: int,
                          request_id: str, lora: LoRARequest | None = None) -> BeamSearchOutput:
    """vLLM's use_beam_search: n beams, rounds of one-token requests on the engine (see beam_search.py)."""
    if body.stream:
        raise APIError("use_beam_search cannot be streamed", param="use_beam_search")
    try:
        params = BeamSearchParams(beam_width=body.n or 1, max_tokens=max_tokens, ignore_eos=body.ignore_eos,
                                  length_penalty=body.length_penalty)
    except ValueError as e:
        raise APIError(str(e), param="n") from None
    search = BeamSearch(prompt_ids, params, ctx.engine.eos_token_ids)
    extras = new_tracker(request_id, body)  # priority and cache salt of every round
    while not search.done:
        rids = [f"{request_id}-beam{search.rounds}-{i}" for i in range(len(search.beams))]
        gens = [generate(ctx, b.tokens, search.round_params(), rid, lora=lora, tracker=extras)
                for rid, b in zip(rids, search.beams)]
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
        raise _as_api_error(e) from None
    return out
