"""The server's context (ServerContext: the engine, its ServerArgs, metrics, tracer, stored
responses), which every route reaches through its request (get_ctx)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fastapi import Request

from tokenmill.engine.async_engine import AsyncLLMEngine
from tokenmill.server.args import ServerArgs
from tokenmill.server.errors import APIError

T = TypeVar("T")


class _Arg:
    """A ServerContext attribute that is its ServerArgs' field of the same name (read and set)."""

    def __set_name__(self, owner, name: str) -> None:
        self.name = name

    def __get__(self, ctx, owner=None):
        return self if ctx is None else getattr(ctx.args, self.name)

    def __set__(self, ctx, value) -> None:
        setattr(ctx.args, self.name, value)


@dataclass
class ServerContext:
    aengine: AsyncLLMEngine
    model_name: str
    metrics: Any  # ServerMetrics
    args: ServerArgs = field(default_factory=ServerArgs)
    response_store: Any = None  # openai_responses.ResponseStore: the Responses API's stored responses
    tracer: Any = None  # tracing.RequestTracer with --otlp-traces-endpoint, else None (no cost)
    started: float = field(default_factory=time.time)

    # The flags the routes read, as attributes (setting one sets the ServerArgs' field)
    api_key = _Arg()
    max_logprobs = _Arg()
    chat_template = _Arg()
    trust_request_chat_template = _Arg()
    max_request_body_bytes = _Arg()  # 0: no limit
    max_prompts_per_request = _Arg()
    max_response_values = _Arg()  # 0: no bound

    async def offload(self, fn: Callable[..., T], *args) -> T:
        """fn(*args) on the engine's prep pool: tokenizing and template rendering never block the
        event loop (nor the engine thread)."""
        return await asyncio.get_running_loop().run_in_executor(self.aengine.prep_pool, fn, *args)

    def encode(self, text: str, add_special_tokens: bool = True, param: str = "prompt") -> list[int]:
        """Token ids of request text; a 400 naming `param` for text that cannot be tokenized."""
        try:
            return self.engine.encode(text, add_special_tokens, what=param)
        except ValueError as e:
            raise APIError(str(e), param=param) from None

    @property
    def engine(self):
        return self.aengine.engine

    @property
    def tokenizer(self):
        return self.aengine.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.aengine.engine.config.model.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.aengine.engine.config.model.vocab_size

    @property
    def model_aliases(self) -> tuple[str, ...]:
        """Other names requests may give for the served model (a GGUF file's path: ModelConfig.aliases)."""
        return getattr(self.aengine.engine.config.model, "aliases", ())

    @property
    def lora(self):
        """The engine's LoRARegistry (lora/registry.py), or None without --enable-lora."""
        return getattr(self.aengine.engine, "lora", None)


def get_ctx(request: Request) -> ServerContext:
    return request.app.state.ctx
