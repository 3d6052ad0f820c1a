"""POST /v1/chat/completions: the model's chat template over system / user / assistant
messages (content as a string or a list of text parts), logprobs, usage, SSE streaming."""

from __future__ import annotations

import time

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from tokenmill.llm import merge_samples
from tokenmill.outputs import Logprob, RequestOutput
from tokenmill.server.errors import APIError, CheckedRoute
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
from tokenmill.server.serving import (
    SSE_DONE,
    SSEResponse,
    ServerContext,
    check_logprobs,
    check_model,
    check_sampling_fields,
    clamp_logprob,
    collect_all,
    get_ctx,
    run_beam_search,
    sample_streams,
    log_ignored_fields,
    merge,
    new_request_id,
    prompt_logprobs_json,
    resolve_max_tokens,
    run_cancellable,
    sampling_params,
    served_name,
    sse,
    start_streams,
    stream_error_chunk,
    track,
)
from tokenmill.server.chat_template import render_chat
from tokenmill.server.response_body import check_response_values, json_response, prompt_values, sequence_values
from tokenmill.server.tool_calls import ToolPlan, apply_tool_grammar, parse_tool_calls, plan_tools

router = APIRouter(tags=["OpenAI"], route_class=CheckedRoute)

@router.post(
    "/v1/chat/completions",
    response_model=None,
    responses={200: {"model": ChatCompletionResponse,
                     "description": "a chat completion, or with stream=true an SSE stream of "
                                    "`chat.completion.chunk` objects ending with `data: [DONE]`",
                     "content": sse_content(ChatCompletionStreamResponse, ErrorResponse, done=True)},
               **ERROR_RESPONSES},
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
    ids = await ctx.offload(render_chat, ctx, body.messages, body.add_generation_prompt,
                            body.continue_final_message, body.chat_template, body.chat_template_kwargs, plan)
    max_param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    requested = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    max_tokens = resolve_max_tokens(ctx, len(ids), requested, "messages", max_param)
    params = sampling_params(body, max_tokens, top_n)
    plan = apply_tool_grammar(params, plan)
    if not body.stream:
        sequences = (body.n or 1) * sequence_values(max_tokens, top_n)
        check_response_values(ctx, sequences + prompt_values(len(ids), body.prompt_logprobs), max_param)

    request_id = new_request_id("chatcmpl")
    tracker = track(raw, request_id, body)
    tracker.prompt_tokens = len(ids)
    if body.use_beam_search:
        result = await run_beam_search(ctx, ids, body, max_tokens, request_id, lora)
        n_out = sum(len(s.output_tokens) for s in result.sequences)
        return JSONResponse(ChatCompletionResponse(
            id=request_id, created=int(time.time()), model=model,
            choices=[ChatCompletionResponseChoice(index=j, message=ChatResponseMessage(content=s.text),
                                                  finish_reason="stop" if s.finished else "length")
                     for j, s in enumerate(result.sequences)],
            usage=UsageInfo(prompt_tokens=len(ids), completion_tokens=n_out, total_tokens=len(ids) + n_out),
        ).model_dump())
    streams = await start_streams(sample_streams(ctx, ids, params, request_id, tracker, 0, lora))
    created = int(time.time())
    if body.stream:
        return SSEResponse(_stream(ctx, body, request_id, created, streams, top_n, len(ids), plan, model))
    outs = await collect_all(streams)
    return await json_response(ctx, _response, request_id, created, model, merge_samples(outs, params), plan, top_n)


def _response(request_id: str, created: int, model: str, out: RequestOutput, plan: ToolPlan | None,
              top_n: int | None) -> dict:
    """The whole response (on the prep pool, by json_response). Logprobs stay plain dicts: as pydantic
    models they cost an object per entry, and dumping them is one call that holds the GIL throughout."""
    choices = []
    for c in out.outputs:
        content, calls = parse_tool_calls(plan, c.text) if plan is not None else (c.text, [])
        choice = ChatCompletionResponseChoice(
            index=c.index, message=ChatResponseMessage(content=content, tool_calls=calls or None),
            finish_reason=_finish(plan, calls, c.finish_reason), stop_reason=c.stop_reason).model_dump()
        if top_n is not None and c.logprobs is not None:
            choice["logprobs"] = {"content": chat_logprobs(c.token_ids, c.logprobs, top_n)}
        choices.append(choice)
    resp = ChatCompletionResponse(id=request_id, created=created, model=model, choices=[],
                                  usage=UsageInfo.from_outputs([out])).model_dump()
    return {**resp, "choices": choices, "prompt_logprobs": prompt_logprobs_json(out)}


def _entry(e: Logprob) -> dict:
    token = e.decoded_token or ""
    return {"token": token, "logprob": clamp_logprob(e.logprob), "bytes": list(token.encode("utf-8"))}


def chat_logprobs(token_ids: list[int], logprobs: list[dict[int, Logprob]], top_n: int) -> list[dict]:
    """OpenAI's logprobs.content entries (ChatLogProbsContent's shape, as plain dicts)."""
    content = []
    for tid, step in zip(token_ids, logprobs):
        tops = sorted((e for e in step.values() if e.rank is not None and e.rank <= top_n), key=lambda e: e.rank)
        content.append({**_entry(step[tid]), "top_logprobs": [_entry(e) for e in tops[:top_n]]})
    return content


def _finish(plan: ToolPlan | None, calls: list, reason: str | None) -> str | None:
    """OpenAI: tool_calls when the model chose to call (auto, required); stop for a forced function."""
    if calls and plan is not None and plan.mode != "named" and reason == "stop":
        return "tool_calls"
    return reason


async def _stream(ctx: ServerContext, body: ChatCompletionRequest, request_id: str, created: int, streams,
                  top_n: int | None, prompt_tokens: int, plan: ToolPlan | None = None, model: str | None = None):
    """Stream i carries choice i (n > 1: one per sample). With tools to parse, a choice's text is
    held back until it is complete, then sent as content or as tool_calls."""
    opts = body.stream_options
    include_usage = bool(opts and opts.include_usage)
    continuous = bool(include_usage and opts.continuous_usage_stats)
    base = {"id": request_id, "object": "chat.completion.chunk", "created": created,
            "model": model or ctx.model_name}
    latest: dict[int, RequestOutput] = {}

    def usage() -> dict:
        return UsageInfo.from_outputs(latest.values(), prompt_tokens).model_dump()

    def chunk(index: int, delta: dict, logprobs=None, finish_reason=None, stop_reason=None) -> bytes:
        d = {**base, "choices": [{"index": index, "delta": delta, "logprobs": logprobs,
                                  "finish_reason": finish_reason, "stop_reason": stop_reason}]}
        if include_usage:
            d["usage"] = usage() if continuous else None
        return sse(d)

    try:
        async for i, out in merge(streams):
            opened = i in latest
            latest[i] = out
            c = out.outputs[0]
            n = len(c.token_ids)
            if not opened:  # OpenAI opens every choice with the role
                yield chunk(i, {"role": "assistant", "content": ""})
            lp = None
            if top_n is not None and c.logprobs is not None and c.delta_token_ids:
                k = len(c.delta_token_ids)
                lp = {"content": chat_logprobs(c.delta_token_ids, c.logprobs[n - k:], top_n)}
            if plan is not None:
                if out.finished:
                    content, calls = parse_tool_calls(plan, c.text)
                    if calls:
                        yield chunk(i, {"tool_calls": [{"index": k, **call} for k, call in enumerate(calls)]})
                    elif content:
                        yield chunk(i, {"content": content})
                    yield chunk(i, {}, None, _finish(plan, calls, c.finish_reason), c.stop_reason)
                continue
            if not c.delta_text and lp is None and not out.finished:
                continue
            delta = {"content": c.delta_text} if c.delta_text or not out.finished else {}
            yield chunk(i, delta, lp, c.finish_reason, c.stop_reason)
        if include_usage:
            yield sse({**base, "choices": [], "usage": usage()})
    except (ValueError, RuntimeError, APIError) as e:
        yield stream_error_chunk(e, request_id)
    yield SSE_DONE
