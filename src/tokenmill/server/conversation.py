"""What the conversational routes share (OpenAI chat completions, Anthropic Messages, OpenAI
Responses): a conversation, in the chat route's messages, rendered through the chat template with
its tools; SamplingParams from the request's sampling fields (sampling.py) with the tool or output
grammar; the request's engine streams (one per sample) started, so that bad input, a full queue
or a dead engine is still an HTTP status; and each answer as text pieces and tool calls
(tool_calls.ToolCallStream), streamed or whole, parsed the same way either way. Each API maps
these onto its own choices / blocks / items and events."""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import dataclass, field

from fastapi import Request

from tokenmill.lora.request import LoRARequest
from tokenmill.outputs import RequestOutput
from tokenmill.sampling_params import SamplingParams
from tokenmill.server.chat_template import render_chat
from tokenmill.server.checks import check_model, check_priority, resolve_max_tokens, served_name
from tokenmill.server.context import ServerContext
from tokenmill.server.engine_streams import (
    RequestTracker,
    collect_all,
    merge,
    new_request_id,
    sample_streams,
    start_streams,
    track,
)
from tokenmill.server.protocol import ChatMessage
from tokenmill.server.response_body import check_response_values, prompt_values, sequence_values
from tokenmill.server.sampling import Sampling
from tokenmill.server.tool_calls import (
    CallArgs,
    CallEnd,
    CallStart,
    OutputEvent,
    ToolCallStream,
    ToolPlan,
    apply_tool_grammar,
)

__all__ = [
    "Answer",
    "Generation",
    "Sampling",
    "ToolCall",
    "answer",
    "answer_chunks",
    "answer_events",
    "answer_steps",
    "launch",
    "parse_answer",
    "prompt_ids",
    "request_params",
    "start",
]


@dataclass
class Generation:
    request_id: str
    model: str  # the served name (or the LoRA adapter's)
    prompt_tokens: int
    plan: ToolPlan | None  # the plan the answers are parsed with (None: plain text)
    streams: list[AsyncGenerator[RequestOutput, None]]  # one per sample, already started
    params: SamplingParams


async def prompt_ids(
    ctx: ServerContext,
    messages: list[ChatMessage],
    plan: ToolPlan | None,
    continue_final: bool = False,
    add_generation_prompt: bool | None = None,
    template: str | None = None,
    template_kwargs: dict | None = None,
) -> list[int]:
    """The conversation through the chat template (the server's, or a request's `template`), on the
    prep pool. continue_final: the last (assistant) message is left open for the model to continue;
    add_generation_prompt: by default, unless continuing."""
    add = not continue_final if add_generation_prompt is None else add_generation_prompt
    return await ctx.offload(render_chat, ctx, messages, add, continue_final, template, template_kwargs, plan)


def request_params(
    ctx: ServerContext, n_prompt: int, sampling: Sampling, plan: ToolPlan | None, max_tokens: int, stream: bool
) -> tuple[SamplingParams, ToolPlan | None]:
    """The SamplingParams (with the plan's grammar), and the plan the answers are parsed with. A
    non-streamed response that could outgrow --max-response-values is refused here."""
    params = sampling.params(max_tokens)
    parse_plan = apply_tool_grammar(params, plan)
    if not stream:
        values = (sampling.n or 1) * sequence_values(max_tokens, sampling.logprobs)
        check_response_values(ctx, values + prompt_values(n_prompt, sampling.prompt_logprobs), sampling.max_param)
    return params, parse_plan


async def launch(
    ctx: ServerContext,
    tracker: RequestTracker,
    ids: list[int],
    params: SamplingParams,
    plan: ToolPlan | None,
    lora: LoRARequest | None,
) -> Generation:
    """Start the request's engine streams (one per sample) and wait for their first outputs."""
    tracker.prompt_tokens = len(ids)
    streams = await start_streams(sample_streams(ctx, ids, params, tracker.request_id, tracker, 0, lora))
    return Generation(tracker.request_id, served_name(ctx, lora), len(ids), plan, streams, params)


async def start(
    ctx: ServerContext,
    raw: Request,
    prefix: str,
    body,
    messages: list[ChatMessage],
    plan: ToolPlan | None,
    sampling: Sampling,
    continue_final: bool = False,
) -> Generation:
    """Check, render and start one engine request for a conversation (Anthropic, Responses). body:
    the API's request (its model, stream, and vLLM's scheduling extras priority and cache_salt)."""
    lora = check_model(ctx, body.model)
    check_priority(ctx, body.priority)
    ids = await prompt_ids(ctx, messages, plan, continue_final)
    max_tokens = resolve_max_tokens(ctx, len(ids), sampling.max_tokens, "messages", sampling.max_param)
    params, parse_plan = request_params(ctx, len(ids), sampling, plan, max_tokens, getattr(body, "stream", False))
    request_id = new_request_id(prefix, sep="_")  # msg_..., resp_...: the APIs' own style
    return await launch(ctx, track(raw, request_id, body), ids, params, parse_plan, lora)


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


def parse_answer(plan: ToolPlan | None, text: str) -> Answer:
    """A whole answer's text as parts (what streaming it would have given)."""
    parser, result = ToolCallStream(plan), Answer()
    result.add(parser.feed(text) + parser.finish())
    return result


async def answer(gen: Generation) -> Answer:
    """The whole answer of a one-sample generation (not streamed)."""
    (out,) = await collect_all(gen.streams)
    result = parse_answer(gen.plan, out.outputs[0].text)
    result.finish(out)
    return result


async def answer_steps(gen: Generation) -> AsyncIterator[tuple[int, RequestOutput, list[OutputEvent], Answer]]:
    """The answers as they are generated, every sample's: per engine output, (the sample's index,
    the output, its events, the sample's answer so far, finished with its last output). Closing it
    aborts the request."""
    parsers = [ToolCallStream(gen.plan) for _ in gen.streams]
    answers = [Answer() for _ in gen.streams]
    async with aclosing(merge(gen.streams)) as outs:
        async for i, out in outs:
            events = parsers[i].feed(out.outputs[0].delta_text)
            if out.finished:
                events += parsers[i].finish()
            result = answers[i]
            result.add(events)
            result.output_tokens = len(out.outputs[0].token_ids)
            if out.finished:
                result.finish(out)
            yield i, out, events, result


async def answer_events(gen: Generation) -> AsyncIterator[tuple[list[OutputEvent], Answer]]:
    """answer_steps of a one-sample generation: each step's events, and the answer so far."""
    async with aclosing(answer_steps(gen)) as steps:
        async for _, _, events, result in steps:
            yield events, result


async def answer_chunks(
    gen: Generation, write: Callable[[OutputEvent], list[bytes]]
) -> AsyncIterator[tuple[bytes, Answer]]:
    """answer_events written by an API's `write` (an event -> its SSE events): one chunk per step
    (maybe empty), with the answer so far. Closing it aborts the request."""
    async with aclosing(answer_events(gen)) as steps:
        async for events, answer in steps:
            yield b"".join(b for e in events for b in write(e)), answer
