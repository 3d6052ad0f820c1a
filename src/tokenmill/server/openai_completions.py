"""POST /v1/completions: prompts as text or token ids (one engine request per prompt, choices
indexed in prompt order), echo, logprobs, usage, and SSE streaming as OpenAI sends it."""

from __future__ import annotations

import time

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from tokenmill.llm import merge_samples
from tokenmill.outputs import Logprob, RequestOutput
from tokenmill.sampling_params import SamplingParams
from tokenmill.server.checks import (
    MAX_N,
    MAX_SEQUENCES,
    check_logprobs,
    check_model,
    check_sampling_fields,
    check_token_ids,
    log_ignored_fields,
    resolve_max_tokens,
    served_name,
)
from tokenmill.server.context import ServerContext, get_ctx
from tokenmill.server.engine_streams import (
    collect_all,
    merge,
    new_request_id,
    run_beam_search,
    sample_streams,
    start_streams,
    track,
)
from tokenmill.server.errors import APIError, CheckedRoute
from tokenmill.server.logprobs import clamp_logprob as _clamp
from tokenmill.server.logprobs import prompt_logprobs_json
from tokenmill.server.protocol import (
    CompletionLogProbs,
    CompletionRequest,
    CompletionResponse,
    CompletionResponseChoice,
    CompletionStreamResponse,
    ErrorResponse,
    UsageInfo,
    sse_content,
)
from tokenmill.server.response_body import check_response_values, json_response, prompt_values, sequence_values
from tokenmill.server.sampling import sampling_params
from tokenmill.server.sse import SSE_DONE, SSEResponse, run_cancellable, sse, stream_error_chunk

router = APIRouter(tags=["OpenAI"], route_class=CheckedRoute)

ERROR_RESPONSES = {
    400: {"model": ErrorResponse, "description": "bad input"},
    401: {"model": ErrorResponse, "description": "missing or wrong API key"},
    404: {"model": ErrorResponse, "description": "unknown model"},
    413: {"model": ErrorResponse, "description": "body over --max-request-body-bytes"},
    503: {"model": ErrorResponse, "description": "too many waiting requests (see Retry-After)"},
}


@router.post(
    "/v1/completions",
    response_model=None,
    responses={
        200: {
            "model": CompletionResponse,
            "description": "a completion, or with stream=true an SSE stream of chunks of the same "
            "shape (`data: {...}`), ending with `data: [DONE]`",
            "content": sse_content(CompletionStreamResponse, ErrorResponse, done=True),
        },
        **ERROR_RESPONSES,
    },
)
async def create_completion(body: CompletionRequest, raw: Request):
    return await run_cancellable(raw, _create_completion(get_ctx(raw), body, raw))


def _prompts(ctx: ServerContext, body: CompletionRequest) -> list[tuple[str | None, list[int]]]:
    """(text or None, token ids) per prompt."""
    p = body.prompt
    if isinstance(p, str):
        p = [p]
    if not p:
        raise APIError("prompt must not be empty", param="prompt")
    if isinstance(p[0], int):
        p = [p]
    if len(p) > ctx.max_prompts_per_request:
        raise APIError(f"at most {ctx.max_prompts_per_request} prompts per request, got {len(p)}", param="prompt")
    out = []
    for item in p:
        if isinstance(item, str):
            out.append((item, ctx.encode(item, body.add_special_tokens)))
        else:
            check_token_ids(ctx, item, "prompt")
            out.append((None, list(item)))
    return out


async def _create_completion(ctx: ServerContext, body: CompletionRequest, raw: Request):
    log_ignored_fields(body)
    lora = check_model(ctx, body.model)
    if body.suffix is not None:
        raise APIError("suffix is not supported (no fill-in-the-middle)", param="suffix")
    if body.best_of is not None and not 1 <= body.best_of <= MAX_N:
        raise APIError(f"best_of must be in [1, {MAX_N}], got {body.best_of}", param="best_of")
    if body.stream and body.best_of is not None and body.best_of > (body.n or 1):
        raise APIError("best_of > n cannot be streamed (the best are known only at the end)", param="best_of")
    check_sampling_fields(ctx, body)
    check_logprobs(ctx, body.logprobs, "logprobs")
    # Scoring calls (evaluation harnesses): echo=True, max_tokens 0, logprobs N: the prompt's logprobs only.
    score_only = bool(body.echo) and body.max_tokens == 0
    if score_only and body.stream:
        raise APIError("max_tokens 0 (echo only) cannot be streamed", param="max_tokens")
    prompts = await ctx.offload(_prompts, ctx, body)
    params = []
    for _, ids in prompts:
        max_tokens = resolve_max_tokens(ctx, len(ids), 1 if score_only else body.max_tokens)
        sp = sampling_params(body, max_tokens, body.logprobs)
        if body.echo and body.logprobs is not None:
            sp.prompt_logprobs = max(body.logprobs, sp.prompt_logprobs or 0)
        params.append(sp)

    if not body.stream:
        check_response_values(ctx, _response_values(body, prompts, params), "max_tokens")

    request_id = new_request_id("cmpl")
    tracker = track(raw, request_id, body)
    tracker.prompt_tokens = sum(len(ids) for _, ids in prompts)
    if body.use_beam_search:
        return JSONResponse((await _beam_search(ctx, body, request_id, prompts, params, lora)).model_dump())
    many = len(prompts) > 1
    S = params[0].num_samples  # engine requests per prompt; choice index = prompt * n + sample
    if len(prompts) * S > MAX_SEQUENCES:
        raise APIError(
            f"{len(prompts)} prompts x {S} samples is {len(prompts) * S} sequences; one request may "
            f"start at most {MAX_SEQUENCES}",
            param="n",
        )
    streams = []
    for i, ((_, ids), sp) in enumerate(zip(prompts, params)):
        streams += sample_streams(ctx, ids, sp, f"{request_id}-{i}" if many else request_id, tracker, i * S, lora)
    streams = await start_streams(streams)
    texts = await ctx.offload(_echo_texts, ctx, prompts) if body.echo else None
    created = int(time.time())
    if body.stream:
        stream_texts = [texts[k // S] for k in range(len(streams))] if texts else None
        return SSEResponse(
            _stream(
                ctx, body, request_id, created, streams, stream_texts, tracker.prompt_tokens, served_name(ctx, lora)
            )
        )
    outs = await collect_all(streams)
    merged = [merge_samples(outs[i * S : (i + 1) * S], sp) for i, sp in enumerate(params)]
    return await json_response(
        ctx, _response_json, ctx, body, request_id, created, merged, texts, score_only, served_name(ctx, lora)
    )


def _response_values(body: CompletionRequest, prompts, params: list[SamplingParams]) -> int:
    """What the whole response may hold (response_body.check_response_values): per returned choice its
    tokens and their logprobs, and the prompt's logprobs when echoed with logprobs or asked for."""
    total = 0
    for (_, ids), sp in zip(prompts, params):
        echoed = len(ids) if body.echo and body.logprobs is not None else 0
        per_choice = (
            sequence_values(sp.max_tokens, body.logprobs)
            + prompt_values(echoed, body.logprobs)
            + prompt_values(len(ids), body.prompt_logprobs)
        )
        total += (body.n or 1) * per_choice
    return total


def _response_json(*args) -> dict:
    """_response as JSON values, one choice at a time (on the prep pool, by json_response): one
    model_dump of the whole response held the GIL for all of its choices."""
    resp = _response(*args)
    choices = [c.model_dump() for c in resp.choices]
    resp.choices = []
    return {**resp.model_dump(), "choices": choices}


def _echo_texts(ctx: ServerContext, prompts) -> list[str]:
    return [text if text is not None else ctx.tokenizer.decode(ids) for text, ids in prompts]


async def _beam_search(ctx, body, request_id: str, prompts, params, lora) -> CompletionResponse:
    choices, completion_tokens = [], 0
    for i, ((text, ids), sp) in enumerate(zip(prompts, params)):
        result = await run_beam_search(ctx, ids, body, sp.max_tokens, f"{request_id}-{i}", lora)
        prefix = (text if text is not None else ctx.tokenizer.decode(ids)) if body.echo else ""
        for j, seq in enumerate(result.sequences):
            completion_tokens += len(seq.output_tokens)
            choices.append(
                CompletionResponseChoice(
                    index=i * len(result.sequences) + j,
                    text=prefix + seq.text,
                    finish_reason="stop" if seq.finished else "length",
                )
            )
    p = sum(len(ids) for _, ids in prompts)
    return CompletionResponse(
        id=request_id,
        created=int(time.time()),
        model=served_name(ctx, lora),
        choices=choices,
        usage=UsageInfo(prompt_tokens=p, completion_tokens=completion_tokens, total_tokens=p + completion_tokens),
    )


def completion_logprobs(
    token_ids: list[int], logprobs: list[dict[int, Logprob] | None], offset: int, tokenizer=None
) -> CompletionLogProbs:
    """OpenAI's legacy shape; top_logprobs holds the sampled token and the top N, as vLLM's does.
    A None step (the first prompt token when echoing) has no logprob: its text comes from `tokenizer`."""
    lp = CompletionLogProbs()
    for tid, step in zip(token_ids, logprobs):
        if step is None:
            token = tokenizer.decode([tid])
            lp.tokens.append(token)
            lp.token_logprobs.append(None)
            lp.top_logprobs.append(None)
            lp.text_offset.append(offset)
            offset += len(token)
            continue
        chosen = step[tid]
        token = chosen.decoded_token or ""
        lp.tokens.append(token)
        lp.token_logprobs.append(_clamp(chosen.logprob))
        top: dict[str, float] = {}
        for e in sorted(step.values(), key=lambda e: -e.logprob):  # tokens sharing a text keep the best
            top.setdefault(e.decoded_token or "", _clamp(e.logprob))
        lp.top_logprobs.append(top)
        lp.text_offset.append(offset)
        offset += len(token)
    return lp


def _response(
    ctx, body, request_id, created, outs: list[RequestOutput], texts, score_only: bool = False, model: str | None = None
) -> CompletionResponse:
    choices = []
    for i, out in enumerate(outs):
        for c in out.outputs:
            choices.append(
                _choice(ctx, body, out, c, i * len(out.outputs) + c.index, texts[i] if texts else "", score_only)
            )
    usage = UsageInfo.from_outputs(outs)
    if score_only:
        usage.completion_tokens, usage.total_tokens = 0, usage.prompt_tokens
    return CompletionResponse(
        id=request_id, created=created, model=model or ctx.model_name, choices=choices, usage=usage
    )


def _choice(ctx, body, out: RequestOutput, c, index: int, prefix: str, score_only: bool) -> CompletionResponseChoice:
    lp = None
    if body.logprobs is not None and c.logprobs is not None:
        lp = CompletionLogProbs()
        if body.echo and out.prompt_logprobs is not None:  # echo: the prompt's tokens first (not for
            # prompt_logprobs alone: those go to the choice's prompt_logprobs only)
            lp = completion_logprobs(out.prompt_token_ids, out.prompt_logprobs, 0, ctx.tokenizer)
        if not score_only:
            gen = completion_logprobs(c.token_ids, c.logprobs, len(prefix))
            for field in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
                getattr(lp, field).extend(getattr(gen, field))
    text = prefix if score_only else prefix + c.text
    return CompletionResponseChoice(
        index=index,
        text=text,
        logprobs=lp,
        finish_reason="length" if score_only else c.finish_reason,
        stop_reason=None if score_only else c.stop_reason,
        prompt_logprobs=prompt_logprobs_json(out) if body.prompt_logprobs is not None else None,
    )


async def _stream(
    ctx: ServerContext,
    body: CompletionRequest,
    request_id: str,
    created: int,
    streams,
    texts,
    prompt_tokens: int,
    model: str,
):
    opts = body.stream_options
    include_usage = bool(opts and opts.include_usage)
    continuous = bool(include_usage and opts.continuous_usage_stats)
    n = len(streams)
    echoed = [False] * n
    offsets = [0] * n
    latest: dict[int, RequestOutput] = {}

    def usage() -> dict:
        return UsageInfo.from_outputs(latest.values(), prompt_tokens).model_dump()

    try:
        async for i, out in merge(streams):
            c = out.outputs[0]
            latest[i] = out
            text = c.delta_text
            echo_lp = False
            if texts and not echoed[i]:
                text = texts[i] + text
                echoed[i] = True
                echo_lp = out.prompt_logprobs is not None
            lp = None
            if body.logprobs is not None and c.logprobs is not None and (c.delta_token_ids or echo_lp):
                k = len(c.delta_token_ids)
                gen = completion_logprobs(
                    c.delta_token_ids, c.logprobs[len(c.token_ids) - k :], offsets[i] + len(text) - len(c.delta_text)
                )
                if echo_lp:  # the echoed prompt's logprobs lead the first chunk
                    head = completion_logprobs(out.prompt_token_ids, out.prompt_logprobs, 0, ctx.tokenizer)
                    for field in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
                        getattr(head, field).extend(getattr(gen, field))
                    gen = head
                lp = gen.model_dump()
            offsets[i] += len(text)
            if not text and lp is None and not out.finished:
                continue
            chunk = {
                "id": request_id,
                "object": "text_completion",
                "created": created,
                "model": model,
                "choices": [
                    {
                        "index": i,
                        "text": text,
                        "logprobs": lp,
                        "finish_reason": c.finish_reason,
                        "stop_reason": c.stop_reason,
                    }
                ],
            }
            if include_usage:
                chunk["usage"] = usage() if continuous else None
            yield sse(chunk)
        if include_usage:
            yield sse(
                {
                    "id": request_id,
                    "object": "text_completion",
                    "created": created,
                    "model": model,
                    "choices": [],
                    "usage": usage(),
                }
            )
    except (ValueError, RuntimeError, APIError) as e:
        yield stream_error_chunk(e, request_id)
    yield SSE_DONE
