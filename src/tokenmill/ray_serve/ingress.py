"""The ingress deployment: tokenmill's FastAPI app (OpenAI + TGI routes, auth, validation, access
log) in a Ray Serve replica, over a ReplicaEngineClient instead of an in-process engine.

Only /health and /metrics differ from `tokenmill serve`: they ask every engine replica
(handle.broadcast) and report each, with a `replica` label on every metric.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import asdict

from fastapi import APIRouter, FastAPI, Request, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST
from ray import serve

import tokenmill
from tokenmill.ray_serve.client import ReplicaEngineClient
from tokenmill.ray_serve.metrics import merge_replica_metrics
from tokenmill.ray_serve.replica import EngineFrontend, ReplicaStats
from tokenmill.server import misc_routes, openai_embeddings, openai_responses, web_ui
from tokenmill.server.app import GENERATION_ROUTES, ServerMiddleware, _add_offline_docs
from tokenmill.server.args import ServerArgs
from tokenmill.server.chat_template import install_template_bounds
from tokenmill.server.context import ServerContext, get_ctx
from tokenmill.server.errors import install_error_handlers

logger = logging.getLogger("tokenmill.ray_serve")

STATS_TIMEOUT_S = 10.0  # a replica that does not answer /health or /metrics within this is left out
_REPLICA_ROUTES = {"/health", "/metrics"}  # answered here over every replica, not by misc_routes


# The ingress takes the server's own ServerArgs and reads its RAY_INGRESS_FIELDS (the rest are the
# listener's: Ray Serve's HTTP proxy has them, from ClusterOptions). The old name, kept for callers.
IngressOptions = ServerArgs


class _IngressMetrics:
    """ServerContext.metrics in the ingress: the engines count their own requests, aborts included
    (EngineReplica.generate), and /metrics is answered from the replicas."""

    def on_abort(self) -> None:
        pass


async def replica_stats(handle, timeout_s: float = STATS_TIMEOUT_S) -> list[ReplicaStats]:
    """Every live replica's stats; replicas that fail or time out are left out."""
    try:
        results = await handle.broadcast("stats").results_async(timeout_s=timeout_s, return_exceptions=True)
    except Exception as e:  # noqa: BLE001 - no replica at all (DeploymentUnavailableError), or a timeout
        logger.warning("could not reach the engine replicas: %r", e)
        return []
    return sorted((r for r in results if isinstance(r, ReplicaStats)), key=lambda s: s.replica)


def build_ingress_app(client: ReplicaEngineClient, handle, options: ServerArgs) -> FastAPI:
    """The same app as tokenmill.server.app.build_app, over the replicas."""
    if not install_template_bounds():
        logger.warning("this transformers version compiles chat templates elsewhere: template operators unbounded")
    model_name = client.engine.config.model.name
    ctx = ServerContext(
        aengine=client,
        model_name=model_name,
        metrics=_IngressMetrics(),  # type: ignore[arg-type]
        args=options,
        response_store=openai_responses.ResponseStore(options.max_stored_responses),
    )
    app = FastAPI(
        title="tokenmill",
        version=tokenmill.__version__,
        docs_url=None,
        redoc_url=None,
        description="OpenAI-compatible and TGI-compatible LLM server (Ray Serve replicas).",
        strict_content_type=False,
    )
    app.state.ctx = ctx
    install_error_handlers(app)
    _add_offline_docs(app)
    app.include_router(_replica_routes(handle))
    misc = APIRouter()
    misc.routes.extend(r for r in misc_routes.router.routes if getattr(r, "path", None) not in _REPLICA_ROUTES)
    for router in (*(m.router for m in GENERATION_ROUTES), openai_embeddings.router, misc):
        app.include_router(router)
    if not options.disable_web_ui:
        web_ui.install(app)
    app.add_middleware(ServerMiddleware, ctx=ctx)
    return app


def _replica_routes(handle) -> APIRouter:
    router = APIRouter()
    health_doc = {
        200: {"description": 'at least one engine replica is running: {"status": "ok", "replicas": [...]}'},
        503: {"description": 'no engine replica is running: {"status": "unhealthy", ...}'},
    }

    @router.get("/health", tags=["server"], responses=health_doc)
    @router.head("/health", tags=["server"], responses=health_doc)
    async def health(raw: Request) -> JSONResponse:
        """No authentication. Every engine replica's state: running / waiting requests, KV cache use."""
        stats = await replica_stats(handle)
        client: ReplicaEngineClient = get_ctx(raw).aengine  # type: ignore[assignment]
        healthy = sum(s.healthy for s in stats)
        client.healthy_replicas = healthy
        body = {
            "status": "ok" if healthy else "unhealthy",
            "healthy_replicas": healthy,
            "replicas": [{k: v for k, v in asdict(s).items() if k != "metrics_text"} for s in stats],
        }
        return JSONResponse(body, status_code=200 if healthy else 503)

    @router.get(
        "/metrics",
        tags=["server"],
        response_class=Response,
        responses={
            200: {
                "content": {"text/plain": {}},
                "description": "Prometheus text format, every engine replica's series with a replica label",
            }
        },
    )
    async def metrics(raw: Request) -> Response:
        stats = await replica_stats(handle)
        ctx = get_ctx(raw)
        page = await asyncio.get_running_loop().run_in_executor(
            ctx.aengine.prep_pool, merge_replica_metrics, stats, ctx.model_name
        )
        return Response(page, media_type=CONTENT_TYPE_LATEST)

    return router


@serve.ingress()
class TokenmillIngress:
    """Builds its app once it knows the model: the first engine replica that answers sends its
    config and tokenizer (so the ingress needs neither the weights nor the model files)."""

    async def __init__(self, engine, options: ServerArgs):
        self.handle = engine
        frontend: EngineFrontend = await engine.frontend.remote()
        self.client = ReplicaEngineClient(engine, frontend)
        self.options = options

    def __serve_build_asgi_app__(self) -> FastAPI:
        return build_ingress_app(self.client, self.handle, self.options)
