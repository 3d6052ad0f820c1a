"""ReplicaEngineClient: the async surface of AsyncLLMEngine that the server's routes use, over
the engine replicas' deployment handle, so that the OpenAI and TGI routes run unchanged in the
Ray Serve ingress.

Faults: a request whose replica dies before its first output (queued there, or sent to a
replica that had just died) is sent again and lands on a live replica: nothing reached the
client, and the dead engine took the request with it. A request that had started streaming
ends with EngineDeadError, which the routes turn into an error event (or a 503), never a hang.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from ray.exceptions import ActorUnavailableError, RayActorError, RayTaskError
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError, RequestCancelledError

from tokenmill.engine.async_engine import EngineDeadError, QueueFullError
from tokenmill.outputs import PoolingRequestOutput, RequestOutput
from tokenmill.pooling_params import PoolingParams
from tokenmill.ray_serve.replica import EngineFrontend, ReplicaError
from tokenmill.sampling_params import SamplingParams

logger = logging.getLogger("tokenmill.ray_serve")

MAX_SEND_ATTEMPTS = 4  # a request that has not started is sent again after its replica died
_REPLICA_GONE = (RayActorError, ActorUnavailableError, DeploymentUnavailableError)  # ActorDiedError included


def replica_gone(e: BaseException) -> bool:
    """The replica died or became unreachable (not: the request itself failed)."""
    if isinstance(e, _REPLICA_GONE):
        return True
    return isinstance(e, RayTaskError) and isinstance(getattr(e, "cause", None), _REPLICA_GONE)


def _resendable(e: Exception, what: str, attempt: int) -> Exception:
    """`e` back when the call may be sent again (its replica died); otherwise raises what the
    caller must see (QueueFullError for Serve's back-pressure, anything else as it came)."""
    if isinstance(e, BackPressureError):
        raise QueueFullError(f"every engine replica is at its queue limit; retry later ({e})") from None
    if not replica_gone(e):
        raise e
    logger.warning(
        "%s: its engine replica died (%s); sending it again (attempt %d of %d)",
        what,
        type(e).__name__,
        attempt + 2,
        MAX_SEND_ATTEMPTS,
    )
    return e


@dataclass
class _InFlight:
    response: Any = None  # the DeploymentResponseGenerator of the current attempt
    finished: bool = False  # the last output came: nothing to cancel
    error: BaseException | None = None  # set by abort_all: what the stream ends with


class ReplicaEngineClient:
    """`engine` is the EngineFrontend (config, tokenizer) that ServerContext reads; `generate`
    streams from a replica chosen by the deployment's request router."""

    def __init__(self, handle, frontend: EngineFrontend):
        self.engine = frontend
        self._generate = handle.options(stream=True, method_name="generate")
        self._encode = handle.options(method_name="encode")
        self.prep_pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="tokenmill-prep")
        self.step_observers: list = []  # the engines' observers live in the replicas
        self._streams: dict[str, _InFlight] = {}
        self.healthy_replicas: int | None = None  # last seen by /health; None: not asked yet
        self.error: BaseException | None = None

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def is_running(self) -> bool:
        return self.healthy_replicas is None or self.healthy_replicas > 0

    def num_in_flight(self) -> int:
        return len(self._streams)

    async def generate(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        parent_id: str | None = None,
        *,
        priority: int = 0,
        cache_salt: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """AsyncLLMEngine.generate's contract: RequestOutputs until the request finishes; ValueError,
        QueueFullError or EngineDeadError before the first output; closing it aborts the request."""
        rid = request_id or f"req-{uuid.uuid4().hex}"
        if rid in self._streams:
            raise ValueError(f"request id {rid!r} is already in use")
        state = self._streams[rid] = _InFlight()
        try:
            if isinstance(prompt, str):
                loop = asyncio.get_running_loop()
                prompt = await loop.run_in_executor(self.prep_pool, self.engine.encode, prompt)
            ids = list(prompt)
            extras = {"priority": priority, "cache_salt": cache_salt}
            async for out in self._attempts(ids, params, rid, parent_id, extras, state):
                yield out
        finally:
            self._streams.pop(rid, None)
            if state.response is not None and not state.finished:
                state.response.cancel()  # the replica aborts the request and frees its blocks

    async def _attempts(
        self, ids: list[int], params, rid: str, parent_id: str | None, extras: dict, state: _InFlight
    ) -> AsyncIterator[RequestOutput]:
        last_error: BaseException | None = None
        for attempt in range(MAX_SEND_ATTEMPTS):
            started = False
            state.response = response = self._generate.remote(ids, params, rid, parent_id, **extras)
            try:
                async for item in response:
                    if isinstance(item, ReplicaError):
                        raise item.to_exception()
                    item.prompt_token_ids = ids  # the replica leaves them out (see EngineReplica.generate)
                    started = True
                    state.finished = item.finished
                    yield item
                    if item.finished:
                        return
                raise EngineDeadError("the engine replica ended the stream before the request finished")
            except (RequestCancelledError, asyncio.CancelledError):
                if state.error is not None:  # abort_all
                    raise state.error from None
                raise
            except Exception as e:  # noqa: BLE001 - sorted by _resendable
                if started and replica_gone(e):
                    raise EngineDeadError(
                        f"the engine replica serving this request died ({type(e).__name__}); the request was aborted"
                    ) from None
                last_error = _resendable(e, f"request {rid}", attempt)
        raise EngineDeadError(f"no engine replica could take the request: {last_error!r}")

    async def encode(
        self, prompts: list[str | list[int]], params: PoolingParams | None = None, request_id: str | None = None
    ) -> list[PoolingRequestOutput]:
        """AsyncLLMEngine.encode's contract, on one replica. Embeddings have no side effects, so a
        call whose replica died is sent again whatever it had done; cancelling cancels the replica's."""
        rid = request_id or f"embd-{uuid.uuid4().hex}"
        last_error: BaseException | None = None
        for attempt in range(MAX_SEND_ATTEMPTS):
            response = self._encode.remote(rid, list(prompts), params)
            try:
                result = await response
            except asyncio.CancelledError:
                response.cancel()  # the replica aborts what is still running
                raise
            except Exception as e:  # noqa: BLE001 - sorted by _resendable
                last_error = _resendable(e, f"embeddings {rid}", attempt)
                continue
            if isinstance(result, ReplicaError):
                raise result.to_exception()
            return result
        raise EngineDeadError(f"no engine replica could take the request: {last_error!r}")

    def abort(self, request_id: str) -> None:
        state = self._streams.get(request_id)
        if state is not None and state.response is not None:
            state.response.cancel()

    def abort_all(self, error: BaseException) -> None:
        """Ends every request in flight with `error` (a server's drain timeout)."""
        for state in list(self._streams.values()):
            state.error = error
            if state.response is not None:
                state.response.cancel()

    def shutdown(self, timeout: float = 5.0) -> None:
        self.prep_pool.shutdown(wait=False, cancel_futures=True)
