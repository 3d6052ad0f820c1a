"""GET /v1/models, POST /tokenize and /detokenize, GET /health (and /health/live, /health/ready),
/version and /metrics, POST /reset_prefix_cache. While `tokenmill serve` loads its engine, startup.py
answers the health routes instead."""

from __future__ import annotations

import logging

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST

import tokenmill
from tokenmill.engine.async_engine import EngineDeadError
from tokenmill.lora.request import LoRARequest
from tokenmill.server.chat_template import render_chat
from tokenmill.server.checks import check_model, check_token_ids
from tokenmill.server.context import ServerContext, get_ctx
from tokenmill.server.errors import APIError, CheckedRoute
from tokenmill.server.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorResponse,
    HealthResponse,
    ModelCard,
    ModelList,
    TokenizeChatRequest,
    TokenizeRequest,
    TokenizeResponse,
    VersionResponse,
)

logger = logging.getLogger("tokenmill.server")
router = APIRouter(route_class=CheckedRoute)
_ERR = {
    400: {"model": ErrorResponse},
    401: {"model": ErrorResponse},
    404: {"model": ErrorResponse},
    413: {"model": ErrorResponse},
}


def _card(ctx: ServerContext, lora: LoRARequest | None = None) -> ModelCard:
    """The base model's card, or a LoRA adapter's as vLLM writes it: root = its folder, parent = the
    base model it was registered for (--lora-modules' base_model_name), else the served model."""
    if lora is None:
        return ModelCard(
            id=ctx.model_name,
            created=int(ctx.started),
            root=ctx.engine.config.model.path,
            max_model_len=ctx.max_model_len,
        )
    return ModelCard(
        id=lora.lora_name,
        created=int(ctx.started),
        root=lora.lora_path,
        parent=lora.base_model_name or ctx.model_name,
        max_model_len=ctx.max_model_len,
    )


def _adapters(ctx: ServerContext) -> list[LoRARequest]:
    registry = ctx.lora
    if registry is None:
        return []
    return [lr for lr in map(registry.lookup, registry.names()) if lr is not None]


@router.get("/v1/models", response_model=ModelList, responses=_ERR, tags=["OpenAI"])
async def list_models(raw: Request) -> ModelList:
    """The base model, then every LoRA adapter (with --enable-lora), each usable as `model`."""
    ctx = get_ctx(raw)
    return ModelList(data=[_card(ctx)] + [_card(ctx, lr) for lr in _adapters(ctx)])


@router.get("/v1/models/{model:path}", response_model=ModelCard, responses=_ERR, tags=["OpenAI"])
async def retrieve_model(model: str, raw: Request) -> ModelCard:
    ctx = get_ctx(raw)
    lora = check_model(ctx, model)
    if lora is None:
        return _card(ctx)
    return _card(ctx, ctx.lora.lookup(model) or lora)  # with its path (check_model's is by name only)


@router.post("/tokenize", response_model=TokenizeResponse, responses=_ERR, tags=["tokens"])
async def tokenize(body: TokenizeRequest, raw: Request) -> TokenizeResponse:
    """A prompt (`prompt`), or chat messages rendered by the chat template (`messages`)."""
    ctx = get_ctx(raw)
    check_model(ctx, body.model)
    if isinstance(body, TokenizeChatRequest):
        ids = await ctx.offload(
            render_chat,
            ctx,
            body.messages,
            body.add_generation_prompt,
            body.continue_final_message,
            body.chat_template,
            body.chat_template_kwargs,
        )
    else:
        ids = await ctx.offload(ctx.encode, body.prompt, body.add_special_tokens)
    strs = ctx.tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None
    return TokenizeResponse(count=len(ids), max_model_len=ctx.max_model_len, tokens=ids, token_strs=strs)


@router.post("/detokenize", response_model=DetokenizeResponse, responses=_ERR, tags=["tokens"])
async def detokenize(body: DetokenizeRequest, raw: Request) -> DetokenizeResponse:
    ctx = get_ctx(raw)
    check_model(ctx, body.model)
    check_token_ids(ctx, body.tokens, "tokens")
    return DetokenizeResponse(prompt=await ctx.offload(ctx.tokenizer.decode, body.tokens))


_HEALTH = {
    200: {"model": HealthResponse, "description": 'the engine is running: {"status": "ok"}'},
    503: {
        "model": HealthResponse,
        "description": 'the engine is loading (`tokenmill serve`: {"status": '
        '"loading", "phase": ...}), failed to load ("failed") or has died ("unhealthy")',
    },
}
_LIVE = {
    200: {
        "model": HealthResponse,
        "description": "the process serves HTTP, the engine running or still "
        'loading: {"status": "ok"} or {"status": "loading", ...}',
    },
    503: {"model": HealthResponse, "description": "the engine has died or failed to load"},
}


def _engine_health(raw: Request) -> JSONResponse:
    ok = get_ctx(raw).aengine.is_running
    return JSONResponse({"status": "ok" if ok else "unhealthy"}, status_code=200 if ok else 503)


@router.get("/health", tags=["server"], response_model=None, responses=_HEALTH)
@router.head("/health", tags=["server"], response_model=None, responses=_HEALTH)
async def health(raw: Request) -> JSONResponse:
    """No authentication: for load balancers and orchestrators (HEAD too: the same status, no body).
    200 only when the engine can take requests: /health/ready."""
    return _engine_health(raw)


@router.get("/health/ready", tags=["server"], response_model=None, responses=_HEALTH)
@router.head("/health/ready", tags=["server"], response_model=None, responses=_HEALTH)
async def health_ready(raw: Request) -> JSONResponse:
    """Readiness (a Kubernetes readinessProbe): 200 when the engine can take requests, else 503."""
    return _engine_health(raw)


@router.get("/health/live", tags=["server"], response_model=None, responses=_LIVE)
@router.head("/health/live", tags=["server"], response_model=None, responses=_LIVE)
async def health_live(raw: Request) -> JSONResponse:
    """Liveness (a Kubernetes livenessProbe): 200 while the process serves, also while the engine
    loads; 503 once the engine has died (`tokenmill serve` then exits 1 itself)."""
    return _engine_health(raw)


@router.get("/version", response_model=VersionResponse, tags=["server"])
async def version() -> VersionResponse:
    return VersionResponse(version=tokenmill.__version__)


@router.get(
    "/metrics",
    tags=["server"],
    response_class=Response,
    responses={200: {"content": {"text/plain": {}}, "description": "Prometheus text format"}},
)
async def metrics(raw: Request) -> Response:
    return Response(get_ctx(raw).metrics.render(), media_type=CONTENT_TYPE_LATEST)


@router.post(
    "/reset_prefix_cache",
    tags=["server"],
    response_class=Response,
    responses={200: {"description": "the prefix cache is empty (empty body)"}, 401: {"model": ErrorResponse}},
)
async def reset_prefix_cache(raw: Request) -> Response:
    """vLLM's route: forget every cached prompt prefix (blocks of running requests stay theirs), so
    that later requests compute their prompts again; the prefix-cache counters of /metrics keep counting."""
    ctx = get_ctx(raw)
    try:
        dropped = await ctx.aengine.reset_prefix_cache()
    except EngineDeadError as e:
        raise APIError(str(e), 503) from None
    logger.info("prefix cache reset: %d cached blocks forgotten", dropped)
    return Response(status_code=200)
