"""The engine replica deployment: one tokenmill AsyncLLMEngine per Ray Serve replica.

The ingress calls `generate` through a streaming deployment handle (routed by
routing.TokenmillRouter), `encode` for embeddings, `frontend` once to learn the model (config, tokenizer), and
`stats` on every replica (handle.broadcast) for /metrics and /health. Serve calls
`check_health`: a replica whose engine loop died is replaced.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from ray import serve

from tokenmill.engine.async_engine import AsyncLLMEngine, EngineDeadError, QueueFullError
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.outputs import PoolingRequestOutput, RequestOutput
from tokenmill.pooling_params import PoolingParams
from tokenmill.sampling_params import SamplingParams
from tokenmill.server.metrics import ServerMetrics

logger = logging.getLogger("tokenmill.ray_serve")


@dataclass(frozen=True)
class ReplicaError:
    """An error a replica streams back as an item instead of raising it: Serve would wrap a raised
    exception in a RayTaskError whose message carries the replica's traceback, and the client
    needs the exact kind (400, 503 + Retry-After, ...). `kind`: value | queue_full | dead."""

    kind: str
    message: str

    @classmethod
    def of(cls, e: Exception) -> ReplicaError | None:
        """The item for an engine error the caller must see as itself; None for anything else."""
        for kind, types in (("value", ValueError), ("queue_full", QueueFullError), ("dead", EngineDeadError)):
            if isinstance(e, types):
                return cls(kind, str(e))
        return None

    def to_exception(self) -> Exception:
        if self.kind == "value":
            return ValueError(self.message)
        if self.kind == "queue_full":
            return QueueFullError(self.message)
        return EngineDeadError(self.message)


@dataclass
class EngineFrontend:
    """What the ingress needs of an engine without its weights: the config, the tokenizer and the
    EOS ids. Tokenizing and chat templates run in the ingress (on its prep pool); the replica
    only steps the model. Its methods are LLMEngine's own, which use nothing else."""

    config: Any  # EngineConfig
    tokenizer: Any
    eos_token_ids: frozenset[int]
    task: str = "generate"  # or "embed" (LLMEngine.task)

    encode = LLMEngine.encode
    render_chat_template = LLMEngine.render_chat_template
    apply_chat_template = LLMEngine.apply_chat_template
    check_priority = LLMEngine.check_priority


@dataclass
class ReplicaStats:
    """One replica's state, as /health and /metrics report it."""

    replica: str  # Serve's replica id (the actor is SERVE_REPLICA::<app>#<deployment>#<replica>)
    actor_name: str
    healthy: bool
    error: str | None
    running: int
    waiting: int
    kv_cache_usage: float
    free_blocks: int
    usable_blocks: int
    in_flight: int
    metrics_text: bytes  # the replica's Prometheus registry (generate_latest)


class EngineReplica:
    """One engine per replica. `engine_kwargs`: EngineArgs fields; `setup`: an optional function
    called with the AsyncLLMEngine once it is built (custom step observers, tracing)."""

    def __init__(
        self, engine_kwargs: dict, max_waiting: int | None = None, setup: Callable[[AsyncLLMEngine], None] | None = None
    ):
        t0 = time.perf_counter()
        self.aengine = AsyncLLMEngine.from_args(max_waiting=max_waiting, **engine_kwargs)
        engine = self.aengine.engine
        self.metrics = ServerMetrics(self.aengine, engine.config.model.name)
        context = serve.get_replica_context()
        self.replica_id = context.replica_id.unique_id
        self.actor_name = context.replica_id.to_full_id_str()
        if setup is not None:
            setup(self.aengine)
        logger.info("engine replica %s ready in %.1f s", self.replica_id, time.perf_counter() - t0)

    async def generate(
        self,
        prompt_ids: list[int],
        params: SamplingParams | None,
        request_id: str,
        parent_id: str | None = None,
        *,
        priority: int = 0,
        cache_salt: str | None = None,
    ) -> AsyncIterator[RequestOutput | ReplicaError]:
        """The engine's outputs without prompt_token_ids (the caller has them: a 1,000-token prompt
        would otherwise cross the wire with every token). Errors come as one ReplicaError item.
        A caller that goes away (Serve cancels this generator) aborts the request, freeing its blocks."""
        finished = False
        try:
            async for out in self.aengine.generate(
                prompt_ids, params, request_id, parent_id, priority=priority, cache_salt=cache_salt
            ):
                finished = out.finished
                yield dataclasses.replace(out, prompt_token_ids=[])
        except (ValueError, QueueFullError, EngineDeadError) as e:
            finished = True
            yield ReplicaError.of(e)
        finally:
            if not finished:  # closed by the caller (a client disconnect): counted as the server does
                self.metrics.on_abort()

    async def encode(
        self, request_id: str, prompts: list[str | list[int]], params: PoolingParams | None
    ) -> list[PoolingRequestOutput] | ReplicaError:
        """Embeddings (--task embed engines): AsyncLLMEngine.encode, its errors returned as a
        ReplicaError. The request id comes first so the router does not read prompts as token ids."""
        try:
            return await self.aengine.encode(prompts, params, request_id)
        except (ValueError, QueueFullError, EngineDeadError) as e:
            return ReplicaError.of(e)

    def frontend(self) -> EngineFrontend:
        engine = self.aengine.engine
        return EngineFrontend(engine.config, engine.tokenizer, engine.eos_token_ids, engine.task)

    async def stats(self) -> ReplicaStats:
        aengine = self.aengine
        core = aengine.engine.core
        error = aengine.error
        return ReplicaStats(
            replica=self.replica_id,
            actor_name=self.actor_name,
            healthy=aengine.is_running,
            error=None if error is None else repr(error),
            running=len(core.scheduler.running),
            waiting=len(core.scheduler.waiting),
            kv_cache_usage=core.kv.usage(),
            free_blocks=core.kv.num_free_blocks,
            usable_blocks=core.kv.num_usable_blocks,
            in_flight=aengine.num_in_flight(),
            metrics_text=self.metrics.render(),
        )

    def check_health(self) -> None:
        """Serve's health check: a replica whose engine died (its loop raised, a tensor-parallel worker
        died) is marked unhealthy, and Serve replaces it."""
        if not self.aengine.is_running:
            raise RuntimeError(f"the engine of replica {self.replica_id} is not running: {self.aengine.error!r}")

    def __del__(self) -> None:
        aengine = getattr(self, "aengine", None)
        if aengine is not None:
            aengine.shutdown()
