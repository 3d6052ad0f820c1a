"""Text Generation Inference routes: POST /generate, POST /generate_stream and GET /info, with
TGI's request and response shapes, validation messages, and error body
`{"error": "...", "error_type": "validation"}` (422) that TGI clients parse."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

import tokenmill
from tokenmill.lora.request import LoRARequest
from tokenmill.outputs import RequestOutput
from tokenmill.sampling_params import GuidedDecodingParams, SamplingParams
from tokenmill.server.checks import lora_request
from tokenmill.server.context import ServerContext, get_ctx
from tokenmill.server.engine_streams import collect_all, engine_stream, merge, new_request_id, start_streams, track
from tokenmill.server.errors import APIError, CheckedRoute
from tokenmill.server.logprobs import clamp_logprob
from tokenmill.server.protocol import sse_content
from tokenmill.server.sampling import Sampling
from tokenmill.server.sse import SSEResponse, run_cancellable, sse, stream_error

router = APIRouter(tags=["TGI"], route_class=CheckedRoute)

MAX_STOP_SEQUENCES = 4
MAX_TOP_N_TOKENS = 5


class TGIParameters(BaseModel):
    """TGI's parameters; the ranges are checked by pydantic (422 with TGI's messages, see errors.py)."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)
    best_of: int | None = Field(None, ge=1, le=1, description="only 1 is supported")
    decoder_input_details: bool = Field(False, description="not supported (needs prompt logprobs): false only")
    details: bool = Field(False, description="return generation details (tokens, logprobs, finish reason)")
    do_sample: bool = Field(False, description="sample; greedy when false and no sampling parameter is set")
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    max_new_tokens: int | None = Field(
        100, gt=0, description="input tokens + max_new_tokens <= the context length; null: the rest of the context"
    )
    repetition_penalty: float | None = Field(
        None,
        ge=SamplingParams.REPETITION_PENALTY_MIN,
        le=SamplingParams.REPETITION_PENALTY_MAX,
        description="1 disables",
    )
    return_full_text: bool | None = Field(False, description="prepend the input to generated_text")
    seed: int | None = Field(None, ge=0, le=2**63 - 1)
    stop: list[Annotated[str, Field(min_length=1)]] = Field(
        default_factory=list, max_length=MAX_STOP_SEQUENCES, description="stop sequences, kept in generated_text"
    )
    temperature: float | None = Field(None, gt=0.0, le=SamplingParams.TEMPERATURE_MAX, description="implies sampling")
    top_k: int | None = Field(None, gt=0, le=SamplingParams.TOP_K_MAX, description="implies sampling")
    top_n_tokens: int | None = Field(None, ge=0, le=MAX_TOP_N_TOKENS, description="top alternatives per token")
    top_p: float | None = Field(None, gt=0.0, le=1.0, description="implies sampling")
    truncate: int | None = Field(None, gt=0, description="keep only the last N input tokens (N < the context length)")
    typical_p: float | None = Field(None, ge=1.0, le=1.0, description="not supported: null or 1.0 (disabled) only")
    watermark: bool = Field(False, description="green-list watermark (the server's --watermark-gamma / -delta)")
    grammar: dict[str, Any] | None = Field(
        None, description='{"type": "json", "value": schema} or {"type": "regex", "value": "..."}'
    )
    adapter_id: str | None = Field(
        None,
        description="a LoRA adapter by name (--lora-modules, or loaded at run "
        "time); null or the model's id: the base model",
    )


class TGIRequest(BaseModel):
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)
    inputs: str = Field(..., min_length=1, description="the prompt (it and max_new_tokens must fit the context)")
    parameters: TGIParameters = Field(default_factory=TGIParameters)
    stream: bool = False


class TGIErrorResponse(BaseModel):
    error: str
    error_type: str = Field(..., description="validation, overloaded or generation")


class TGIToken(BaseModel):
    id: int
    text: str
    logprob: float | None = None
    special: bool = False


class TGIDetails(BaseModel):
    finish_reason: str
    generated_tokens: int
    seed: int | None = None
    prefill: list[TGIToken] = Field(default_factory=list)
    tokens: list[TGIToken] = Field(default_factory=list)
    top_tokens: list[list[TGIToken]] | None = None


class TGIResponse(BaseModel):
    generated_text: str
    details: TGIDetails | None = None


class TGIStreamDetails(BaseModel):
    finish_reason: str
    generated_tokens: int
    seed: int | None = None
    input_length: int


class TGIStreamResponse(BaseModel):
    """One SSE event of /generate_stream (documentation)."""

    index: int
    token: TGIToken
    top_tokens: list[TGIToken] | None = None
    generated_text: str | None = None
    details: TGIStreamDetails | None = None


_TGI_ERRORS = {
    401: {"model": TGIErrorResponse, "description": "missing or wrong API key (with --api-key)"},
    413: {"model": TGIErrorResponse, "description": "body over --max-request-body-bytes"},
    422: {
        "model": TGIErrorResponse,
        "description": "validation error (error_type validation), malformed JSON included",
    },
    503: {
        "model": TGIErrorResponse,
        "description": "overloaded (error_type overloaded) or the engine is not running (generation)",
    },
}
# The same for a route whose response class is SSE (FastAPI would document a "model" as SSE too).
_TGI_ERRORS_JSON = {
    status: {
        "description": r["description"],
        "content": {"application/json": {"schema": {"$ref": "#/components/schemas/TGIErrorResponse"}}},
    }
    for status, r in _TGI_ERRORS.items()
}


def _bad(msg: str) -> APIError:
    return APIError(msg, 422, tgi_type="validation")


def _validate(ctx: ServerContext, req: TGIRequest) -> tuple[list[int], SamplingParams, bool, LoRARequest | None]:
    """TGI's checks and messages; returns (input ids, params, sampling?, the adapter)."""
    p = req.parameters
    lora = None
    if p.adapter_id and p.adapter_id != ctx.model_name and p.adapter_id not in ctx.model_aliases:
        lora = lora_request(ctx, p.adapter_id)
        if lora is None:  # TGI itself would serve the base model; a typo must not go unnoticed
            raise _bad(
                f"`adapter_id` {p.adapter_id!r} is not a loaded LoRA adapter"
                + ("" if ctx.lora is not None else " (the server runs without --enable-lora)")
            )
    if p.best_of is not None and p.best_of != 1:
        raise _bad("`best_of` != 1 is not supported")
    if p.decoder_input_details:
        raise _bad("`decoder_input_details` is not supported (no prompt logprobs)")
    if p.typical_p is not None and p.typical_p < 1.0:
        raise _bad("`typical_p` is not supported")
    if p.temperature is not None and p.temperature <= 0:
        raise _bad("`temperature` must be strictly positive")
    if p.repetition_penalty is not None and p.repetition_penalty <= 0:
        raise _bad("`repetition_penalty` must be strictly positive")
    if p.frequency_penalty is not None and not -2.0 <= p.frequency_penalty <= 2.0:
        raise _bad("`frequency_penalty` must be >= -2.0 and <= 2.0")
    if p.top_p is not None and not 0.0 < p.top_p <= 1.0:
        raise _bad("`top_p` must be > 0.0 and <= 1.0")
    if p.top_k is not None and p.top_k <= 0:
        raise _bad("`top_k` must be strictly positive")
    if p.max_new_tokens is not None and p.max_new_tokens <= 0:
        raise _bad("`max_new_tokens` must be strictly positive")
    if len(p.stop) > MAX_STOP_SEQUENCES:
        raise _bad(f"`stop` supports up to {MAX_STOP_SEQUENCES} stop sequences. Given: {len(p.stop)}")
    if any(not s for s in p.stop):
        raise _bad("`stop` sequences must not be empty")
    if p.top_n_tokens is not None and not 0 <= p.top_n_tokens <= MAX_TOP_N_TOKENS:
        raise _bad(f"`top_n_tokens` must be >= 0 and <= {MAX_TOP_N_TOKENS}. Given: {p.top_n_tokens}")
    if not req.inputs:
        raise _bad("`inputs` cannot be empty")
    limit = ctx.max_model_len
    try:
        ids = ctx.engine.encode(req.inputs, what="`inputs`")
    except ValueError as e:
        raise _bad(str(e)) from None
    if p.truncate is not None:
        if not 0 < p.truncate < limit:
            raise _bad(f"`truncate` must be strictly positive and less than {limit}. Given: {p.truncate}")
        ids = ids[-p.truncate :]
    max_new = p.max_new_tokens if p.max_new_tokens is not None else limit - len(ids)
    if len(ids) >= limit:
        raise _bad(f"`inputs` must have less than {limit} tokens. Given: {len(ids)}")
    if len(ids) + max_new > limit:
        raise _bad(
            f"`inputs` tokens + `max_new_tokens` must be <= {limit}. "
            f"Given: {len(ids)} `inputs` tokens and {max_new} `max_new_tokens`"
        )
    sampling = (
        p.do_sample
        or (p.temperature is not None and p.temperature != 1.0)
        or p.top_k is not None
        or (p.top_p is not None and p.top_p < 1.0)
    )
    try:
        guided = _grammar(p.grammar)
    except ValueError as e:
        raise _bad(str(e)) from None
    params = Sampling(
        temperature=(p.temperature or 1.0) if sampling else 0.0,
        top_p=p.top_p or 1.0,
        top_k=p.top_k or -1,
        seed=p.seed if sampling else None,
        repetition_penalty=p.repetition_penalty or 1.0,
        frequency_penalty=p.frequency_penalty or 0.0,
        stop=p.stop,
        include_stop_str_in_output=True,  # TGI's generated_text ends with the stop sequence
        logprobs=p.top_n_tokens or 0,
        watermark=p.watermark,
        guided=guided,
    ).params(max_new, invalid=lambda e: _bad(str(e)))
    return ids, params, sampling, lora


def _grammar(g: dict | None) -> GuidedDecodingParams | None:
    """TGI's grammar parameter as structured-output constraints."""
    if g is None:
        return None
    kind, value = g.get("type"), g.get("value")
    if kind == "json" and isinstance(value, (dict, str)):
        return GuidedDecodingParams(json=value)
    if kind == "regex" and isinstance(value, str):
        return GuidedDecodingParams(regex=value)
    raise ValueError('grammar must be {"type": "json", "value": <schema>} or {"type": "regex", "value": <regex>}')


def _finish_reason(out: RequestOutput) -> str:
    c = out.outputs[0]
    if c.finish_reason == "length":
        return "length"
    if isinstance(c.stop_reason, str):
        return "stop_sequence"
    return "eos_token"


def _tokens(
    ctx: ServerContext, out: RequestOutput, token_ids: list[int], texts: list[str] | None, top_n: int
) -> tuple[list[TGIToken], list[list[TGIToken]]]:
    c = out.outputs[0]
    special = set(ctx.tokenizer.all_special_ids)
    lps = (c.logprobs or [])[len(c.token_ids) - len(token_ids) :] if c.logprobs else [None] * len(token_ids)
    tokens, tops = [], []
    for j, (tid, step) in enumerate(zip(token_ids, lps)):
        chosen = step.get(tid) if step else None
        text = texts[j] if texts is not None else (chosen.decoded_token if chosen else "")
        tokens.append(
            TGIToken(
                id=tid,
                text=text or "",
                special=tid in special,
                logprob=clamp_logprob(chosen.logprob) if chosen else None,
            )
        )
        if top_n and step:
            ranked = sorted(
                (e for e in step.items() if e[1].rank is not None and e[1].rank <= top_n), key=lambda e: e[1].rank
            )
            tops.append(
                [
                    TGIToken(id=t, text=e.decoded_token or "", logprob=clamp_logprob(e.logprob), special=t in special)
                    for t, e in ranked
                ]
            )
    return tokens, tops


async def _start(ctx: ServerContext, req: TGIRequest, raw: Request):
    ids, params, sampling, lora = await ctx.offload(_validate, ctx, req)
    request_id = new_request_id("tgi")
    tracker = track(raw, request_id)
    tracker.prompt_tokens = len(ids)
    streams = await start_streams([engine_stream(ctx, ids, params, request_id, tracker, lora=lora)])
    return ids, streams, (req.parameters.seed if sampling else None)


@router.post(
    "/generate",
    response_model=TGIResponse,
    response_model_exclude_none=True,
    responses={
        200: {
            "description": "the generation, or with stream=true the events of /generate_stream",
            "content": sse_content(TGIStreamResponse, TGIErrorResponse, done=False),
        },
        **_TGI_ERRORS,
    },
)
async def generate(body: TGIRequest, raw: Request):
    ctx = get_ctx(raw)
    if body.stream:
        return await run_cancellable(raw, _generate_stream(ctx, body, raw))
    return await run_cancellable(raw, _generate(ctx, body, raw))


async def _generate(ctx: ServerContext, body: TGIRequest, raw: Request):
    ids, streams, seed = await _start(ctx, body, raw)
    (out,) = await collect_all(streams)
    c = out.outputs[0]
    text = (body.inputs if body.parameters.return_full_text else "") + c.text
    resp: dict[str, Any] = {"generated_text": text}
    if body.parameters.details:
        top_n = body.parameters.top_n_tokens or 0
        tokens, tops = _tokens(ctx, out, c.token_ids, None, top_n)
        details = TGIDetails(
            finish_reason=_finish_reason(out),
            generated_tokens=len(c.token_ids),
            seed=seed,
            tokens=tokens,
            top_tokens=tops or None,
        )
        resp["details"] = details.model_dump(exclude={"top_tokens"} if not tops else None)
    return JSONResponse(resp)


@router.post(
    "/generate_stream",
    response_model=None,
    response_class=SSEResponse,
    status_code=200,
    responses={
        200: {
            "description": "SSE events `data: {TGIStreamResponse}`; the last carries generated_text "
            "(and details when asked)",
            "content": sse_content(TGIStreamResponse, TGIErrorResponse, done=False),
        },
        **_TGI_ERRORS_JSON,
    },
)
async def generate_stream(body: TGIRequest, raw: Request):
    return await run_cancellable(raw, _generate_stream(get_ctx(raw), body, raw))


async def _generate_stream(ctx: ServerContext, body: TGIRequest, raw: Request):
    ids, streams, seed = await _start(ctx, body, raw)
    return SSEResponse(_events(ctx, body, ids, streams, seed, raw.state.tracker.request_id))


async def _events(ctx: ServerContext, body: TGIRequest, ids: list[int], streams, seed, request_id: str):
    top_n = body.parameters.top_n_tokens or 0
    index = 0
    try:
        async for _, out in merge(streams):
            c = out.outputs[0]
            delta = c.delta_token_ids
            if not delta:
                continue
            texts = [""] * (len(delta) - 1) + [c.delta_text]
            tokens, tops = _tokens(ctx, out, delta, texts, top_n)
            for j, tok in enumerate(tokens):
                index += 1
                last = out.finished and j == len(tokens) - 1
                event: dict[str, Any] = {
                    "index": index,
                    "token": tok.model_dump(),
                    "generated_text": None,
                    "details": None,
                }
                if tops:
                    event["top_tokens"] = [t.model_dump() for t in tops[j]]
                if last:
                    event["generated_text"] = (body.inputs if body.parameters.return_full_text else "") + c.text
                    if body.parameters.details:
                        event["details"] = TGIStreamDetails(
                            finish_reason=_finish_reason(out),
                            generated_tokens=len(c.token_ids),
                            seed=seed,
                            input_length=len(ids),
                        ).model_dump()
                yield sse(event)
    except (ValueError, RuntimeError, APIError) as e:
        yield sse({"error": stream_error(e, request_id).message, "error_type": "generation"})


@router.get("/info")
async def info(raw: Request) -> dict:
    """TGI's /info: what clients read to learn the model and its limits."""
    ctx = get_ctx(raw)
    cfg = ctx.engine.config
    return {
        "model_id": ctx.model_name,
        "model_sha": None,
        "model_dtype": str(cfg.model.dtype).replace("torch.", ""),
        "model_device_type": cfg.model.device,
        "model_pipeline_tag": "text-generation",
        "max_concurrent_requests": cfg.scheduler.max_num_seqs,
        "max_best_of": 1,
        "max_stop_sequences": MAX_STOP_SEQUENCES,
        "max_input_tokens": cfg.model.max_model_len - 1,
        "max_total_tokens": cfg.model.max_model_len,
        "max_top_n_tokens": MAX_TOP_N_TOKENS,
        "validation_workers": 1,
        "max_client_batch_size": 1,
        "router": "tokenmill",
        "version": tokenmill.__version__,
        "sha": None,
        "docker_label": None,
    }
