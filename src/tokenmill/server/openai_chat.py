"""POST /v1/chat/completions: the model's chat template over system / user / assistant / tool
messages (content as a string or a list of text parts), tools, logprobs, usage, SSE streaming.
On the conversation pipeline the Anthropic and Responses routes use (conversation.py): a choice's
answer is parsed as it streams, so tool calls stream as OpenAI's do (`delta.tool_calls` entries:
the call's index, id, type and name first, then fragments of its arguments)."""

from __future__ import annotations

import time
from contextlib import aclosing

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from tokenmill.llm import merge_samples
from tokenmill.outputs import RequestOutput
from tokenmill.server import conversation
from tokenmill.server.checks import (
    check_logprobs,
    check_model,
    check_sampling_fields,
    log_ignored_fields,
    resolve_max_tokens,
    served_name,
)
from tokenmill.server.context import ServerContext, get_ctx
from tokenmill.server.engine_streams import collect_all, new_request_id, run_beam_search, track
from tokenmill.server.errors import APIError, CheckedRoute
from tokenmill.server.logprobs import chat_logprobs, prompt_logprobs_json
from tokenmill.server.openai_completions import ERROR_RESPONSES
from tokenmill.server.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatCompletionStreamResponse,
    ChatResponseMessage,
    ErrorResponse,
    UsageInfo,
    sse_content,
)
from tokenmill.server.response_body import json_response
from tokenmill.server.sampling import Sampling
from tokenmill.server.sse import SSE_DONE, SSEResponse, run_cancellable, sse, stream_error_chunk
from tokenmill.server.tool_calls import CallArgs, CallStart, OutputEvent, ToolPlan, plan_tools

router = APIRouter(tags=["OpenAI"], route_class=CheckedRoute)


@router.post(
    "/v1/chat/completions",
    response_model=None,
    responses={
        200: {
            "model": ChatCompletionResponse,
            "description": "a chat completion, or with stream=true an SSE stream of "
            "`chat.completion.chunk` objects ending with `data: [DONE]`",
            "content": sse_content(ChatCompletionStreamResponse, ErrorResponse, done=True),
        },
        **ERROR_RESPONSES,
    },
)
async def create_chat_completion(body: ChatCompletionRequest, raw: Request):
    return await run_cancellable(raw, _create_chat_completion(get_ctx(raw), body, raw))


async def _create_chat_completion(ctx: ServerContext, body: ChatCompletionRequest, raw: Request):
    log_ignored_fields(body)
    lora = check_model(ctx, body.model)
    model = served_name(ctx, lora)
    check_sampling_fields(ctx, body)
    plan = plan_tools(body.tools, body.tool_choice)
    top_n = None
    if body.top_logprobs is not None:
        if not body.logprobs:
            raise APIError("top_logprobs needs logprobs to be true", param="top_logprobs")
        check_logprobs(ctx, body.top_logprobs, "top_logprobs")
    if body.logprobs:
        top_n = body.top_logprobs or 0
    ids = await conversation.prompt_ids(
        ctx,
        body.messages,
        plan,
        body.continue_final_message,
        body.add_generation_prompt,
        body.chat_template,
        body.chat_template_kwargs,
    )
    max_param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    requested = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    max_tokens = resolve_max_tokens(ctx, len(ids), requested, "messages", max_param)
    sampling = Sampling.from_openai(body, top_n, requested, max_param)
    params, plan = conversation.request_params(ctx, len(ids), sampling, plan, max_tokens, bool(body.stream))

    request_id = new_request_id("chatcmpl")
    tracker = track(raw, request_id, body)
    tracker.prompt_tokens = len(ids)
    if body.use_beam_search:
        result = await run_beam_search(ctx, ids, body, max_tokens, request_id, lora)
        n_out = sum(len(s.output_tokens) for s in result.sequences)
        return JSONResponse(
            ChatCompletionResponse(
                id=request_id,
                created=int(time.time()),
                model=model,
                choices=[
                    ChatCompletionResponseChoice(
                        index=j,
                        message=ChatResponseMessage(content=s.text),
                        finish_reason="stop" if s.finished else "length",
                    )
                    for j, s in enumerate(result.sequences)
                ],
                usage=UsageInfo(prompt_tokens=len(ids), completion_tokens=n_out, total_tokens=len(ids) + n_out),
            ).model_dump()
        )
    gen = await conversation.launch(ctx, tracker, ids, params, plan, lora)
    created = int(time.time())
    if body.stream:
        return SSEResponse(_stream(body, gen, created, top_n))
    outs = await collect_all(gen.streams)
    return await json_response(ctx, _response, gen, created, merge_samples(outs, params), top_n)


def _response(gen: conversation.Generation, created: int, out: RequestOutput, top_n: int | None) -> dict:
    """The whole response (on the prep pool, by json_response). Logprobs stay plain dicts: as pydantic
    models they cost an object per entry, and dumping them is one call that holds the GIL throughout."""
    choices = []
    for c in out.outputs:
        answer = conversation.parse_answer(gen.plan, c.text)
        calls = [
            {"id": t.id, "type": "function", "function": {"name": t.name, "arguments": t.arguments}}
            for t in answer.calls
        ]
        content = answer.text or None if calls else answer.text
        choice = ChatCompletionResponseChoice(
            index=c.index,
            message=ChatResponseMessage(content=content, tool_calls=calls or None),
            finish_reason=_finish(gen.plan, calls, c.finish_reason),
            stop_reason=c.stop_reason,
        ).model_dump()
        if top_n is not None and c.logprobs is not None:
            choice["logprobs"] = {"content": chat_logprobs(c.token_ids, c.logprobs, top_n)}
        choices.append(choice)
    resp = ChatCompletionResponse(
        id=gen.request_id, created=created, model=gen.model, choices=[], usage=UsageInfo.from_outputs([out])
    ).model_dump()
    return {**resp, "choices": choices, "prompt_logprobs": prompt_logprobs_json(out)}


def _finish(plan: ToolPlan | None, calls: list, reason: str | None) -> str | None:
    """OpenAI: tool_calls when the model chose to call (auto, required); stop for a forced function."""
    if calls and plan is not None and plan.mode != "named" and reason == "stop":
        return "tool_calls"
    return reason


class _ToolDeltas:
    """One choice's answer events as OpenAI's deltas: text as content; a call as a tool_calls entry
    with its index, id, type and name (and empty arguments), then entries with argument fragments."""

    def __init__(self):
        self.calls = 0

    def delta(self, e: OutputEvent) -> dict | None:
        if isinstance(e, str):
            return {"content": e} if e else None
        if isinstance(e, CallStart):
            self.calls += 1
            return {
                "tool_calls": [
                    {
                        "index": self.calls - 1,
                        "id": e.id,
                        "type": "function",
                        "function": {"name": e.name, "arguments": ""},
                    }
                ]
            }
        if isinstance(e, CallArgs) and e.delta:
            return {"tool_calls": [{"index": self.calls - 1, "function": {"arguments": e.delta}}]}
        return None  # CallEnd: the arguments were sent


async def _stream(body: ChatCompletionRequest, gen: conversation.Generation, created: int, top_n: int | None):
    """Stream i carries choice i (n > 1: one per sample). With tools to parse, text streams as
    content until a call may begin, and calls as tool_calls deltas (conversation.answer_steps)."""
    opts = body.stream_options
    include_usage = bool(opts and opts.include_usage)
    continuous = bool(include_usage and opts.continuous_usage_stats)
    base = {"id": gen.request_id, "object": "chat.completion.chunk", "created": created, "model": gen.model}
    latest: dict[int, RequestOutput] = {}
    tools = [_ToolDeltas() for _ in gen.streams]

    def usage() -> dict:
        return UsageInfo.from_outputs(latest.values(), gen.prompt_tokens).model_dump()

    def chunk(index: int, delta: dict, logprobs=None, finish_reason=None, stop_reason=None) -> bytes:
        d = {
            **base,
            "choices": [
                {
                    "index": index,
                    "delta": delta,
                    "logprobs": logprobs,
                    "finish_reason": finish_reason,
                    "stop_reason": stop_reason,
                }
            ],
        }
        if include_usage:
            d["usage"] = usage() if continuous else None
        return sse(d)

    try:
        async with aclosing(conversation.answer_steps(gen)) as steps:  # closed with the response: aborts
            async for i, out, events, answer in steps:
                opened = i in latest
                latest[i] = out
                c = out.outputs[0]
                n = len(c.token_ids)
                if not opened:  # OpenAI opens every choice with the role
                    yield chunk(i, {"role": "assistant", "content": ""})
                lp = None
                if top_n is not None and c.logprobs is not None and c.delta_token_ids:
                    k = len(c.delta_token_ids)
                    lp = {"content": chat_logprobs(c.delta_token_ids, c.logprobs[n - k :], top_n)}
                if gen.plan is not None:
                    deltas = [d for d in map(tools[i].delta, events) if d is not None]
                    for d in deltas:
                        yield chunk(i, d, lp)
                        lp = None  # the step's logprobs go with its first chunk
                    if out.finished:
                        yield chunk(i, {}, lp, _finish(gen.plan, answer.calls, c.finish_reason), c.stop_reason)
                    elif lp is not None:
                        yield chunk(i, {}, lp)
                    continue
                if not c.delta_text and lp is None and not out.finished:
                    continue
                delta = {"content": c.delta_text} if c.delta_text or not out.finished else {}
                yield chunk(i, delta, lp, c.finish_reason, c.stop_reason)
        if include_usage:
            yield sse({**base, "choices": [], "usage": usage()})
    except (ValueError, RuntimeError, APIError) as e:
        yield stream_error_chunk(e, gen.request_id)
    yield SSE_DONE
