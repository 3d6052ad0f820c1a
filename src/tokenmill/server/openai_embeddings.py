"""POST /v1/embeddings: OpenAI's embeddings API (and vLLM's extras truncate_prompt_tokens and
normalize) on an engine that runs embeddings: an encoder model, or a decoder with --task embed.
As vLLM, a server runs one task: a generating model answers this route with a 400."""

from __future__ import annotations

import base64
import time

from fastapi import APIRouter, Request

from tokenmill.engine.async_engine import EngineDeadError, QueueFullError, ServerShutdownError
from tokenmill.pooling_params import PoolingParams
from tokenmill.server.checks import check_model, log_ignored_fields
from tokenmill.server.context import ServerContext, get_ctx
from tokenmill.server.engine_streams import as_api_error, new_request_id, track
from tokenmill.server.errors import APIError, CheckedRoute
from tokenmill.server.openai_completions import ERROR_RESPONSES
from tokenmill.server.protocol import MAX_EMBEDDING_INPUTS, EmbeddingRequest, EmbeddingResponse
from tokenmill.server.response_body import check_response_values, json_response
from tokenmill.server.sse import run_cancellable

router = APIRouter(tags=["OpenAI"], route_class=CheckedRoute)


@router.post(
    "/v1/embeddings",
    response_model=None,
    responses={
        200: {"model": EmbeddingResponse, "description": "one embedding per input, in input order"},
        **ERROR_RESPONSES,
    },
)
async def create_embedding(body: EmbeddingRequest, raw: Request):
    return await run_cancellable(raw, _create_embedding(get_ctx(raw), body, raw))


def _inputs(body: EmbeddingRequest) -> list[str | list[int]]:
    """The inputs as a list of strings or token id lists (pydantic has refused empty ones)."""
    inputs = body.input
    if isinstance(inputs, str) or isinstance(inputs[0], int):
        inputs = [inputs]
    if len(inputs) > MAX_EMBEDDING_INPUTS:
        raise APIError(f"at most {MAX_EMBEDDING_INPUTS} inputs per request, got {len(inputs)}", param="input")
    return inputs


async def _create_embedding(ctx: ServerContext, body: EmbeddingRequest, raw: Request):
    log_ignored_fields(body)
    lora = check_model(ctx, body.model)
    engine = ctx.engine
    if engine.task != "embed":
        raise APIError(
            f"The model does not support Embeddings API: {ctx.model_name} generates text (serve an "
            f"embedding model, or this one with --task embed)",
            param="model",
        )
    if lora is not None:
        raise APIError("LoRA adapters do not serve embeddings", param="model")
    model = engine.config.model
    try:
        params = PoolingParams(body.dimensions, body.normalize, body.truncate_prompt_tokens)
        model.pooler.check_dimensions(body.dimensions, ctx.model_name, model.hf_config.hidden_size)
    except ValueError as e:
        raise APIError(str(e), param="dimensions") from None
    inputs = _inputs(body)
    dims = body.dimensions or model.hf_config.hidden_size
    check_response_values(ctx, len(inputs) * dims, "input", "or split the inputs over several requests")
    request_id = new_request_id("embd")
    tracker = track(raw, request_id)
    try:  # each input is tokenized and checked (length, token ids) before any is queued
        outs = await ctx.aengine.encode(inputs, params, request_id)
    except ValueError as e:
        raise APIError(str(e), param="input") from None
    except (QueueFullError, EngineDeadError, ServerShutdownError) as e:
        raise as_api_error(e) from None
    tracker.prompt_tokens = sum(len(o.prompt_token_ids) for o in outs)
    tracker.finish_reasons.append("stop")
    return await json_response(ctx, _render, request_id, ctx.model_name, outs, body.encoding_format)


def _render(request_id: str, model: str, outs, encoding_format: str) -> dict:
    """The response (on the prep pool, by json_response; plain values: pydantic would check every
    float). Formatting 2,048 embeddings takes 100s of ms: json_response encodes them one at a time."""
    data = []
    for i, out in enumerate(outs):
        vec = out.outputs.data
        if encoding_format == "base64":  # OpenAI's: the little-endian float32 bytes
            emb = base64.b64encode(vec.numpy().astype("<f4", copy=False).tobytes()).decode("ascii")
        else:
            emb = vec.tolist()
        data.append({"object": "embedding", "embedding": emb, "index": i})
    n = sum(len(o.prompt_token_ids) for o in outs)
    return {
        "id": request_id,
        "object": "list",
        "created": int(time.time()),
        "model": model,
        "data": data,
        "usage": {"prompt_tokens": n, "total_tokens": n},
    }
