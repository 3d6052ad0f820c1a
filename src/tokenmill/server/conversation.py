"""What the conversational APIs beside chat completions share (Anthropic Messages, OpenAI
Responses): a conversation, already in the chat route's messages, rendered through the same chat
template with its tools; SamplingParams with the tool or output grammar; one engine request
started (bad input, a full queue or a dead engine still an HTTP status); and its answer as text
pieces and tool calls (tool_calls.ToolCallStream), streamed or whole. Each API maps these onto
its own blocks / items and events."""

from __future__ import annotations

from contextlib import aclosing
from dataclasses import dataclass, field
from typing import AsyncGenerator, AsyncIterator, Callable

from fastapi import Request

from tokenmill.outputs import RequestOutput
from tokenmill.server.chat_template import render_chat
from tokenmill.server.protocol import ChatMessage
from tokenmill.server.response_body import check_response_values, sequence_values
from tokenmill.server.serving import (
    ServerContext,
    build_sampling_params,
    check_model,
    check_priority,
    collect_all,
    engine_stream,
    merge,
    new_request_id,
    resolve_max_tokens,
    served_name,
    start_streams,
    track,
)
from tokenmill.server.tool_calls import (
    CallArgs,
    CallEnd,
    CallStart,
    OutputEvent,
    ToolCallStream,
    ToolPlan,
    apply_tool_grammar,
)
from tokenmill.sampling_params import GuidedDecodingParams


@dataclass
class Sampling:
    """The sampling fields these APIs have (None: the API's default, OpenAI's)."""

    max_tokens: int | None
    max_param: str  # the field's name in this API, for error messages
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stop: list[str] | None = None
    seed: int | None = None
    guided: GuidedDecodingParams | None = None


@dataclass
class Generation:
    request_id: str
    model: str  # the served name (or the LoRA adapter's)
    prompt_tokens: int
    plan: ToolPlan | None  # the plan the answer is parsed with (None: plain text)
    stream: AsyncGenerator[RequestOutput, None]  # already started


async def prompt_ids(ctx: ServerContext, messages: list[ChatMessage], plan: ToolPlan | None,
                     continue_final: bool = False) -> list[int]:
    """The conversation through the chat template (as the chat route renders it), on the prep pool.
    continue_final: the last (assistant) message is left open for the model to continue."""
    return await ctx.offload(render_chat, ctx, messages, not continue_final, continue_final, None, None, plan)


async def start(ctx: ServerContext, raw: Request, prefix: str, body, messages: list[ChatMessage],
                plan: ToolPlan | None, sampling: Sampling, continue_final: bool = False) -> Generation:
    """Check, render and start one engine request for a conversation. body: the API's request (its
    model, and vLLM's scheduling extras priority and cache_salt)."""
    lora = check_model(ctx, body.model)
    check_priority(ctx, body.priority)
    ids = await prompt_ids(ctx, messages, plan, continue_final)
    max_tokens = resolve_max_tokens(ctx, len(ids), sampling.max_tokens, "messages", sampling.max_param)
    params = build_sampling_params(
        max_tokens=max_tokens, temperature=_opt(sampling.temperature, 1.0), top_p=_opt(sampling.top_p, 1.0),
        top_k=_opt(sampling.top_k, -1), stop=sampling.stop, seed=sampling.seed, guided_decoding=sampling.guided)
    parse_plan = apply_tool_grammar(params, plan)
    if not getattr(body, "stream", False):
        check_response_values(ctx, sequence_values(max_tokens, None), sampling.max_param)
    request_id = new_request_id(prefix, sep="_")  # msg_..., resp_...: the APIs' own style
    tracker = track(raw, request_id, body)
    tracker.prompt_tokens = len(ids)
    (stream,) = await start_streams([engine_stream(ctx, ids, params, request_id, tracker, lora=lora)])
    return Generation(request_id, served_name(ctx, lora), len(ids), parse_plan, stream)


def _opt(v, default):
    return default if v is None else v


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text


@dataclass
class Answer:
    """A finished answer: its parts in order (text pieces and tool calls) and how it ended."""

    parts: list[str | ToolCall] = field(default_factory=list)
    finish_reason: str | None = None  # the engine's: stop, length or abort
    stop_string: str | None = None  # the stop string that ended it
    output_tokens: int = 0
    cached_tokens: int = 0

    @property
    def calls(self) -> list[ToolCall]:
        return [p for p in self.parts if isinstance(p, ToolCall)]

    @property
    def text(self) -> str:
        return "".join(p for p in self.parts if isinstance(p, str))

    def add(self, events: list[OutputEvent]) -> None:
        for e in events:
            if isinstance(e, str):
                if self.parts and isinstance(self.parts[-1], str):
                    self.parts[-1] += e
                else:
                    self.parts.append(e)
            elif isinstance(e, CallStart):
                self.parts.append(ToolCall(e.id, e.name, ""))
            elif isinstance(e, CallArgs):
                self.parts[-1].arguments += e.delta
            elif isinstance(e, CallEnd):
                self.parts[-1].arguments = e.arguments

    def finish(self, out: RequestOutput) -> None:
        c = out.outputs[0]
        self.finish_reason = c.finish_reason
        self.stop_string = c.stop_reason if isinstance(c.stop_reason, str) else None
        self.output_tokens = len(c.token_ids)
        self.cached_tokens = out.num_cached_tokens


async def answer(gen: Generation) -> Answer:
    """The whole answer (not streamed)."""
    (out,) = await collect_all([gen.stream])
    parser, result = ToolCallStream(gen.plan), Answer()
    result.add(parser.feed(out.outputs[0].text) + parser.finish())
    result.finish(out)
    return result


async def answer_events(gen: Generation) -> AsyncIterator[tuple[list[OutputEvent], Answer]]:
    """The answer as it is generated: each step's events, and the answer so far (finished with the
    last step). Closing it aborts the request."""
    parser, result = ToolCallStream(gen.plan), Answer()
    async for _, out in merge([gen.stream]):
        events = parser.feed(out.outputs[0].delta_text)
        if out.finished:
            events += parser.finish()
        result.add(events)
        result.output_tokens = len(out.outputs[0].token_ids)
        if out.finished:
            result.finish(out)
        yield events, result


async def answer_chunks(gen: Generation, write: Callable[[OutputEvent], list[bytes]]
                        ) -> AsyncIterator[tuple[bytes, Answer]]:
    """answer_events written by an API's `write` (an event -> its SSE events): one chunk per step
    (maybe empty), with the answer so far. Closing it aborts the request."""
    async with aclosing(answer_events(gen)) as steps:
        async for events, answer in steps:
            yield b"".join(b for e in events for b in write(e)), answer
