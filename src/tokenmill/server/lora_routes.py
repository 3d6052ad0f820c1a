"""POST /v1/load_lora_adapter and /v1/unload_lora_adapter: LoRA adapters added and removed at run
time, as vLLM's routes, behind --allow-runtime-lora-updating (or vLLM's environment variable
VLLM_ALLOW_RUNTIME_LORA_UPDATING=True through the CLI) and the API key like every route.

Without the flag (or without --enable-lora) both answer 404 with a message saying how to turn
them on, and are left out of /openapi.json. An adapter is read and checked against the base
model on the prep pool, never on the event loop or the engine thread; one that cannot serve
(no such folder, shapes of another model, a rank above --max-lora-rank, modules_to_save, ...)
is a 400 whose message is the loader's, as is a name already loaded; with --lora-path-allowlist, so
is a path outside it (one message, whether or not the path exists). Any other failure is a 500
that names a request id, never the exception (which could quote the folder's files). Unloading forgets the
name at once: new requests naming it get 404, requests already running with it finish with it.
"""

from __future__ import annotations

import itertools

from fastapi import APIRouter, Request, Response
from fastapi.responses import PlainTextResponse

from tokenmill.lora.adapter import LoRAError
from tokenmill.lora.request import LoRARequest
from tokenmill.server.context import ServerContext, get_ctx
from tokenmill.server.errors import APIError, CheckedRoute
from tokenmill.server.protocol import ErrorResponse, LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest

router = APIRouter(tags=["LoRA"], route_class=CheckedRoute)

# The routes declare response_class=Response (no media type) so that FastAPI documents the error
# models as the JSON they are; with PlainTextResponse it files them under text/plain, the success's type.
_OK = {
    200: {
        "content": {"text/plain": {"schema": {"type": "string"}}},
        "description": "Success: LoRA adapter '<name>' added / removed successfully.",
    }
}
_ERR = {
    401: {"model": ErrorResponse, "description": "missing or wrong API key"},
    413: {"model": ErrorResponse, "description": "body over --max-request-body-bytes"},
    500: {
        "model": ErrorResponse,
        "description": "an unexpected error (the message names a request id; the details are in the server's log)",
    },
}


def runtime_updating_allowed(ctx: ServerContext) -> bool:
    registry = ctx.lora
    return registry is not None and registry.config.allow_runtime_lora_updating


def _registry(ctx: ServerContext):
    if not runtime_updating_allowed(ctx):
        raise APIError(
            "loading LoRA adapters at run time is off: start the server with --enable-lora and "
            "--allow-runtime-lora-updating (or VLLM_ALLOW_RUNTIME_LORA_UPDATING=True)",
            404,
        )
    return ctx.lora


def _next_id(raw: Request, registry) -> int:
    """An lora_int_id for a new adapter, past every registered one (on the event loop: no race)."""
    ids = getattr(raw.app.state, "lora_ids", None)
    if ids is None:
        known = [registry.lookup(n) for n in registry.names()]
        ids = raw.app.state.lora_ids = itertools.count(max((r.lora_int_id for r in known if r), default=0) + 1)
    return next(ids)


@router.post(
    "/v1/load_lora_adapter",
    response_class=Response,
    responses={
        **_OK,
        400: {
            "model": ErrorResponse,
            "description": "an adapter that cannot serve on this base model (a "
            "malformed config, weights of another model, ...), a path "
            "outside --lora-path-allowlist, a name already loaded, or "
            "a malformed body",
        },
        404: {"model": ErrorResponse, "description": "runtime loading is off"},
        **_ERR,
    },
)
async def load_lora_adapter(body: LoadLoRAAdapterRequest, raw: Request) -> PlainTextResponse:
    """Reads, checks and registers a PEFT adapter folder; requests then name it as `model`."""
    ctx = get_ctx(raw)
    registry = _registry(ctx)
    name = body.lora_name
    if name == ctx.model_name:
        raise APIError(f"`{name}` is the base model's name; give the LoRA adapter another", param="lora_name")
    if registry.lookup(name) is not None:
        raise APIError(f"The LoRA adapter `{name}` has already been loaded.", param="lora_name")
    request = LoRARequest(name, _next_id(raw, registry), body.lora_path)
    try:
        await ctx.offload(registry.add, request)  # reads the folder: on the prep pool
    except LoRAError as e:
        raise APIError(str(e), param="lora_path" if registry.lookup(name) is None else "lora_name") from None
    return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")


@router.post(
    "/v1/unload_lora_adapter",
    response_class=Response,
    responses={
        **_OK,
        400: {"model": ErrorResponse, "description": "a malformed body (no lora_name)"},
        404: {"model": ErrorResponse, "description": "no adapter of this name, or runtime loading is off"},
        **_ERR,
    },
)
async def unload_lora_adapter(body: UnloadLoRAAdapterRequest, raw: Request) -> PlainTextResponse:
    """Forgets an adapter: new requests naming it get 404; those running with it finish."""
    ctx = get_ctx(raw)
    if not _registry(ctx).remove(body.lora_name):
        raise APIError(f"The LoRA adapter `{body.lora_name}` cannot be found.", 404, "lora_name")
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")
